// RootReducer: DP's gradient reduction. Each replica's grad hook reports finished parameters;
// once every active replica has finished a bucket, that bucket is summed into replica 0's
// gradients while the rest of backward still runs (a BucketReducer's communication thread).
// Strategies: to-root (PyTorch's: replica 0 adds every other replica's bucket in turn) and tree
// (Caffe's: pairs add in log2(N) rounds). Both sum in a fixed order, so results are
// reproducible; they differ from each other only by floating-point association.
// On distinct GPUs, buckets are reduced with NCCL in single-process mode (LocalNccl) as they
// complete, each device's part on its own stream. Logical devices sharing a GPU reduce after
// backward on device 0's stream, ordered by events (no host sync).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "layers/model.h"
#include "parallel/comm/bucket_reducer.h"
#include "parallel/comm/local_nccl.h"

namespace replica {

enum class ReduceStrategy { ToRoot, Tree };
ReduceStrategy parse_reduce_strategy(const std::string& name);  // "root" | "tree"

class RootReducer {
 public:
  RootReducer(std::vector<DeviceContext*> contexts, std::vector<Model*> models,
              ReduceStrategy strategy, size_t first_bucket_bytes, size_t bucket_bytes);
  ~RootReducer();
  RootReducer(const RootReducer&) = delete;
  RootReducer& operator=(const RootReducer&) = delete;

  // Starts a step in which replicas [0, active) run backward.
  void begin(int active);
  // From replica r's grad hook, on r's worker thread.
  void on_ready(int replica, const std::vector<Param*>& params);
  // Called on replica r's worker thread after its backward was enqueued (CUDA: records r's
  // "gradients written" event).
  void backward_done(int replica);
  // After every backward returned: blocks until replica 0 holds the summed gradients (CPU),
  // or enqueues the remaining reductions on device 0's stream (CUDA).
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_->buckets(); }
  int64_t bytes_per_step(int active) const;  // gradient bytes moved to device 0 in one step
  // NCCL's broadcast for distinct GPUs, or null (then the engine copies).
  LocalNccl* nccl() { return nccl_.get(); }

 private:
  void reduce_bucket_cpu(const Bucket& b);
  void reduce_all_cuda();

  std::vector<DeviceContext*> ctx_;
  std::vector<Model*> models_;
  ReduceStrategy strategy_;
  bool cuda_ = false;                 // CUDA devices, reduced by copies on device 0's stream
  std::unique_ptr<LocalNccl> nccl_;   // distinct GPUs: NCCL group reduce per bucket
  int active_ = 0;
  // Buckets in order, their reduction launched as backward finishes them (CPU devices, NCCL);
  // CUDA logical devices only use its bucket layout.
  std::unique_ptr<BucketReducer> buckets_;

  std::vector<std::unique_ptr<StreamEvent>> grads_written_;  // CUDA: per replica
  Tensor staging_;  // CUDA: peers on other GPUs land here before the add
};

}  // namespace replica
