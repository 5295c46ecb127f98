#include "parallel/ddp_reducer.h"

#include "engine/error.h"
#include "engine/trace.h"

namespace replica {

DdpReducer::DdpReducer(DeviceContext& ctx, Model& model, ProcessGroup& group,
                       size_t first_bucket_bytes, size_t bucket_bytes)
    : ctx_(ctx), model_(model), group_(group) {
  buckets_ = make_buckets(model.params(), first_bucket_bytes, bucket_bytes);
  bucket_of_ = bucket_of_param(model.params(), buckets_);
  remaining_.assign(buckets_.size(), 0);
  if (group.size() > 1)
    comm_ = std::make_unique<CommQueue>([this](int b) {
      TraceSpan span("comm", "allreduce");
      ctx_.activate();
      Tensor view = model_.flat_grads().view(buckets_[b].offset, {buckets_[b].numel});
      group_.allreduce_sum(ctx_, view, /*persistent=*/true);
    });
}

DdpReducer::~DdpReducer() = default;

void DdpReducer::begin(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
  for (size_t b = 0; b < buckets_.size(); ++b) remaining_[b] = int(buckets_[b].params.size());
  next_launch_ = 0;
  if (comm_) comm_->reset();
}

void DdpReducer::launch_ready_locked() {
  while (next_launch_ < int(buckets_.size()) && remaining_[next_launch_] == 0)
    comm_->push(next_launch_++);
}

void DdpReducer::on_ready(const std::vector<Param*>& params) {
  if (group_.size() <= 1) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_) return;
  for (const Param* p : params) --remaining_[bucket_of_.at(p)];
  launch_ready_locked();
}

void DdpReducer::finalize() {
  if (group_.size() <= 1) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_) return;
    // Parameters that got no gradient this step (unused): their buckets go now, still in order.
    for (auto& r : remaining_) r = 0;
    launch_ready_locked();
  }
  {
    TraceSpan span("host", "wait_allreduce");
    comm_->wait(int(buckets_.size()));  // every all-reduce enqueued (Gloo: done)
  }
  group_.stream_wait(ctx_);  // GPU: the step's kernels wait for the last bucket
  ctx_.ops().scale(ctx_, model_.flat_grads(), 1.f / float(group_.size()));
}

}  // namespace replica
