// The CUDA backend (private to engine/cuda): cuBLAS for GEMM, cuDNN for convolution, own
// kernels for batch norm, elementwise work, pooling, losses and fused optimiser updates.
// Every op enqueues on the context's stream and never synchronises with the host. Member
// definitions are split by what they compute, in files named as the CPU backend's
// (engine/cpu/): elementwise.cu, dense.cu, conv.cu, norm.cu, pool.cu (max pooling; adaptive
// pooling beside it in adaptive_pool.cu), loss_optim.cu; shared checks and scratch memory in
// cuda_backend.cu.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "engine/cuda/conv_graph.h"
#include "engine/cuda/cuda_check.h"
#include "engine/cuda/op_parts.h"
#include "engine/ops.h"

// The body of a grid-stride loop over [0, n) in a kernel launched with cuda::grid_for(n) blocks.
#define REPLICA_GRID_STRIDE(i, n)                                                        \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n);              \
       i += int64_t(gridDim.x) * blockDim.x)

namespace replica {

namespace cuda {

constexpr int kThreads = 256;

std::unique_ptr<Backend> make_backend();  // cudart::make_backend() through the plugin table
// CUDA Graph capture and replay (engine/cudart.h; engine/cuda/step_graph.cu).
void capture_begin(CudaState* state);
void* capture_end(CudaState* state, size_t* nodes);
void capture_abort(CudaState* state);
void graph_launch(CudaState* state, void* graph);
void graph_destroy(void* graph);

// Blocks for a grid-stride loop over n elements (n > 0).
inline int grid_for(int64_t n, int threads = kThreads) {
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = int64_t(1) << 20;  // grid-stride beyond ~268M threads
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

// The sum of every thread's v in a block of a power-of-two size, in a fixed tree (so the same
// inputs give the same bits); sh holds blockDim.x doubles and may be reused on return.
__device__ __forceinline__ double block_sum(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
    __syncthreads();
  }
  const double r = sh[0];
  __syncthreads();
  return r;
}

// kVec consecutive elements, group g of an array, as floats: a float4 (F32) or 8 bytes (four
// BF16) loaded or stored at once where kVec is 4 (the caller has checked that the array is
// 16-byte aligned), else one element.
template <int kVec>
struct Pack {
  float v[kVec];
  template <class Index>
  __device__ __forceinline__ void load(const float* p, Index g) {
    if constexpr (kVec == 4) {
      const float4 f = reinterpret_cast<const float4*>(p)[g];
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      v[0] = p[g];
    }
  }
  template <class Index>
  __device__ __forceinline__ void load(const uint16_t* p, Index g) {
    if constexpr (kVec == 4) {
      const uint2 u = reinterpret_cast<const uint2*>(p)[g];  // element 0 in the low half
      v[0] = widen(uint16_t(u.x)), v[1] = widen(uint16_t(u.x >> 16));
      v[2] = widen(uint16_t(u.y)), v[3] = widen(uint16_t(u.y >> 16));
    } else {
      v[0] = widen(p[g]);
    }
  }
  template <class Index>
  __device__ __forceinline__ void store(float* p, Index g) const {
    if constexpr (kVec == 4) {
      reinterpret_cast<float4*>(p)[g] = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      p[g] = v[0];
    }
  }
  template <class Index>
  __device__ __forceinline__ void store(uint16_t* p, Index g) const {
    if constexpr (kVec == 4) {
      const auto bits = [&](int k) { return uint32_t(narrow<uint16_t>(v[k])); };
      reinterpret_cast<uint2*>(p)[g] =
          make_uint2(bits(0) | (bits(1) << 16), bits(2) | (bits(3) << 16));
    } else {
      p[g] = narrow<uint16_t>(v[0]);
    }
  }
};

// Whether every pointer is 16-byte aligned (null ones do not count): where float4s may move.
// Whole allocations always are (cudaMalloc aligns to 256); views at an offset may not be.
inline bool aligned16(std::initializer_list<const void*> pointers) {
  uintptr_t bits = 0;
  for (const void* p : pointers) bits |= reinterpret_cast<uintptr_t>(p);
  return bits % 16 == 0;
}

// Calls launch(width), width a std::integral_constant: 4 where vec4 (groups of Pack<4>: the
// caller has checked the alignment), else 1.
template <class F>
void with_width(bool vec4, F&& launch) {
  if (vec4)
    launch(std::integral_constant<int, 4>());
  else
    launch(std::integral_constant<int, 1>());
}

// dst[i] = src[i] as Out for i < n (n > 0) on `stream`: widened, then rounded where Out is BF16
// (float: F32, uint16_t: BF16, either way round). copy's conversions and the staged operands'
// flat copies (bf16.cu).
template <class In, class Out>
void convert_async(const In* src, Out* dst, int64_t n, cudaStream_t stream);
// dst <- src, one NCHW and the other channels_last, both on this device (copy_relayouts,
// engine/ops.h): the tiled transposes that stage a convolution's operands (bf16.cu), converting
// F32 <-> BF16 where the dtypes differ.
void copy_relayout(Tensor& dst, const Tensor& src, cudaStream_t stream);
// An NCHW copy of the channels_last tensor t, from ctx's allocator, on its stream.
Tensor nchw_copy(DeviceContext& ctx, const Tensor& t);

// p[0, n) = v on `stream` (a kernel launch; n > 0): float, int32_t or uint16_t (BF16's bits).
template <class T>
void fill_async(T* p, int64_t n, T v, cudaStream_t stream);

// Shape checks shared by the op files: they throw replica::Error naming the op.
void expect_device(const DeviceContext& ctx, const Tensor& t, const char* op, const char* what);
// The dtype an op's activations share (its first tensor's; undefined ones aside): F32, or BF16
// in bf16 storage (engine/bf16_storage.h), where the layers store an op's activations and their
// gradients alike, so its kernels run on one storage type. Else a clear error.
DType activations_dtype(const char* op, std::initializer_list<const Tensor*> tensors);
void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what);
void expect_shape(const Tensor& t, const Shape& shape, const char* op, const char* what);
void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what);

}  // namespace cuda

// The algorithm, workspace and math type chosen for one direction of one convolution (the
// directions share the descriptor, so each sets its math type before it runs).
template <class Algo>
struct ConvChoice {
  Algo algo{};
  size_t ws = 0;
  cudnnMathType_t math = CUDNN_FMA_MATH;
};

// One direction's graph-API plan (conv_graph.h) for one beta, built on first use; null when
// it runs through the legacy calls.
struct ConvGraphSlot {
  bool tried = false;
  std::unique_ptr<ConvGraph> graph;
};

// Descriptors and chosen algorithms for one convolution configuration.
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  // The shape, data type and layout (direction and beta set per use); spec.nhwc: the
  // descriptors, and so the staged operands, are NHWC (conv.cu).
  ConvGraphSpec spec;
  bool have_fwd = false, have_bwd_data = false, have_bwd_filter = false;
  ConvChoice<cudnnConvolutionFwdAlgo_t> fwd;
  ConvChoice<cudnnConvolutionBwdDataAlgo_t> bwd_data;
  ConvChoice<cudnnConvolutionBwdFilterAlgo_t> bwd_filter;
  // By ConvDirection, then beta (0: the result overwrites; 1: it is added, as a residual
  // block's input gradient is): a plan is built for one beta, and one shape can see both.
  ConvGraphSlot graphs[3][2];
};

// What a product (a convolution, a linear layer) reads and writes in one direction: the tensors
// themselves, or staged copies in the backend's scratch: its operands rounded to bf16
// (Precision::Bf16) and/or laid out NHWC (a convolution with ctx.channels_last()), its results
// in the same form, brought back into their tensors by finish() (bf16.cu). A tensor already
// stored and laid out as the product takes it (a BF16 activation; a channels_last one of an
// NHWC convolution, engine/tensor.h) is read or written where it is.
struct ProductIo {
  bool bf16 = false;  // staged as bf16 (else fp32)
  bool nhwc = false;  // staged as NHWC, weights KRSC (else as the tensors are)
  bool staged() const { return bf16 || nhwc; }
  const void* x = nullptr;
  const void* w = nullptr;
  const void* dy = nullptr;
  void* y = nullptr;   // forward
  void* dx = nullptr;  // backward: overwritten, or added onto dx (InputGrad::Accumulate)
  void* dw = nullptr;  // backward: added onto dw
  // The beta of the library call writing `result` for `out` when it `adds` onto it: 1 where the
  // result is written in `out` itself; staged, the call writes its own part (0) and finish()
  // adds it.
  float beta(bool adds, const void* result, const Tensor& out) const {
    return adds && result == out.raw() ? 1.f : 0.f;
  }
  Tensor held;  // the scratch the staged copies live in (undefined when nothing is staged)
  // Brings a staged result into `out` (accumulate: out += it), converting its dtype and layout;
  // a no-op for a result written in `out` itself.
  void finish(const void* result, Tensor& out, bool accumulate, cudaStream_t stream) const;
};

// (N, C, H, W, K, R, stride, padding, bf16 data, NHWC layout)
using ConvKey =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool, bool>;

class CudaBackend final : public Backend {
 public:
  CudaBackend() = default;
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

#define REPLICA_OP(name, params, args) void name params override;
#include "engine/backend_ops.inc"
#undef REPLICA_OP
  // The ops of a bf16 step whose kernels read and write BF16 activations themselves
  // (engine/bf16_storage.h): copying BF16 to F32 and back around each would cost more than the
  // op. The others (the loss, add, scale, dropout, mul, gather_rows) get F32 copies.
  bool takes_bf16(OpId op) const override;
  // channels_last tensors (engine/tensor.h): copy and the convolutions take any layout,
  // BatchNorm and the flat elementwise ops one shared by all their 4-D tensors; the rest (pooling,
  // dropout) are given NCHW copies.
  Layouts layouts(OpId op) const override;

 private:
  // Per-shape convolution plans (conv.cu). Descriptors are destroyed with the backend.
  ConvPlan& conv_plan(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Conv2dParams& p);
  // Runs one direction of a convolution on its (staged) buffers, the result scaled by `beta`
  // before the sum is added (0: overwritten): through its graph-API plan when conv_graph()
  // gives one, else through cuDNN's legacy call (conv.cu).
  void run_conv(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir, const ConvBuffers& b,
                float beta);
  // The graph-API plan for `dir` when this context runs it that way (ConvApi) and `buffers`
  // suit it, built on first use; else null (conv_api.cu).
  const ConvGraph* conv_graph(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir, float beta,
                              const ConvBuffers& buffers);
  // The plan for `spec` (timed on `buffers` with --cudnn-benchmark), or null with `why`.
  std::unique_ptr<ConvGraph> build_conv_graph(DeviceContext& ctx, const ConvGraphSpec& spec,
                                              const ConvBuffers& buffers, std::string* why);
  // Drops a direction's graph-API plan that failed to run: the legacy calls run it from now on.
  void leave_conv_graph(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir, float beta,
                        const std::string& why);
  void destroy_conv_plans() noexcept;
  // A convolution of a first layer's few input channels (1 to 7; K a multiple of 8) in a
  // channels_last context, run on operands padded with zero channels to 8 (conv_padded.cu):
  // false, having done nothing, for any other convolution.
  bool padded_conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                             const Tensor& b, Tensor& y, const Conv2dParams& p);
  bool padded_conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                              const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                              const Conv2dParams& p, InputGrad dx_mode);
  // A convolution on planes smaller than its kernel, as one GEMM over the batch with its plane
  // matrix (engine/conv_geometry.h), unless REPLICA_CUDA_PLANE_MATRIX=0, where every operand is
  // NCHW (conv_plane_matrix.cu): false, having done nothing, for any other.
  bool plane_matrix_conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                   const Tensor& b, Tensor& y, const Conv2dParams& p);
  bool plane_matrix_conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                    const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                                    const Conv2dParams& p, InputGrad dx_mode);
  std::map<ConvKey, ConvPlan> conv_plans_;

  // A product's operands and results (bf16.cu); backward: dx, dw null when not wanted. `nhwc`:
  // a convolution's, staged NHWC.
  ProductIo forward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w, Tensor& y,
                       bool nhwc = false);
  // `dx_adds`: the call adds its dx onto what dx holds (InputGrad::Accumulate).
  ProductIo backward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                        Tensor* dx, Tensor* dw, bool nhwc = false, bool dx_adds = false);

  // Device memory for one op's kernels: scratch (F32 elements, 512-byte aligned) and cuDNN's
  // workspace (bytes; undefined for none), taken from the device's allocator for that op alone,
  // as PyTorch takes cuDNN's workspace, so the peak holds only the running op's (a buffer kept
  // at the largest op's size sat in the peak of every step: ResNet-50's fp32 peak was above
  // PyTorch's by about that much). The caller holds the tensor until its kernels are enqueued.
  // Dropped then, its block can serve the next request at once: that work is queued on the same
  // stream, after these kernels, and work on another stream waits for an event recorded after
  // its own allocation (engine_steps.cpp's prefetch, nccl_group.cpp). While a step is being
  // captured the allocator serves the graph's private pool, so the graph keeps its addresses.
  static Tensor scratch(DeviceContext& ctx, int64_t floats);
  static Tensor workspace(DeviceContext& ctx, size_t bytes);
};

}  // namespace replica
