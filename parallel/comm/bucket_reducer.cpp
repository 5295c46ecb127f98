#include "parallel/comm/bucket_reducer.h"

#include <algorithm>

#include "engine/trace.h"

namespace replica {

BucketReducer::BucketReducer(const std::vector<Model*>& replicas, size_t first_bucket_bytes,
                             size_t bucket_bytes, std::function<void(int)> collective,
                             const char* wait_phase,
                             std::function<void(int, int)> replica_done)
    : buckets_(make_buckets(replicas[0]->params(), first_bucket_bytes, bucket_bytes)),
      wait_phase_(wait_phase),
      replica_done_(std::move(replica_done)),
      comm_(std::move(collective)) {
  // Param* -> its bucket, per replica (grad hooks report parameters by pointer).
  for (Model* m : replicas) {
    auto& of = bucket_of_.emplace_back();
    for (size_t b = 0; b < buckets_.size(); ++b)
      for (int p : buckets_[b].params) of[m->params()[p]] = int(b);
  }
  remaining_.assign(replicas.size(), std::vector<int>(buckets_.size(), 0));
  ready_replicas_.assign(buckets_.size(), 0);
}

BucketReducer::~BucketReducer() = default;

void BucketReducer::begin(int active, bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  active_ = active;
  sync_ = sync;
  for (int r = 0; r < active; ++r)
    for (size_t b = 0; b < buckets_.size(); ++b)
      remaining_[r][b] = static_cast<int>(buckets_[b].params.size());
  std::fill(ready_replicas_.begin(), ready_replicas_.end(), 0);
  next_launch_ = 0;
  comm_.reset();
}

void BucketReducer::launch_ready_locked() {
  while (next_launch_ < int(buckets_.size()) && ready_replicas_[next_launch_] >= active_)
    comm_.push(next_launch_++);
}

void BucketReducer::on_ready(int replica, const std::vector<Param*>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_) return;
  for (const Param* p : params) {
    const int b = bucket_of_[replica].at(p);
    if (--remaining_[replica][b] == 0) {
      if (replica_done_) replica_done_(replica, b);
      ++ready_replicas_[b];
    }
  }
  launch_ready_locked();
}

void BucketReducer::finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_) return;
    // Parameters that got no gradient this step (unused): their buckets go now, still in order.
    std::fill(ready_replicas_.begin(), ready_replicas_.end(), active_);
    launch_ready_locked();
  }
  TraceSpan span("host", wait_phase_);
  comm_.wait(int(buckets_.size()));
}

}  // namespace replica
