// CUDA backend: 2-D convolution through cuDNN (NCHW, cross-correlation as PyTorch).
//
// Descriptors are built once per configuration and cached in the backend; algorithms are chosen
// once per configuration with cuDNN's *_v7 heuristics, or with --cudnn-benchmark by timing every
// algorithm on the shape (cuDNN's Find, as torch.backends.cudnn.benchmark; where cuDNN cannot
// time a shape, e.g. no memory for its trial buffers, the heuristics decide). In fp32 the math
// type is FMA (no TF32), so results match the CPU backend; in tf32 (Precision::Tf32) each direction runs with the math
// type of the algorithm chosen for it (tensor ops allowed, down-conversion to fp16/bf16 never).
// In bf16 (Precision::Bf16) the descriptors hold bf16 data with fp32 compute: operands are
// rounded into bf16 scratch copies, results widened back into the fp32 tensors (bf16.cu). With
// ctx.channels_last() (bf16's default) those copies, fp32 or bf16, are NHWC and so are the
// descriptors (filters KRSC): the layout cuDNN's tensor-core kernels are written for. Only for
// convolutions whose input and output channels are multiples of 8, the shapes those kernels
// take; the others (a first layer's 1 or 3 channels) stay NCHW, where every shape has run.
// With ctx.deterministic() only algorithms that cuDNN reports as deterministic are used. Bias
// forward/backward are own kernels (the bias gradient is a fixed-order per-channel reduction,
// so it is deterministic in every mode).
#include <algorithm>
#include <vector>

#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

// Largest workspace an algorithm may ask for (beyond it the heuristics' next choice is used).
constexpr size_t kMaxConvWorkspace = size_t(512) << 20;

int as_int(int64_t v, const char* what) {
  REPLICA_CHECK(v >= 0 && v <= INT32_MAX, "conv2d: {} = {} is out of cuDNN's range", what, v);
  return static_cast<int>(v);
}

// Whether a convolution of C input and K output channels runs on NHWC copies (see the top).
bool conv_nhwc(const DeviceContext& ctx, int64_t C, int64_t K) {
  return ctx.channels_last() && C % 8 == 0 && K % 8 == 0;
}

// Whether a context's convolutions may use tensor cores: tf32, or bf16 data.
bool tensor_ops(const DeviceContext& ctx) { return ctx.precision() != Precision::Fp32; }

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
  const bool tensor = tensor_ops(ctx);
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

// Destroys the descriptors a plan has (any may still be null).
void destroy_plan(ConvPlan& plan) noexcept {
  if (plan.x) cudnnDestroyTensorDescriptor(plan.x);
  if (plan.y) cudnnDestroyTensorDescriptor(plan.y);
  if (plan.w) cudnnDestroyFilterDescriptor(plan.w);
  if (plan.conv) cudnnDestroyConvolutionDescriptor(plan.conv);
}

// y[((n*K + k)*PQ + pq)] += b[k]
__global__ void add_channel_bias_kernel(float* y, const float* b, int64_t total, int64_t K,
                                        int64_t PQ) {
  REPLICA_GRID_STRIDE(i, total)
    y[i] += b[(i / PQ) % K];
}

// db[k] += sum over n, pq of dy[n, k, pq]. One block per channel; each thread sums a fixed
// strided subset in order, then a fixed tree: deterministic.
__global__ void channel_sum_accumulate_kernel(const float* dy, float* db, int64_t N, int64_t K,
                                              int64_t PQ) {
  __shared__ float partial[cuda::kThreads];
  const int64_t k = blockIdx.x;
  const int64_t count = N * PQ;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    const int64_t n = j / PQ, pq = j - n * PQ;
    s += dy[(n * K + k) * PQ + pq];
  }
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[k] += partial[0];
}

// Checks a convolution's shapes and returns its sizes (the same checks for every pass).
struct ConvDims {
  int64_t N, K, R, P, Q;
};

ConvDims conv_dims(const Tensor& x, const Tensor& w, const Conv2dParams& p, const char* op) {
  REPLICA_CHECK(x.ndim() == 4 && w.ndim() == 4 && w.dim(2) == w.dim(3) && w.dim(1) == x.dim(1),
                "{}: x {} and w {} must be [N, C, H, W] and [K, C, R, R]", op,
                shape_str(x.shape()), shape_str(w.shape()));
  REPLICA_CHECK(p.stride >= 1 && p.padding >= 0, "{}: stride {} / padding {} invalid", op,
                p.stride, p.padding);
  const int64_t R = w.dim(2);
  const int64_t P = window_out(x.dim(2), static_cast<int>(R), p.stride, p.padding);
  const int64_t Q = window_out(x.dim(3), static_cast<int>(R), p.stride, p.padding);
  REPLICA_CHECK(P >= 1 && Q >= 1, "{}: kernel {} does not fit input {} with padding {}", op, R,
                shape_str(x.shape()), p.padding);
  return {x.dim(0), w.dim(0), R, P, Q};
}

}  // namespace

void CudaBackend::destroy_conv_plans() noexcept {
  for (auto& [key, plan] : conv_plans_) destroy_plan(plan);
  conv_plans_.clear();
}

ConvPlan& CudaBackend::conv_plan(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                 const Conv2dParams& p) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t K = w.dim(0), R = w.dim(2);
  const bool bf16 = ctx.precision() == Precision::Bf16, nhwc = conv_nhwc(ctx, C, K);
  const cudnnDataType_t data = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const cudnnTensorFormat_t format = nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  ConvKey key{N, C, H, W, K, R, p.stride, p.padding, bf16, nhwc};
  auto it = conv_plans_.find(key);
  if (it != conv_plans_.end()) return it->second;

  ConvPlan plan;
  plan.nhwc = nhwc;
  try {
    REPLICA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan.x));
    REPLICA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan.y));
    REPLICA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan.w));
    REPLICA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&plan.conv));
    REPLICA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan.x, format, data,
                                                   as_int(N, "N"), as_int(C, "C"),
                                                   as_int(H, "H"), as_int(W, "W")));
    REPLICA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan.w, data, format,
                                                   as_int(K, "K"), as_int(C, "C"),
                                                   as_int(R, "R"), as_int(R, "R")));
    REPLICA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(plan.conv, p.padding, p.padding,
                                                        p.stride, p.stride, 1, 1,
                                                        CUDNN_CROSS_CORRELATION,
                                                        CUDNN_DATA_FLOAT));
    int on = 0, ok = 0, op = 0, oq = 0;
    REPLICA_CUDNN_CHECK(
        cudnnGetConvolution2dForwardOutputDim(plan.conv, plan.x, plan.w, &on, &ok, &op, &oq));
    const int64_t P = window_out(H, static_cast<int>(R), p.stride, p.padding);
    const int64_t Q = window_out(W, static_cast<int>(R), p.stride, p.padding);
    REPLICA_CHECK(on == N && ok == K && op == P && oq == Q,
                  "conv2d: cuDNN output [{}, {}, {}, {}] differs from expected [{}, {}, {}, {}]",
                  on, ok, op, oq, N, K, P, Q);
    REPLICA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan.y, format, data, on, ok, op, oq));
  } catch (...) {
    destroy_plan(plan);
    throw;
  }
  return conv_plans_.emplace(key, plan).first->second;
}

void CudaBackend::conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                 const Tensor& b, Tensor& y, const Conv2dParams& p) {
  const char* op = "conv2d_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, w, op, "w");
  cuda::expect_device(ctx, y, op, "y");
  const auto [N, K, R, P, Q] = conv_dims(x, w, p, op);
  cuda::expect_shape(y, {N, K, P, Q}, op, "y");
  if (b.defined()) {
    cuda::expect_device(ctx, b, op, "b");
    cuda::expect_numel(b, K, op, "b");
  }
  if (y.numel() == 0) return;
  CudaState& s = cuda_state(ctx);
  if (x.dim(1) == 0) {  // no input channels: the sum is empty
    REPLICA_CUDA_CHECK(cudaMemsetAsync(y.raw(), 0, y.bytes(), s.stream));
  } else {
    ConvPlan& plan = conv_plan(ctx, x, w, p);
    if (!plan.have_fwd) {
      plan.fwd = pick_algo<cudnnConvolutionFwdAlgoPerf_t>(
          ctx, plan.conv,
          CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,  // deterministic, no workspace
          [&](int* n) {
            REPLICA_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(s.cudnn, n));
          },
          [&](bool timed, int cap, int* returned, cudnnConvolutionFwdAlgoPerf_t* perf) {
            return (timed ? cudnnFindConvolutionForwardAlgorithm
                          : cudnnGetConvolutionForwardAlgorithm_v7)(
                s.cudnn, plan.x, plan.w, plan.conv, plan.y, cap, returned, perf);
          },
          [&](cudnnConvolutionFwdAlgo_t a, size_t* bytes) {
            return cudnnGetConvolutionForwardWorkspaceSize(s.cudnn, plan.x, plan.w, plan.conv,
                                                           plan.y, a, bytes);
          });
      plan.have_fwd = true;
    }
    void* ws = workspace(ctx, plan.fwd.ws);
    const float one = 1.f, zero = 0.f;
    const ProductIo io = forward_io(ctx, x, w, y, plan.nhwc);
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.fwd.math));
    REPLICA_CUDNN_CHECK(cudnnConvolutionForward(s.cudnn, &one, plan.x, io.x, plan.w, io.w,
                                                plan.conv, plan.fwd.algo, ws, plan.fwd.ws, &zero,
                                                plan.y, io.y));
    io.finish(io.y, y, false, s.stream);
  }
  if (b.defined()) {
    add_channel_bias_kernel<<<cuda::grid_for(y.numel()), cuda::kThreads, 0, s.stream>>>(
        y.f32(), b.f32(), y.numel(), K, P * Q);
    REPLICA_LAUNCH_CHECK();
  }
}

void CudaBackend::conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                                  const Conv2dParams& p) {
  const char* op = "conv2d_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, w, op, "w");
  cuda::expect_device(ctx, dy, op, "dy");
  const auto [N, K, R, P, Q] = conv_dims(x, w, p, op);
  cuda::expect_shape(dy, {N, K, P, Q}, op, "dy");
  if (dx.defined()) {
    cuda::expect_device(ctx, dx, op, "dx");
    cuda::expect_shape(dx, x.shape(), op, "dx");
  }
  if (dw.defined()) {
    cuda::expect_device(ctx, dw, op, "dw");
    cuda::expect_shape(dw, w.shape(), op, "dw");
  }
  if (db.defined()) {
    cuda::expect_device(ctx, db, op, "db");
    cuda::expect_numel(db, K, op, "db");
  }
  if (N == 0 || K == 0) {  // nothing flows back; dx (overwritten) is all zero
    if (dx.defined() && dx.numel() > 0)
      REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), cuda_state(ctx).stream));
    return;
  }
  CudaState& s = cuda_state(ctx);
  const float one = 1.f, zero = 0.f;
  const bool have_channels = x.dim(1) > 0;
  const bool want_dx = dx.defined() && dx.numel() > 0 && have_channels;
  const bool want_dw = dw.defined() && dw.numel() > 0 && have_channels;
  ConvPlan* const wanted = want_dx || want_dw ? &conv_plan(ctx, x, w, p) : nullptr;
  const ProductIo io = backward_io(ctx, x, w, dy, want_dx ? &dx : nullptr,
                                   want_dw ? &dw : nullptr, wanted && wanted->nhwc);

  if (want_dx) {
    ConvPlan& plan = *wanted;
    if (!plan.have_bwd_data) {
      plan.bwd_data = pick_algo<cudnnConvolutionBwdDataAlgoPerf_t>(
          ctx, plan.conv, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,  // deterministic
          [&](int* n) {
            REPLICA_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(s.cudnn, n));
          },
          [&](bool timed, int cap, int* returned, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
            return (timed ? cudnnFindConvolutionBackwardDataAlgorithm
                          : cudnnGetConvolutionBackwardDataAlgorithm_v7)(
                s.cudnn, plan.w, plan.y, plan.conv, plan.x, cap, returned, perf);
          },
          [&](cudnnConvolutionBwdDataAlgo_t a, size_t* bytes) {
            return cudnnGetConvolutionBackwardDataWorkspaceSize(s.cudnn, plan.w, plan.y,
                                                                plan.conv, plan.x, a, bytes);
          });
      plan.have_bwd_data = true;
    }
    void* ws = workspace(ctx, plan.bwd_data.ws);
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.bwd_data.math));
    REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardData(s.cudnn, &one, plan.w, io.w, plan.y, io.dy,
                                                     plan.conv, plan.bwd_data.algo, ws,
                                                     plan.bwd_data.ws, &zero, plan.x, io.dx));
    io.finish(io.dx, dx, false, s.stream);
  } else if (dx.defined() && dx.numel() > 0) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), s.stream));
  }

  if (want_dw) {
    ConvPlan& plan = *wanted;
    if (!plan.have_bwd_filter) {
      plan.bwd_filter = pick_algo<cudnnConvolutionBwdFilterAlgoPerf_t>(
          ctx, plan.conv, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,  // deterministic
          [&](int* n) {
            REPLICA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(s.cudnn, n));
          },
          [&](bool timed, int cap, int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
            return (timed ? cudnnFindConvolutionBackwardFilterAlgorithm
                          : cudnnGetConvolutionBackwardFilterAlgorithm_v7)(
                s.cudnn, plan.x, plan.y, plan.conv, plan.w, cap, returned, perf);
          },
          [&](cudnnConvolutionBwdFilterAlgo_t a, size_t* bytes) {
            return cudnnGetConvolutionBackwardFilterWorkspaceSize(s.cudnn, plan.x, plan.y,
                                                                  plan.conv, plan.w, a, bytes);
          });
      plan.have_bwd_filter = true;
    }
    void* ws = workspace(ctx, plan.bwd_filter.ws);
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.bwd_filter.math));
    const float beta = io.dw_beta();  // dw accumulates; staged: this call's part, added after
    REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
        s.cudnn, &one, plan.x, io.x, plan.y, io.dy, plan.conv, plan.bwd_filter.algo, ws,
        plan.bwd_filter.ws, &beta, plan.w, io.dw));
    io.finish(io.dw, dw, true, s.stream);
  }

  if (db.defined()) {
    channel_sum_accumulate_kernel<<<static_cast<unsigned>(K), cuda::kThreads, 0, s.stream>>>(
        dy.f32(), db.f32(), N, K, P * Q);
    REPLICA_LAUNCH_CHECK();
  }
}

}  // namespace replica
