// DdpReducer: DDP's gradient synchronisation. Parameters are grouped into buckets (reverse
// order, first bucket small); when backward has finished every parameter of a bucket, the
// bucket's all-reduce is launched — strictly in bucket order, identical on every rank, so
// collectives always pair up — on a communication thread while backward continues.
// finalize() waits for every bucket and divides by the world size (the average gradient).
// begin(false) is no_sync: gradients accumulate locally and nothing is communicated.
#pragma once
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "layers/model.h"
#include "parallel/buckets.h"
#include "parallel/comm_queue.h"
#include "parallel/process_group.h"

namespace replica {

class DdpReducer {
 public:
  DdpReducer(DeviceContext& ctx, Model& model, ProcessGroup& group, size_t first_bucket_bytes,
             size_t bucket_bytes);
  ~DdpReducer();
  DdpReducer(const DdpReducer&) = delete;
  DdpReducer& operator=(const DdpReducer&) = delete;

  void begin(bool sync);
  void on_ready(const std::vector<Param*>& params);  // from the grad hook
  void finalize();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t bytes_per_step() const { return model_.num_params() * int64_t(sizeof(float)); }

 private:
  void launch_ready_locked();  // queue completed buckets in order

  DeviceContext& ctx_;
  Model& model_;
  ProcessGroup& group_;
  std::vector<Bucket> buckets_;
  std::unordered_map<const Param*, int> bucket_of_;

  std::mutex mutex_;  // guards the readiness bookkeeping below
  bool sync_ = true;
  std::vector<int> remaining_;
  int next_launch_ = 0;
  std::unique_ptr<CommQueue> comm_;  // all-reduces buckets (world size > 1)
};

}  // namespace replica
