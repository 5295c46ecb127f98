// CUDA backend: the elementwise ops (fill, copy, gather_rows, add, scale, ReLU, dropout,
// elementwise product). Own kernels, grid-stride, nothing reduced; the arithmetic ones move a
// float4 per thread where their arrays allow (map_kernel).
#include <cmath>

#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

// One thread per word: a 4-byte element (F32 and I32 alike), or four of them as a float4.
template <class Word>
__global__ void gather_rows_kernel(Word* dst, const Word* table, const int32_t* rows,
                                   int64_t row_words, int64_t n) {
  REPLICA_GRID_STRIDE(i, n) {
    const int64_t r = i / row_words, k = i - r * row_words;
    dst[i] = table[int64_t(rows[r]) * row_words + k];
  }
}

// out = f(a, b) elementwise (b unread where F::kBinary is false): a group of kVec floats per
// thread, float4s where every pointer is 16-byte aligned, and the last n % kVec one by one.
// Four bytes per thread left these passes at about half the memory's bandwidth on an H200
// (ResNet-50's residual add and relu_backward, with the sum's ReLU then a pass of its own:
// 5.3 ms of a 37 ms step).
// T: how the three arrays store their elements (F32 or BF16: widen and narrow, engine/ops.h).
template <class F, int kVec, class T>
__global__ void map_kernel(const T* a, const T* b, T* out, int64_t n, F f) {
  constexpr bool kBinary = F::kBinary;
  const int64_t groups = n / kVec;
  REPLICA_GRID_STRIDE(g, groups) {
    cuda::Pack<kVec> va, vb;
    va.load(a, g);
    if constexpr (kBinary) vb.load(b, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) va.v[k] = f(va.v[k], kBinary ? vb.v[k] : 0.f);
    va.store(out, g);
  }
  const int64_t tail = groups * kVec + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (kVec > 1 && tail < n)
    out[tail] = narrow<T>(f(widen(a[tail]), kBinary ? widen(b[tail]) : 0.f));
}

// The maps: kBinary says whether they read a second array.
struct AddScaled {  // dst + alpha * src (one rounding: contracted to an FMA, as before)
  static constexpr bool kBinary = true;
  float alpha;
  __device__ float operator()(float dst, float src) const { return dst + alpha * src; }
};
struct Scaled {
  static constexpr bool kBinary = false;
  float alpha;
  __device__ float operator()(float v, float) const { return v * alpha; }
};
struct Relu {
  static constexpr bool kBinary = false;
  __device__ float operator()(float v, float) const { return relu_value(v); }
};
struct ReluGrad {  // a: the ReLU's output, b: the gradient reaching it
  static constexpr bool kBinary = true;
  __device__ float operator()(float y, float dy) const { return relu_passes(y) ? dy : 0.f; }
};
struct Times {
  static constexpr bool kBinary = true;
  __device__ float operator()(float x, float y) const { return x * y; }
};

// out = f(a, b) over n > 0 elements on `stream` (b: null for a unary f).
template <class F, class T>
void launch_map(const T* a, const T* b, T* out, int64_t n, F f, cudaStream_t stream) {
  cuda::with_width(cuda::aligned16({a, b, out}), [&](auto width) {
    constexpr int kVec = decltype(width)::value;
    map_kernel<F, kVec, T><<<cuda::grid_for(n / kVec > 0 ? n / kVec : 1), cuda::kThreads, 0,
                             stream>>>(a, b, out, n, f);
  });
  REPLICA_LAUNCH_CHECK();
}

__global__ void dropout_kernel(const float* x, float* y, float* mask, int64_t n, float p,
                               float keep_scale, uint64_t seed) {
  REPLICA_GRID_STRIDE(i, n) {
    const float m = dropout_uniform(seed, static_cast<uint64_t>(i)) >= p ? keep_scale : 0.f;
    mask[i] = m;
    y[i] = x[i] * m;
  }
}

}  // namespace

void CudaBackend::fill(DeviceContext& ctx, Tensor& t, float value) {
  cuda::expect_device(ctx, t, "fill", "target");
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t stream = cuda_state(ctx).stream;
  if (t.dtype() == DType::I32) {
    const int32_t v = static_cast<int32_t>(value);
    if (v == 0) {
      REPLICA_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.bytes(), stream));
      return;
    }
    cuda::fill_async(t.i32(), n, v, stream);
    return;
  }
  if (value == 0.f && !std::signbit(value)) {  // +0.0f is all-zero bits, in F32 and BF16
    REPLICA_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.bytes(), stream));
    return;
  }
  if (t.dtype() == DType::BF16) {
    cuda::fill_async(t.bf16(), n, bf16_bits(value), stream);
    return;
  }
  cuda::fill_async(t.f32(), n, value, stream);
}

void CudaBackend::copy(DeviceContext& ctx, Tensor& dst, const Tensor& src) {
  REPLICA_CHECK(dst.defined() && src.defined(), "copy: undefined tensor");
  REPLICA_CHECK(dst.numel() == src.numel(), "copy: destination {} and source {} differ in size",
                shape_str(dst.shape()), shape_str(src.shape()));
  REPLICA_CHECK(dst.on_cuda() || src.on_cuda(),
                "copy: neither side is GPU memory (use the CPU backend for host copies)");
  if (copy_relayouts(dst, src)) {  // NCHW <-> channels_last on this device
    cuda::expect_device(ctx, dst, "copy", "destination of a layout conversion");
    cuda::expect_device(ctx, src, "copy", "source of a layout conversion");
    cuda::copy_relayout(dst, src, cuda_state(ctx).stream);
    return;
  }
  if (dst.dtype() != src.dtype()) {  // F32 <-> BF16 on this device: a conversion
    const bool narrows = copy_narrows(dst, src);
    cuda::expect_device(ctx, dst, "copy", "destination of a conversion");
    cuda::expect_device(ctx, src, "copy", "source of a conversion");
    const int64_t n = dst.numel();
    if (n == 0) return;
    const cudaStream_t stream = cuda_state(ctx).stream;
    if (narrows)
      cuda::convert_async(src.f32(), dst.bf16(), n, stream);
    else
      cuda::convert_async(src.bf16(), dst.f32(), n, stream);
    return;
  }
  if (dst.numel() == 0 || dst.raw() == src.raw()) return;
  // Unified addressing: the runtime works out host (pinned or pageable), this device or a peer.
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), dst.bytes(), cudaMemcpyDefault,
                                     cuda_state(ctx).stream));
}

void CudaBackend::gather_rows(DeviceContext& ctx, Tensor& dst, const Tensor& table,
                              const Tensor& rows) {
  cuda::expect_device(ctx, dst, "gather_rows", "destination");
  cuda::expect_device(ctx, table, "gather_rows", "table");
  cuda::expect_device(ctx, rows, "gather_rows", "rows");
  const int64_t row = gather_row_numel(dst, table, rows);
  const int64_t n = dst.numel();
  if (n == 0) return;
  cudaStream_t stream = cuda_state(ctx).stream;
  // Rows of whole float4s (every image size used here) move 16 bytes per thread when both
  // sides start 16-byte aligned (whole allocations always do: cudaMalloc aligns to 256).
  if (row % 4 == 0 && cuda::aligned16({dst.raw(), table.raw()})) {
    gather_rows_kernel<<<cuda::grid_for(n / 4), cuda::kThreads, 0, stream>>>(
        static_cast<float4*>(dst.raw()), static_cast<const float4*>(table.raw()), rows.i32(),
        row / 4, n / 4);
  } else {
    gather_rows_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
        static_cast<uint32_t*>(dst.raw()), static_cast<const uint32_t*>(table.raw()), rows.i32(),
        row, n);
  }
  REPLICA_LAUNCH_CHECK();
}

namespace {

// Two operands of an elementwise op on ctx's device with as many elements: returns how many.
int64_t elementwise_numel(const DeviceContext& ctx, const Tensor& a, const Tensor& b,
                          const char* op, const char* a_name, const char* b_name) {
  cuda::expect_device(ctx, a, op, a_name);
  cuda::expect_device(ctx, b, op, b_name);
  cuda::expect_numel(b, a.numel(), op, b_name);
  return a.numel();
}

}  // namespace

void CudaBackend::add(DeviceContext& ctx, Tensor& dst, const Tensor& src, float alpha) {
  const int64_t n = elementwise_numel(ctx, dst, src, "add", "destination", "source");
  if (n == 0) return;
  launch_map(dst.f32(), src.f32(), dst.f32(), n, AddScaled{alpha}, cuda_state(ctx).stream);
}

void CudaBackend::scale(DeviceContext& ctx, Tensor& t, float alpha) {
  cuda::expect_device(ctx, t, "scale", "tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  launch_map<Scaled, float>(t.f32(), nullptr, t.f32(), n, Scaled{alpha}, cuda_state(ctx).stream);
}

void CudaBackend::relu_forward(DeviceContext& ctx, const Tensor& x, Tensor& y) {
  const int64_t n = elementwise_numel(ctx, x, y, "relu_forward", "x", "y");
  if (n == 0) return;
  with_storage(cuda::activations_dtype("relu_forward", {&x, &y}), [&](auto tag) {
    using T = decltype(tag);
    launch_map<Relu, T>(elements<T>(x), nullptr, elements<T>(y), n, Relu(),
                        cuda_state(ctx).stream);
  });
}

void CudaBackend::relu_backward(DeviceContext& ctx, const Tensor& y, const Tensor& dy,
                                Tensor& dx) {
  cuda::expect_device(ctx, y, "relu_backward", "y");
  cuda::expect_device(ctx, dy, "relu_backward", "dy");
  cuda::expect_device(ctx, dx, "relu_backward", "dx");
  cuda::expect_numel(dy, y.numel(), "relu_backward", "dy");
  cuda::expect_numel(dx, y.numel(), "relu_backward", "dx");
  const int64_t n = y.numel();
  if (n == 0) return;
  with_storage(cuda::activations_dtype("relu_backward", {&y, &dy, &dx}), [&](auto tag) {
    using T = decltype(tag);
    launch_map<ReluGrad, T>(elements<T>(y), elements<T>(dy), elements<T>(dx), n,
                            ReluGrad(), cuda_state(ctx).stream);
  });
}

void CudaBackend::dropout_forward(DeviceContext& ctx, const Tensor& x, Tensor& y, Tensor& mask,
                                  float p, uint64_t seed) {
  const char* op = "dropout_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_device(ctx, mask, op, "mask");
  cuda::expect_numel(y, x.numel(), op, "y");
  cuda::expect_numel(mask, x.numel(), op, "mask");
  REPLICA_CHECK(p >= 0.f && p <= 1.f, "{}: p = {} is not in [0, 1]", op, p);
  const int64_t n = x.numel();
  if (n == 0) return;
  const float keep_scale = p < 1.f ? 1.f / (1.f - p) : 0.f;  // as the CPU backend
  dropout_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
      x.f32(), y.f32(), mask.f32(), n, p, keep_scale, seed);
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::mul(DeviceContext& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  cuda::expect_device(ctx, a, "mul", "a");
  cuda::expect_device(ctx, b, "mul", "b");
  cuda::expect_device(ctx, out, "mul", "out");
  cuda::expect_numel(b, a.numel(), "mul", "b");
  cuda::expect_numel(out, a.numel(), "mul", "out");
  const int64_t n = a.numel();
  if (n == 0) return;
  launch_map(a.f32(), b.f32(), out.f32(), n, Times(), cuda_state(ctx).stream);
}

}  // namespace replica
