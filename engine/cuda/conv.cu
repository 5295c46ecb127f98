// CUDA backend: 2-D convolution through cuDNN (NCHW, cross-correlation as PyTorch).
//
// Descriptors are built once per configuration and cached in the backend; algorithms are chosen
// once per configuration with cuDNN's *_v7 heuristics, or with --cudnn-benchmark by timing every
// algorithm on the shape (cuDNN's Find, as torch.backends.cudnn.benchmark; where cuDNN cannot
// time a shape, e.g. no memory for its trial buffers, the heuristics decide). In fp32 the math
// type is FMA (no TF32), so results match the CPU backend; in tf32 (Precision::Tf32) each direction runs with the math
// type of the algorithm chosen for it (tensor ops allowed, down-conversion to fp16/bf16 never).
// In bf16 (Precision::Bf16) the descriptors hold bf16 data with fp32 compute: F32 operands are
// rounded into bf16 scratch copies (BF16 activations are read as they are, unless transposed),
// results brought into the F32 or BF16 output tensors (bf16.cu). With
// ctx.channels_last() (bf16's default) the descriptors are NHWC (filters KRSC): the layout
// cuDNN's tensor-core kernels are written for. Only for convolutions whose input and output
// channels are multiples of 8, the shapes those kernels take (DeviceContext::nhwc_convolution);
// a first layer's 1-7 input channels are padded to 8 for them (conv_padded.cu), and the few
// other shapes stay NCHW, where every shape has run. An NHWC convolution's output is a
// channels_last tensor (engine/tensor.h), written where it is, and so is its input where the
// layer before wrote one: only NCHW operands are copied into NHWC.
// fp32 and tf32 convolutions on planes smaller than their kernel skip cuDNN for one GEMM with
// their plane matrix (conv_plane_matrix.cu; REPLICA_CUDA_PLANE_MATRIX=0 turns it off).
// With ctx.deterministic() only algorithms that cuDNN reports as deterministic are used. Bias
// forward/backward are own kernels (the bias gradient is a fixed-order per-channel reduction,
// so it is deterministic in every mode).
#include <algorithm>
#include <vector>

#include "engine/cuda/channel_pass.h"
#include "engine/cuda/conv_algo.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

using cuda::kCopiesPart;

int as_int(int64_t v, const char* what) {
  REPLICA_CHECK(v >= 0 && v <= INT32_MAX, "conv2d: {} = {} is out of cuDNN's range", what, v);
  return static_cast<int>(v);
}

// For a convolution that runs NCHW given channels_last tensors: Conv2d gives none (a
// convolution whose channels are not multiples of 8 reads and writes NCHW), but an op takes
// what it is given, through NCHW copies of them.
Tensor nchw_of(DeviceContext& ctx, const Tensor& t) {
  return t.nhwc_memory() ? cuda::nchw_copy(ctx, t) : t;
}

// Destroys the descriptors a plan has (any may still be null).
void destroy_plan(ConvPlan& plan) noexcept {
  if (plan.x) cudnnDestroyTensorDescriptor(plan.x);
  if (plan.y) cudnnDestroyTensorDescriptor(plan.y);
  if (plan.w) cudnnDestroyFilterDescriptor(plan.w);
  if (plan.conv) cudnnDestroyConvolutionDescriptor(plan.conv);
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
  const bool bf16 = ctx.precision() == Precision::Bf16, nhwc = ctx.nhwc_convolution(C, K);
  const cudnnDataType_t data = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const cudnnTensorFormat_t format = nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  ConvKey key{N, C, H, W, K, R, p.stride, p.padding, bf16, nhwc};
  auto it = conv_plans_.find(key);
  if (it != conv_plans_.end()) return it->second;

  ConvPlan plan;
  plan.spec.N = N, plan.spec.C = C, plan.spec.H = H, plan.spec.W = W, plan.spec.K = K;
  plan.spec.R = R, plan.spec.stride = p.stride, plan.spec.padding = p.padding;
  plan.spec.bf16 = bf16, plan.spec.nhwc = nhwc;
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
    plan.spec.P = P, plan.spec.Q = Q;
  } catch (...) {
    destroy_plan(plan);
    throw;
  }
  return conv_plans_.emplace(key, std::move(plan)).first->second;
}

namespace {

// The legacy calls' algorithm for `dir`, chosen on its first use (pick_algo, conv_algo.h).
void choose_legacy(const DeviceContext& ctx, ConvPlan& plan, ConvDirection dir) {
  const CudaState& s = cuda_state(ctx);
  if (dir == ConvDirection::Forward && !plan.have_fwd) {
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
  } else if (dir == ConvDirection::BackwardData && !plan.have_bwd_data) {
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
  } else if (dir == ConvDirection::BackwardFilter && !plan.have_bwd_filter) {
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
}

}  // namespace

void CudaBackend::run_conv(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir,
                           const ConvBuffers& b, float beta) {
  const CudaState& s = cuda_state(ctx);
  if (const ConvGraph* graph = conv_graph(ctx, plan, dir, beta, b)) {
    const Tensor ws = workspace(ctx, graph->workspace_bytes());
    try {
      graph->run(s.cudnn, b, elements<float>(ws));
      return;
    } catch (const Error& e) {  // a plan cuDNN refuses to execute: Auto goes on without it
      if (ctx.conv_api() == ConvApi::Graph) throw;
      leave_conv_graph(ctx, plan, dir, beta, e.what());
    }
  }
  choose_legacy(ctx, plan, dir);
  const float one = 1.f;
  void* const x = const_cast<void*>(b.x);
  void* const w = const_cast<void*>(b.w);
  void* const y = const_cast<void*>(b.y);
  const Tensor held = workspace(ctx, dir == ConvDirection::Forward        ? plan.fwd.ws
                                     : dir == ConvDirection::BackwardData ? plan.bwd_data.ws
                                                                          : plan.bwd_filter.ws);
  void* const ws = elements<float>(held);
  if (dir == ConvDirection::Forward) {
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.fwd.math));
    REPLICA_CUDNN_CHECK(cudnnConvolutionForward(s.cudnn, &one, plan.x, x, plan.w, w, plan.conv,
                                                plan.fwd.algo, ws, plan.fwd.ws, &beta, plan.y,
                                                y));
  } else if (dir == ConvDirection::BackwardData) {
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.bwd_data.math));
    REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardData(s.cudnn, &one, plan.w, w, plan.y, y,
                                                     plan.conv, plan.bwd_data.algo, ws,
                                                     plan.bwd_data.ws, &beta, plan.x, x));
  } else {
    REPLICA_CUDNN_CHECK(cudnnSetConvolutionMathType(plan.conv, plan.bwd_filter.math));
    REPLICA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(s.cudnn, &one, plan.x, x, plan.y, y,
                                                       plan.conv, plan.bwd_filter.algo, ws,
                                                       plan.bwd_filter.ws, &beta, plan.w, w));
  }
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
  if (padded_conv2d_forward(ctx, x, w, b, y, p)) return;  // a first layer's few channels
  if (plane_matrix_conv2d_forward(ctx, x, w, b, y, p)) return;  // planes under the kernel
  if ((x.nhwc_memory() || y.nhwc_memory()) && !ctx.nhwc_convolution(x.dim(1), K)) {
    Tensor yn = y.nhwc_memory() ? ctx.alloc(y.shape(), y.dtype()) : y;
    const Tensor xn = op_part(ctx, kCopiesPart, [&] { return nchw_of(ctx, x); });
    conv2d_forward(ctx, xn, w, b, yn, p);
    if (y.nhwc_memory())
      op_part(ctx, kCopiesPart, [&] { cuda::copy_relayout(y, yn, s.stream); });
    return;
  }
  if (x.dim(1) == 0) {  // no input channels: the sum is empty
    REPLICA_CUDA_CHECK(cudaMemsetAsync(y.raw(), 0, y.bytes(), s.stream));
  } else {
    ConvPlan& plan = conv_plan(ctx, x, w, p);
    const ProductIo io =
        op_part(ctx, kCopiesPart, [&] { return forward_io(ctx, x, w, y, plan.spec.nhwc); });
    op_part(ctx, "cuDNN forward",
            [&] { run_conv(ctx, plan, ConvDirection::Forward, {io.x, io.w, io.y}, 0.f); });
    op_part(ctx, kCopiesPart, [&] { io.finish(io.y, y, false, s.stream); });
  }
  if (b.defined() && y.numel() > 0)
    cuda::add_channel_bias(cuda::channel_dims(y), y, b, s.stream);
}

void CudaBackend::conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                                  const Conv2dParams& p, InputGrad dx_mode) {
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
  const bool add_to_dx = dx_mode == InputGrad::Accumulate;
  if (padded_conv2d_backward(ctx, x, w, dy, dx, dw, db, p, dx_mode)) return;
  if (plane_matrix_conv2d_backward(ctx, x, w, dy, dx, dw, db, p, dx_mode)) return;
  if ((x.nhwc_memory() || dy.nhwc_memory() || dx.nhwc_memory()) &&
      !ctx.nhwc_convolution(x.dim(1), K)) {
    Tensor dxn, xn, dyn;
    op_part(ctx, kCopiesPart, [&] {
      dxn = !dx.nhwc_memory() ? dx
            : add_to_dx      ? nchw_of(ctx, dx)
                             : ctx.alloc(dx.shape(), dx.dtype());
      xn = nchw_of(ctx, x);
      dyn = nchw_of(ctx, dy);
    });
    conv2d_backward(ctx, xn, w, dyn, dxn, dw, db, p, dx_mode);
    if (dx.nhwc_memory())
      op_part(ctx, kCopiesPart, [&] { cuda::copy_relayout(dx, dxn, cuda_state(ctx).stream); });
    return;
  }
  if (N == 0 || K == 0) {  // nothing flows back; dx (overwritten) is all zero
    if (dx.defined() && dx.numel() > 0 && !add_to_dx)
      REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), cuda_state(ctx).stream));
    return;
  }
  const cuda::ChannelDims bias = cuda::channel_dims(dy);
  const int bias_slices = db.defined() ? cuda::channel_slices(bias, op) : 0;  // before launches
  CudaState& s = cuda_state(ctx);
  const bool have_channels = x.dim(1) > 0;
  const bool want_dx = dx.defined() && dx.numel() > 0 && have_channels;
  const bool want_dw = dw.defined() && dw.numel() > 0 && have_channels;
  ConvPlan* const wanted = want_dx || want_dw ? &conv_plan(ctx, x, w, p) : nullptr;
  const ProductIo io = op_part(ctx, kCopiesPart, [&] {
    return backward_io(ctx, x, w, dy, want_dx ? &dx : nullptr, want_dw ? &dw : nullptr,
                       wanted && wanted->spec.nhwc, add_to_dx);
  });

  if (want_dx) {
    op_part(ctx, "cuDNN backward data", [&] {
      run_conv(ctx, *wanted, ConvDirection::BackwardData, {io.dx, io.w, io.dy},
               io.beta(add_to_dx, io.dx, dx));
    });
    op_part(ctx, kCopiesPart, [&] { io.finish(io.dx, dx, add_to_dx, s.stream); });
  } else if (dx.defined() && dx.numel() > 0 && !add_to_dx) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), s.stream));
  }
  if (want_dw) {
    // dw accumulates; staged, the call writes its own part, added by finish()
    op_part(ctx, "cuDNN backward filter", [&] {
      run_conv(ctx, *wanted, ConvDirection::BackwardFilter, {io.x, io.dw, io.dy},
               io.beta(true, io.dw, dw));
    });
    op_part(ctx, kCopiesPart, [&] { io.finish(io.dw, dw, true, s.stream); });
  }
  if (db.defined() && dy.numel() > 0)
    cuda::accumulate_bias_grad(bias, bias_slices, dy,
                               scratch(ctx, cuda::channel_sum_scratch(bias, bias_slices)), db,
                               s.stream);
}

}  // namespace replica
