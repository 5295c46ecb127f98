// CUDA backend: construction, shared checks, scratch memory and the memory ops (fill, copy, add,
// scale).
#include <cmath>

#include "engine/cuda/cuda_backend.h"

namespace replica {

std::unique_ptr<Backend> cuda::make_backend() { return std::make_unique<CudaBackend>(); }

CudaBackend::~CudaBackend() { destroy_conv_plans(); }

namespace {

__global__ void fill_f32_kernel(float* p, int64_t n, float v) {
  REPLICA_GRID_STRIDE(i, n)
    p[i] = v;
}

}  // namespace

namespace cuda {

void fill_async(float* p, int64_t n, float v, cudaStream_t stream) {
  fill_f32_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, n, v);
  REPLICA_LAUNCH_CHECK();
}

void expect_device(const DeviceContext& ctx, const Tensor& t, const char* op, const char* what) {
  REPLICA_CHECK(t.defined(), "{}: {} is undefined", op, what);
  REPLICA_CHECK(t.on_cuda() && t.device().index == ctx.device().index,
                "{}: {} must be in the memory of {} (it is on {}{})", op, what,
                ctx.device().str(), t.device().str(), t.on_host() ? ", host memory" : "");
}

void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what) {
  REPLICA_CHECK(t.numel() == numel, "{}: {} has shape {} ({} elements), expected {} elements", op,
                what, shape_str(t.shape()), t.numel(), numel);
}

void expect_shape(const Tensor& t, const Shape& shape, const char* op, const char* what) {
  REPLICA_CHECK(t.shape() == shape, "{}: {} has shape {}, expected {}", op, what,
                shape_str(t.shape()), shape_str(shape));
}

void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what) {
  REPLICA_CHECK(t.dtype() == dtype, "{}: {} is {}, expected {}", op, what, dtype_name(t.dtype()),
                dtype_name(dtype));
}

}  // namespace cuda

float* CudaBackend::scratch(DeviceContext& ctx, int64_t floats) {
  if (floats < 1) floats = 1;
  if (!scratch_.defined() || scratch_.numel() < floats) {
    CudaState& s = cuda_state(ctx);
    // The old block goes back to the allocator's cache: wait until no kernel can still use it.
    if (scratch_.defined()) REPLICA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    int64_t n = floats < 1024 ? 1024 : floats;
    scratch_ = Tensor();
    scratch_ = ctx.alloc({n});
  }
  return scratch_.f32();
}

namespace {

__global__ void fill_i32_kernel(int32_t* p, int64_t n, int32_t v) {
  REPLICA_GRID_STRIDE(i, n)
    p[i] = v;
}

__global__ void axpy_kernel(float* dst, const float* src, int64_t n, float alpha) {
  REPLICA_GRID_STRIDE(i, n)
    dst[i] += alpha * src[i];
}

__global__ void scale_kernel(float* p, int64_t n, float alpha) {
  REPLICA_GRID_STRIDE(i, n)
    p[i] *= alpha;
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
    fill_i32_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(t.i32(), n, v);
    REPLICA_LAUNCH_CHECK();
    return;
  }
  if (value == 0.f && !std::signbit(value)) {  // +0.0f is all-zero bits
    REPLICA_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.bytes(), stream));
    return;
  }
  cuda::fill_async(t.f32(), n, value, stream);
}

void CudaBackend::copy(DeviceContext& ctx, Tensor& dst, const Tensor& src) {
  REPLICA_CHECK(dst.defined() && src.defined(), "copy: undefined tensor");
  REPLICA_CHECK(dst.numel() == src.numel(), "copy: destination {} and source {} differ in size",
                shape_str(dst.shape()), shape_str(src.shape()));
  REPLICA_CHECK(dst.dtype() == src.dtype(), "copy: destination is {}, source is {}",
                dtype_name(dst.dtype()), dtype_name(src.dtype()));
  REPLICA_CHECK(dst.on_cuda() || src.on_cuda(),
                "copy: neither side is GPU memory (use the CPU backend for host copies)");
  if (dst.numel() == 0 || dst.raw() == src.raw()) return;
  // Unified addressing: the runtime works out host (pinned or pageable), this device or a peer.
  REPLICA_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), dst.bytes(), cudaMemcpyDefault,
                                     cuda_state(ctx).stream));
}

void CudaBackend::add(DeviceContext& ctx, Tensor& dst, const Tensor& src, float alpha) {
  cuda::expect_device(ctx, dst, "add", "destination");
  cuda::expect_device(ctx, src, "add", "source");
  cuda::expect_numel(src, dst.numel(), "add", "source");
  const int64_t n = dst.numel();
  if (n == 0) return;
  axpy_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
      dst.f32(), src.f32(), n, alpha);
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::scale(DeviceContext& ctx, Tensor& t, float alpha) {
  cuda::expect_device(ctx, t, "scale", "tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  scale_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, cuda_state(ctx).stream>>>(t.f32(), n,
                                                                                  alpha);
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
