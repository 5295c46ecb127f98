// CUDA backend: adaptive average pooling (PyTorch's windows), own kernels over NCHW; a
// channels_last input comes as an NCHW copy (Backend::Layouts::None: the global pool at a
// ResNet's end reads 7x7 planes, a few MB). The backward is a gather, one thread per input
// element summing the outputs whose window covers it in ascending output order: no atomics,
// deterministic, the CPU backend's order. BF16 activations are read widened, summed in fp32
// and stored rounded, as the CPU's pooling on their F32 widening.
#include "engine/cuda/pool_index.h"

namespace replica {

namespace {

// PyTorch's adaptive windows along one axis of `in` inputs and by_out.divisor() outputs:
// [floor(o*In/Out), ceil((o+1)*In/Out)).
template <class Div>
__device__ __forceinline__ int64_t adaptive_start(int64_t o, int64_t in, const Div& by_out) {
  return int64_t(by_out.div(typename Div::Index(o * in)));
}
template <class Div>
__device__ __forceinline__ int64_t adaptive_end(int64_t o, int64_t in, const Div& by_out) {
  const int64_t out = int64_t(by_out.divisor());
  return int64_t(by_out.div(typename Div::Index((o + 1) * in + out - 1)));
}

template <class Div, class T>
__global__ void adaptive_avgpool_forward_kernel(const T* x, T* y, cuda::PoolDims d,
                                                cuda::PoolIndex<Div> at) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.P * d.Q;
  REPLICA_GRID_STRIDE(o, total) {
    Index plane, oy, ox;
    at.split3(Index(o), at.by_p, at.by_q, &plane, &oy, &ox);
    const T* xp = x + int64_t(plane) * d.H * d.W;
    const int64_t y0 = adaptive_start(oy, d.H, at.by_p), y1 = adaptive_end(oy, d.H, at.by_p);
    const int64_t x0 = adaptive_start(ox, d.W, at.by_q), x1 = adaptive_end(ox, d.W, at.by_q);
    float s = 0.f;
    for (int64_t iy = y0; iy < y1; ++iy)
      for (int64_t ix = x0; ix < x1; ++ix) s += widen(xp[iy * d.W + ix]);
    y[o] = narrow<T>(s / float((y1 - y0) * (x1 - x0)));
  }
}

// Outputs o along one axis whose adaptive window covers input i: o in [lo, hi]. Derived bounds
// are widened by one each side and then tested exactly, so rounding can never drop a window.
template <class Div>
__device__ __forceinline__ void adaptive_covering(int64_t i, const Div& by_in, const Div& by_out,
                                                  int64_t* lo, int64_t* hi) {
  using Index = typename Div::Index;
  const int64_t in = int64_t(by_in.divisor()), out = int64_t(by_out.divisor());
  int64_t l = int64_t(by_in.div(Index(i * out))) - 1;
  int64_t h = int64_t(by_in.div(Index((i + 1) * out + in - 1)));
  if (l < 0) l = 0;
  if (h > out - 1) h = out - 1;
  const auto covers = [&](int64_t o) {
    return adaptive_start(o, in, by_out) <= i && i < adaptive_end(o, in, by_out);
  };
  while (l <= h && !covers(l)) ++l;
  while (h >= l && !covers(h)) --h;
  *lo = l;
  *hi = h;
}

template <class Div, class T>
__global__ void adaptive_avgpool_backward_kernel(const T* dy, T* dx, cuda::PoolDims d,
                                                 cuda::PoolIndex<Div> at) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.H * d.W;
  REPLICA_GRID_STRIDE(i, total) {
    Index plane, iy, ix;
    at.split3(Index(i), at.by_h, at.by_w, &plane, &iy, &ix);
    const T* gp = dy + int64_t(plane) * d.P * d.Q;
    int64_t oy0, oy1, ox0, ox1;
    adaptive_covering(iy, at.by_h, at.by_p, &oy0, &oy1);
    adaptive_covering(ix, at.by_w, at.by_q, &ox0, &ox1);
    float g = 0.f;
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      const int64_t y0 = adaptive_start(oy, d.H, at.by_p), y1 = adaptive_end(oy, d.H, at.by_p);
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        const int64_t x0 = adaptive_start(ox, d.W, at.by_q), x1 = adaptive_end(ox, d.W, at.by_q);
        g += widen(gp[oy * d.Q + ox]) / float((y1 - y0) * (x1 - x0));
      }
    }
    dx[i] = narrow<T>(g);
  }
}

}  // namespace

void CudaBackend::adaptive_avgpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y) {
  const char* op = "adaptive_avgpool2d_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  const cuda::PoolDims d = cuda::pool_dims(x, y, op);
  const int64_t total = d.planes * d.P * d.Q;
  if (total == 0) return;
  REPLICA_CHECK(d.H >= 1 && d.W >= 1, "{}: empty input plane {}", op, shape_str(x.shape()));
  cuda::with_pool_launch(op, {&x, &y}, d, 1, 0, 1, [&](auto tag, auto at) {
    using T = decltype(tag);
    adaptive_avgpool_forward_kernel<<<cuda::grid_for(total), cuda::kThreads, 0,
                                      cuda_state(ctx).stream>>>(elements<T>(x), elements<T>(y),
                                                                d, at);
  });
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::adaptive_avgpool2d_backward(DeviceContext& ctx, const Tensor& dy, Tensor& dx) {
  const char* op = "adaptive_avgpool2d_backward";
  cuda::expect_device(ctx, dy, op, "dy");
  cuda::expect_device(ctx, dx, op, "dx");
  const cuda::PoolDims d = cuda::pool_dims(dx, dy, op);
  const int64_t total = d.planes * d.H * d.W;
  if (total == 0) return;
  if (d.P == 0 || d.Q == 0) {  // no outputs: no gradient
    REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), cuda_state(ctx).stream));
    return;
  }
  cuda::with_pool_launch(op, {&dy, &dx}, d, 1, 0, 1, [&](auto tag, auto at) {
    using T = decltype(tag);
    adaptive_avgpool_backward_kernel<<<cuda::grid_for(total), cuda::kThreads, 0,
                                       cuda_state(ctx).stream>>>(elements<T>(dy),
                                                                 elements<T>(dx), d, at);
  });
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
