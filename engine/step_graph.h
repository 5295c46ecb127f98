// StepGraph: work captured once from a device's stream and replayed, step after step, without
// the host issuing it again (CUDA Graphs; PyTorch's torch.cuda.CUDAGraph). A small model's step
// on a GPU is hundreds of kernel launches of a few microseconds each: the host, not the GPU,
// sets the pace. Replayed as one graph, the launches cost one.
//
// What a replay does is what the capture enqueued, with the same arguments and addresses:
//   - inputs are copied into the tensors the capture read (the caller's job), and numbers that
//     change from step to step are read from device memory written before each replay (the
//     optimizers' step scalars, backend_ops.inc), never passed as kernel arguments;
//   - memory the captured work allocates comes from a private pool of the device's allocator
//     (engine/allocator.h), held while the graph lives: a replay writes those blocks again, so
//     nothing else may be handed them;
//   - while capturing, ops are recorded, not run: the captured code must not read what they
//     compute, nor wait for the device (DeviceContext::synchronize throws then).
// On CPU devices the ops are recorded as calls on the CPU backend and replayed in order: the
// same rules, checked without a GPU (tests; a CPU step gains nothing from it).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace replica {

class DeviceContext;

class StepGraph {
 public:
  // Captures the work `body` enqueues on ctx. Throws replica::Error when it cannot be captured
  // (the device refused something body did, or body threw); ctx is then as it was, none of
  // body's work has run, and the caller may run body on its own.
  StepGraph(DeviceContext& ctx, const std::function<void()>& body);
  ~StepGraph();  // waits for replays still running, then gives the pool back
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Enqueues the captured work on ctx's stream (on CPU: runs it).
  void replay();
  // Kernels, copies and library calls in the graph (on CPU: the ops recorded).
  size_t nodes() const { return nodes_; }

 private:
  DeviceContext& ctx_;
  int pool_ = 0;            // ctx's allocator pool of the graph's memory
  void* graph_ = nullptr;   // CUDA: the executable graph
  std::vector<std::function<void()>> calls_;  // CPU: the recorded ops, in order
  size_t nodes_ = 0;
};

}  // namespace replica
