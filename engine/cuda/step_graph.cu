// CUDA Graphs behind engine/step_graph.h: a step's kernels, copies and cuDNN/cuBLAS calls
// recorded from the context's stream once, then launched as one graph per step. A small model's
// step is hundreds of launches of a few microseconds each, which the host issues one by one;
// a graph is one launch, and the GPU walks its nodes without the host.
//
// Capture is in relaxed mode: the caching allocator may take a segment (cudaMalloc) while a
// step is captured, which the stricter modes forbid. What cannot be recorded (a host sync, a
// copy from pageable memory) fails the capture; capture_end then names the error, and the
// stream is out of capture again either way.
#include <fmt/format.h>

#include "engine/cuda/cuda_backend.h"

namespace replica {
namespace cuda {

void capture_begin(CudaState* state) {
  REPLICA_CUDA_CHECK(cudaStreamBeginCapture(state->stream, cudaStreamCaptureModeRelaxed));
}

void* capture_end(CudaState* state, size_t* nodes) {
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(state->stream, &graph);
  if (ended != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();  // the capture's error, not the device's: clear it
    if (graph) cudaGraphDestroy(graph);
    throw Error(fmt::format("CUDA could not capture the step: {} ({})",
                            cudaGetErrorString(ended), cudaGetErrorName(ended)));
  }
  cudaGraphExec_t exec = nullptr;
  size_t count = 0;
  const cudaError_t counted = cudaGraphGetNodes(graph, nullptr, &count);
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);  // the executable graph is a copy
  if (counted != cudaSuccess || made != cudaSuccess) {
    (void)cudaGetLastError();
    if (exec) cudaGraphExecDestroy(exec);
    const cudaError_t e = made != cudaSuccess ? made : counted;
    throw Error(fmt::format("CUDA could not instantiate the captured step: {} ({})",
                            cudaGetErrorString(e), cudaGetErrorName(e)));
  }
  if (nodes) *nodes = count;
  return exec;
}

void capture_abort(CudaState* state) {
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(state->stream, &graph);
  if (graph) cudaGraphDestroy(graph);  // recorded work that never runs: not instantiated
  (void)cudaGetLastError();
}

void graph_launch(CudaState* state, void* graph) {
  REPLICA_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), state->stream));
}

void graph_destroy(void* graph) {
  if (graph) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

}  // namespace cuda
}  // namespace replica
