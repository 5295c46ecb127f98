// BucketReducer: what DP's and DDP's gradient synchronisation share. The model replicas of this
// process (DP: one per device; DDP: one) report finished parameters from their grad hooks; once
// every active replica has finished a bucket, the bucket's collective is launched on a
// communication thread, strictly in bucket order (identical on every rank, so the ranks'
// collectives pair up), while backward continues. finish() launches the buckets of parameters
// that got no gradient (unused ones), in order, and waits for every collective, rethrowing the
// first that failed. The collective itself is the caller's: DP sums a bucket into replica 0
// with its LocalGroup (dp_engine.cpp), DDP all-reduces it with its ProcessGroup and averages
// (ddp_engine.cpp).
#pragma once
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "layers/model.h"
#include "parallel/comm/buckets.h"
#include "parallel/comm/comm_queue.h"

namespace replica {

class BucketReducer {
 public:
  // `replicas[0]`'s parameters define the buckets; the others have the same layout.
  // `wait_phase` names the host's wait for the last collective in traces ("wait_reduce").
  // `replica_done(r, b)`, if given, runs on replica r's thread when r has finished bucket b,
  // before the bucket can launch (DP on CUDA records there the event its reduction waits for).
  BucketReducer(const std::vector<Model*>& replicas, size_t first_bucket_bytes,
                size_t bucket_bytes, std::function<void(int bucket)> collective,
                const char* wait_phase,
                std::function<void(int replica, int bucket)> replica_done = nullptr);
  ~BucketReducer();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // A new backward over replicas [0, active); with sync false nothing is launched (no_sync).
  void begin(int active, bool sync = true);
  // From replica r's grad hook (on r's thread).
  void on_ready(int replica, const std::vector<Param*>& params);
  // After every backward returned: launches the rest and waits for every bucket.
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void launch_ready_locked();

  std::vector<Bucket> buckets_;
  std::vector<std::unordered_map<const Param*, int>> bucket_of_;  // per replica
  const char* wait_phase_;
  std::function<void(int, int)> replica_done_;
  CommQueue comm_;

  std::mutex mutex_;  // guards the readiness bookkeeping below
  int active_ = 1;
  bool sync_ = true;
  std::vector<std::vector<int>> remaining_;  // [replica][bucket] parameters still to come
  std::vector<int> ready_replicas_;          // [bucket] replicas done with it
  int next_launch_ = 0;                      // buckets launch in order
};

}  // namespace replica
