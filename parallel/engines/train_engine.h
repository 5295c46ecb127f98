// TrainEngine: how one optimizer step over a global batch is carried out. The single-device
// engine is the reference; DP (threads over devices) and DDP (processes) implement the same
// interface, so the training loop, checkpoints and reports are shared by all of them.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/data/loader.h"
#include "layers/model.h"
#include "layers/optimizer.h"

namespace replica {

struct EngineOptions {
  std::string model = "cnn";
  Shape input_shape = {1, 28, 28};
  int64_t num_classes = 10;
  OptimizerOptions optimizer;
  uint64_t seed = 0;
  int threads_per_device = 0;  // CPU: threads in each device's arena (0 = cores / devices)
  bool deterministic = false;
  Precision precision = Precision::Fp32;  // resolved from --precision (engine/context.h)
  bool cudnn_benchmark = false;  // CUDA: convolution algorithms picked by timing them
  bool channels_last = false;    // CUDA: convolutions on NHWC operands (--memory-format)
  // Tests: prefetch() stages batches on CPU devices too, which otherwise read host batches in
  // place, so the staging runs where there is no GPU (BatchPrefetcher's stage_on_cpu;
  // replica-train sets it when REPLICA_PREFETCH_ON_CPU is in the environment).
  bool prefetch_on_cpu = false;
  // Each step captured once and replayed as a CUDA Graph (--cuda-graphs; CapturedStep). Single
  // device runs, and DP on one device; on CPU devices the capture is recorded op by op (tests).
  bool cuda_graphs = false;
};

// What each device's context is made with: `threads` CPU threads, the run's determinism,
// precision, choice of convolution algorithms and their operands' layout.
inline ContextOptions context_options(const EngineOptions& o, int threads) {
  return {threads, o.deterministic, o.precision, o.cudnn_benchmark, o.channels_last};
}

class CapturedStep;  // parallel/engines/captured_step.h

// What evaluating batches adds up: the summed loss and the samples whose label is the largest
// logit (top-1) or among the five largest (top-5; every sample with 5 classes or fewer), as
// PyTorch's ImageNet example counts Acc@1 and Acc@5.
struct EvalSums {
  static constexpr int kTopK = 5;  // the counts a batch's evaluation reads back: top-1 ... top-5
  double loss_sum = 0;
  int64_t top1 = 0, top5 = 0;
  EvalSums& operator+=(const EvalSums& o) {
    loss_sum += o.loss_sum;
    top1 += o.top1;
    top5 += o.top5;
    return *this;
  }
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  virtual std::string mode() const = 0;  // "single", "dp", "ddp"
  virtual std::vector<Device> devices() const = 0;
  // The context of every device this process drives (DP: one per replica), e.g. to put the
  // training set on them before training. Not for use while a step runs.
  virtual std::vector<DeviceContext*> contexts() = 0;

  // One optimizer step over a batch in host memory, or over the rows of a set held on the
  // devices (Batch::resident). May return before the device finishes; the caller keeps `batch`
  // alive until the next train_step or synchronize().
  virtual void train_step(const Batch& batch) = 0;
  // Starts copying `next`, the batch of the following train_step, to the devices while the
  // steps before it compute (GPUs, batches in host memory: BatchPrefetcher); that train_step
  // then reads the copies. Call it before the train_step that precedes `next`'s. Without it
  // train_step copies its batch itself. The copies are memory of this engine's devices: a
  // prefetched batch must be trained, or released, before the engine goes.
  virtual void prefetch(const Batch& next) = 0;
  // Whether prefetch() copies anything (a GPU, or prefetch_on_cpu): else a loop need not take
  // batches from its loader early.
  virtual bool prefetches() const = 0;
  // Mean training loss of the last step (reads it back: a host sync).
  virtual float last_loss() = 0;
  // Eval mode forward over one batch: adds its summed loss and top-1/top-5 counts to `sums`.
  virtual void eval_batch(const Batch& batch, EvalSums& sums) = 0;
  virtual void set_training(bool training) = 0;
  virtual void synchronize() = 0;

  // The primary replica (device 0) and its optimizer: what checkpoints save and restore.
  virtual Model& model() = 0;
  // Every replica this process trains, in contexts() order (DP: one per device).
  virtual std::vector<Model*> models() { return {&model()}; }
  virtual DeviceContext& primary() = 0;
  virtual Optimizer& optimizer() = 0;
  // After parameters/buffers/optimizer state of the primary were overwritten (resume):
  // bring every other replica in line.
  virtual void state_loaded() {}

  // Each of this process's devices' peak memory, in contexts() order, from its allocator: bytes
  // in use (PyTorch's max_memory_allocated) and bytes held, in use plus cached
  // (max_memory_reserved).
  std::vector<size_t> peak_memory_bytes() { return per_device(&Allocator::peak_bytes); }
  std::vector<size_t> peak_held_bytes() { return per_device(&Allocator::peak_held_bytes); }
  // What a training forward left in use on each device, in contexts() order: the activations
  // kept for backward (Model::forward_kept_bytes).
  std::vector<int64_t> forward_kept_bytes() {
    std::vector<int64_t> out;
    for (Model* m : models()) out.push_back(m->forward_kept_bytes());
    return out;
  }
  // This process's place in a multi-process job (DDP); one process otherwise.
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }
  // Sums per-process evaluation totals across processes (DDP); the identity otherwise.
  virtual void reduce_metrics(std::vector<double>& values) {}
  // Every process's `mine` (the same length everywhere), rank 0's first: exact per-rank
  // figures (DDP); `mine` itself otherwise. Every process must call it.
  virtual std::vector<int64_t> gather_from_ranks(const std::vector<int64_t>& mine) {
    return mine;
  }
  // Ends a multi-process job in order: returns once every process has finished its last
  // collective, so none leaves while a peer still talks to it. The identity otherwise.
  virtual void finish() {}
  // How gradients travel, for output and reports: "nccl", "gloo", "nccl over sockets, 2 ranks
  // on 1 GPU (...)" (DDP); empty where nothing crosses a process.
  virtual std::string comm_description() const { return ""; }
  // Whether devices (DP) or ranks (DDP) share a GPU: then the run checks correctness and
  // measures no scaling.
  virtual bool shares_gpu() const { return devices_share_hardware(devices()); }
  // Gradient bytes each device sends per step (0 for one device).
  virtual int64_t comm_bytes_per_step() const { return 0; }
  // Multiply-adds of one forward over one sample (for FLOP/s reports).
  virtual double forward_macs_per_sample() const = 0;
  // The step as captured with cuda_graphs (how many nodes, how many replays); null when the
  // engine runs its steps eagerly.
  virtual const CapturedStep* captured_step() const { return nullptr; }

 private:
  std::vector<size_t> per_device(size_t (Allocator::*read)() const) {
    std::vector<size_t> out;
    for (DeviceContext* c : contexts()) out.push_back((c->allocator().*read)());
    return out;
  }
};

// `mode` is what mode() says: DP on one device with cuda_graphs is this engine (dp_engine.cpp).
std::unique_ptr<TrainEngine> make_single_device_engine(const Device& device,
                                                       const EngineOptions& options,
                                                       const std::string& mode = "single");

}  // namespace replica
