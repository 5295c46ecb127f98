// RootReducer: DP's gradient reduction. Each replica's grad hook reports finished parameters;
// once every active replica has finished a bucket, that bucket is summed into replica 0's
// gradients while the rest of backward still runs (a BucketReducer's communication thread).
// Strategies: to-root (PyTorch's: replica 0 adds every other replica's bucket in turn) and tree
// (Caffe's: pairs add in log2(N) rounds). Both sum in a fixed order, so results are
// reproducible; they differ from each other only by floating-point association.
// On distinct GPUs, buckets are reduced with NCCL in single-process mode (LocalNccl) as they
// complete, each device's part on its own stream. Otherwise on CUDA (logical devices sharing a
// GPU; distinct GPUs without NCCL) every bucket is summed as it completes on a communication
// stream of device 0 (a context of its own): each replica records an event on its stream when
// it has finished the bucket, the communication stream waits for those events and adds, and
// device 0's stream waits for the communication stream before the optimizer step. No host
// sync; the adds overlap the rest of backward.
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
  // "gradients written" event, which buckets launched by finish() wait for).
  void backward_done(int replica);
  // After every backward returned: blocks until replica 0 holds the summed gradients (CPU), or
  // until every bucket's reduction is enqueued, device 0's stream waiting for them (CUDA).
  void finish();

  const std::vector<Bucket>& buckets() const { return buckets_->buckets(); }
  int64_t bytes_per_step(int active) const;  // gradient bytes moved to device 0 in one step
  // NCCL's broadcast for distinct GPUs, or null (then the engine copies).
  LocalNccl* nccl() { return nccl_.get(); }

 private:
  // Sums bucket b of replicas [0, active) into replica 0's: on each destination's context
  // (CPU), or all on the communication context (CUDA).
  void reduce_bucket(const Bucket& b);
  // CUDA: the communication stream waits until every active replica has written bucket b.
  void wait_for_bucket(int b);

  std::vector<DeviceContext*> ctx_;
  std::vector<Model*> models_;
  ReduceStrategy strategy_;
  std::unique_ptr<LocalNccl> nccl_;   // distinct GPUs: NCCL group reduce per bucket
  int active_ = 0;
  // Buckets in order, their reduction launched as backward finishes them.
  std::unique_ptr<BucketReducer> buckets_;

  // CUDA without NCCL: the communication context (device 0, a stream of its own) and the
  // events that order it: per replica and bucket "written" ([r][b], with whether it was
  // recorded this step), per replica "all gradients written", and "reduced" (-> device 0).
  std::unique_ptr<DeviceContext> comm_ctx_;
  std::vector<std::vector<std::unique_ptr<StreamEvent>>> bucket_written_;
  std::vector<std::vector<char>> written_this_step_;
  std::vector<std::unique_ptr<StreamEvent>> grads_written_;
  StreamEvent reduced_;
  Tensor staging_;  // peers on other GPUs land here before the add (one bucket at a time)
};

}  // namespace replica
