// Precision::Bf16 on CUDA devices: fp32 tensors rounded into bf16 copies for cuDNN's and
// cuBLAS's bf16 tensor-core paths (fp32 accumulation), and their bf16 results widened back into
// the fp32 tensors the rest of the engine keeps. Rounding goes through bf16_bits (engine/ops.h),
// the function the CPU's bf16 uses, so both round an operand to the same bf16 number. The copies
// live in the backend's scratch, taken once per call (a second scratch() call may move it).
#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

__global__ void round_to_bf16_kernel(const float* src, uint16_t* dst, int64_t n) {
  REPLICA_GRID_STRIDE(i, n)
    dst[i] = bf16_bits(src[i]);
}

__global__ void widen_bf16_kernel(const uint16_t* src, float* dst, int64_t n, bool accumulate) {
  REPLICA_GRID_STRIDE(i, n) {
    const float v = bf16_value(src[i]);
    dst[i] = accumulate ? dst[i] + v : v;
  }
}

// Floats of scratch that hold n bf16 values, 256-byte aligned.
int64_t bf16_floats(int64_t n) { return ((n + 1) / 2 + 63) / 64 * 64; }

// Hands out consecutive bf16 arrays of one scratch block.
class Carve {
 public:
  explicit Carve(float* base) : next_(base) {}
  void* take(int64_t n) {
    void* out = next_;
    next_ += bf16_floats(n);
    return out;
  }
  const void* rounded(const Tensor& t, cudaStream_t stream) {
    auto* out = static_cast<uint16_t*>(take(t.numel()));
    if (t.numel() > 0) {
      round_to_bf16_kernel<<<cuda::grid_for(t.numel()), cuda::kThreads, 0, stream>>>(
          t.f32(), out, t.numel());
      REPLICA_LAUNCH_CHECK();
    }
    return out;
  }

 private:
  float* next_;
};

}  // namespace

void ProductIo::finish(const void* result, Tensor& out, bool accumulate,
                       cudaStream_t stream) const {
  if (!bf16 || out.numel() == 0) return;
  widen_bf16_kernel<<<cuda::grid_for(out.numel()), cuda::kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(result), out.f32(), out.numel(), accumulate);
  REPLICA_LAUNCH_CHECK();
}

ProductIo CudaBackend::forward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  Tensor& y) {
  ProductIo io{ctx.precision() == Precision::Bf16, x.f32(), w.f32(), nullptr, y.f32()};
  if (!io.bf16) return io;
  const cudaStream_t stream = cuda_state(ctx).stream;
  Carve carve(scratch(ctx, bf16_floats(x.numel()) + bf16_floats(w.numel()) +
                               bf16_floats(y.numel())));
  io.x = carve.rounded(x, stream);
  io.w = carve.rounded(w, stream);
  io.y = carve.take(y.numel());
  return io;
}

ProductIo CudaBackend::backward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                   const Tensor& dy, Tensor* dx, Tensor* dw) {
  ProductIo io{ctx.precision() == Precision::Bf16, x.f32(), w.f32(), dy.f32()};
  io.dx = dx ? dx->f32() : nullptr;
  io.dw = dw ? dw->f32() : nullptr;
  if (!io.bf16 || (!dx && !dw)) return io;
  const cudaStream_t stream = cuda_state(ctx).stream;
  // dx = f(w, dy), dw = g(x, dy): each wants its operand and its result.
  const int64_t both = bf16_floats(x.numel()) + bf16_floats(w.numel());
  Carve carve(scratch(ctx, bf16_floats(dy.numel()) + (dx ? both : 0) + (dw ? both : 0)));
  io.dy = carve.rounded(dy, stream);
  if (dx) {
    io.w = carve.rounded(w, stream);
    io.dx = carve.take(x.numel());
  }
  if (dw) {
    io.x = carve.rounded(x, stream);
    io.dw = carve.take(w.numel());
  }
  return io;
}

}  // namespace replica
