// How a convolution's algorithm is chosen for cuDNN's legacy calls (conv.cu), and the limits
// its graph-API plans share (conv_graph.h): the workspace cap and where tensor cores are allowed.
// Private to engine/cuda.
#pragma once
#include <algorithm>
#include <mutex>
#include <vector>

#include "engine/cuda/cuda_backend.h"

namespace replica {

// Largest workspace an algorithm may ask for (beyond it the heuristics' next choice is used).
inline constexpr size_t kMaxConvWorkspace = size_t(512) << 20;

// Whether a context's convolutions may use tensor cores: tf32, or bf16 data.
inline bool conv_tensor_ops(const DeviceContext& ctx) {
  return ctx.precision() != Precision::Fp32;
}

// Picks the first algorithm in heuristic order that succeeded, fits the workspace cap, uses a
// math type the precision allows (fp32: no tensor ops; tf32, bf16: no down-conversion), is
// deterministic when asked, and whose workspace query accepts it under its math type.
// `ws_query(algo, &bytes)` returns the cuDNN status of that query.
template <class Perf, class Algo, class WsQuery>
bool choose_algo(const std::vector<Perf>& perf, int returned, const CudaState& s, bool tensor,
                 cudnnConvolutionDescriptor_t conv, WsQuery ws_query, ConvChoice<Algo>* out) {
  for (int i = 0; i < returned; ++i) {
    const Perf& r = perf[i];
    if (r.status != CUDNN_STATUS_SUCCESS) continue;
    if (r.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (!tensor && r.mathType == CUDNN_TENSOR_OP_MATH) continue;
    if (s.deterministic && r.determinism != CUDNN_DETERMINISTIC) continue;
    if (r.memory > kMaxConvWorkspace) continue;
    const cudnnMathType_t math = tensor ? r.mathType : CUDNN_FMA_MATH;
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, math));
    size_t bytes = 0;
    if (ws_query(r.algo, &bytes) != CUDNN_STATUS_SUCCESS) continue;
    if (bytes > kMaxConvWorkspace) continue;
    *out = {r.algo, bytes, math};
    return true;
  }
  return false;
}

// Chooses one direction's algorithm: lists the candidates (`count(&n)` checks its own call, then
// `find(timed, n, &returned, perf)` returns cuDNN's status: timed, fastest first, when the context
// benchmarks; else, or when timing fails, the heuristics' order) and takes the first acceptable
// one (choose_algo), else `fallback` with its workspace size, in the math the precision allows
// (FMA for fp32; DEFAULT for tf32 and bf16, whose data cuDNN may not run without tensor cores).
template <class Perf, class Algo, class Count, class Find, class WsQuery>
ConvChoice<Algo> pick_algo(const DeviceContext& ctx, cudnnConvolutionDescriptor_t conv,
                           Algo fallback, Count count, Find find, WsQuery ws_query) {
  // The heuristics list the math types the descriptor allows; for fp32 data DEFAULT permits
  // TF32 tensor cores (compute capability 8.0+), FMA forbids them; bf16 data runs on tensor
  // cores under DEFAULT.
  const CudaState& s = cuda_state(ctx);
  const bool tensor = conv_tensor_ops(ctx);
  REPLICA_CUDNN_CHECK(
      cudnnSetConvolutionMathType(conv, tensor ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
  int max_count = 0;
  count(&max_count);
  std::vector<Perf> perf(std::max(max_count, 1));
  int returned = 0;
  const int cap = static_cast<int>(perf.size());
  cudnnStatus_t timed = CUDNN_STATUS_NOT_SUPPORTED;
  if (s.benchmark) {
    std::lock_guard<std::mutex> lock(device_free_mutex());  // Find allocates and frees
    timed = find(true, cap, &returned, perf.data());
  }
  if (timed != CUDNN_STATUS_SUCCESS) REPLICA_CUDNN_CHECK(find(false, cap, &returned, perf.data()));
  ConvChoice<Algo> c;
  if (!choose_algo(perf, returned, s, tensor, conv, ws_query, &c)) {
    c = {fallback, 0, tensor ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH};
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, c.math));
    REPLICA_CUDNN_CHECK(ws_query(c.algo, &c.ws));
  }
  return c;
}

}  // namespace replica
