// CUDA backend: max pooling and adaptive average pooling, own kernels. The backwards are gathers
// (one thread per input element sums the outputs whose window covers it, in ascending output
// order): no atomics, deterministic, and the same summation order as the CPU backend's loops.
// Max pooling's backward first finds every window's winner once (into scratch), then gathers:
// searching the windows from each input element instead repeated every window's search for
// each element it covers (9 times for 3x3 stride 2), 3.7 ms of ResNet-50's step on an H100.
//
// Activations may be BF16 (bf16 storage, engine/bf16_storage.h): read widened, summed in fp32,
// stored rounded, as the CPU's pooling on their F32 widening; a max is copied as it is.
//
// Every division here is by an extent or the stride, through the dividers of
// engine/cuda/index_math.h: with 64-bit `/` and `%` (eight per input element in max pooling's
// backward) that backward took 1.06 ms of ResNet-50's step on an H200, about 10x its memory
// traffic, and the global average pool's backward 0.24 ms for 25 MB.
#include <algorithm>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/index_math.h"

namespace replica {

namespace {

using cuda::FastDivmod;
using cuda::WideDivmod;

struct PoolDims {
  int64_t planes, H, W, P, Q;  // planes = N*C; input H x W; output P x Q
};

// The dividers a pooling kernel needs: by the input's and the output's extents, and by the
// stride (max pooling; 1 for adaptive pooling).
template <class Div>
struct PoolIndex {
  using Index = typename Div::Index;
  Div by_h, by_w, by_p, by_q, by_stride;
  // Flat index i of planes of R x S (by_rows = R, by_cols = S): (plane, row, column).
  __device__ __forceinline__ void split3(Index i, const Div& by_rows, const Div& by_cols,
                                         Index* plane, Index* row, Index* col) const {
    const Index t = cuda::split(by_cols, i, col);
    *plane = cuda::split(by_rows, t, row);
  }
};

// Index within the plane of the first maximum of window (oy, ox) in row-major window order;
// padding is never chosen (counts as -inf); the first NaN wins (as max propagates NaN).
// -1 when the window is all padding. Same rule as the CPU backend.
template <class T>
__device__ __forceinline__ int64_t window_argmax(const T* plane, const PoolDims& d,
                                                 int kernel, int stride, int padding, int64_t oy,
                                                 int64_t ox) {
  int64_t best = -1;
  float best_v = -INFINITY;
  for (int i = 0; i < kernel; ++i) {
    const int64_t iy = oy * stride - padding + i;
    if (iy < 0 || iy >= d.H) continue;
    for (int j = 0; j < kernel; ++j) {
      const int64_t ix = ox * stride - padding + j;
      if (ix < 0 || ix >= d.W) continue;
      const float v = widen(plane[iy * d.W + ix]);
      if (best < 0 || v > best_v || isnan(v)) {
        best = iy * d.W + ix;
        best_v = v;
        if (isnan(v)) return best;
      }
    }
  }
  return best;
}

// Every window o's winner: forward writes its value y[o] (-inf when all padding), backward its
// plane index winner[o] (-1 then); the other pointer is null. T: how x and y store their
// elements (F32 or BF16, widen in engine/ops.h): a BF16 winner stays itself (a NaN quieted, as
// the CPU's round trip through fp32 does).
template <class Div, class T>
__global__ void maxpool_windows_kernel(const T* x, T* y, int* winner, PoolDims d,
                                       PoolIndex<Div> at, int kernel, int stride, int padding) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.P * d.Q;
  REPLICA_GRID_STRIDE(o, total) {
    Index plane, oy, ox;
    at.split3(Index(o), at.by_p, at.by_q, &plane, &oy, &ox);
    const T* xp = x + int64_t(plane) * d.H * d.W;
    const int64_t a = window_argmax(xp, d, kernel, stride, padding, oy, ox);
    if (y) y[o] = narrow<T>(a >= 0 ? widen(xp[a]) : -INFINITY);  // NaN: quieted
    if (winner) winner[o] = int(a);
  }
}

// Output rows oy whose window [oy*stride - padding, oy*stride - padding + kernel) covers iy,
// clamped to [0, P): oy in [lo, hi] (empty when lo > hi).
template <class Div>
__device__ __forceinline__ void covering_windows(int64_t i, int kernel, const Div& by_stride,
                                                 int padding, int64_t out, int64_t* lo,
                                                 int64_t* hi) {
  using Index = typename Div::Index;
  const int64_t a = i + padding - kernel + 1;  // oy*stride >= a
  *lo = a <= 0 ? 0 : int64_t(by_stride.div(Index(a + by_stride.divisor() - 1)));
  const int64_t h = int64_t(by_stride.div(Index(i + padding)));  // oy*stride <= i + padding
  *hi = h < out - 1 ? h : out - 1;
}

template <class Div, class T>
__global__ void maxpool_backward_kernel(const int* winner, const T* dy, T* dx, PoolDims d,
                                        PoolIndex<Div> at, int kernel, int padding) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.H * d.W;
  REPLICA_GRID_STRIDE(i, total) {
    Index plane, iy, ix;
    at.split3(Index(i), at.by_h, at.by_w, &plane, &iy, &ix);
    const int* wp = winner + int64_t(plane) * d.P * d.Q;
    const T* gp = dy + int64_t(plane) * d.P * d.Q;
    const int self = int(iy * d.W + ix);
    int64_t y0, y1, x0, x1;
    covering_windows(iy, kernel, at.by_stride, padding, d.P, &y0, &y1);
    covering_windows(ix, kernel, at.by_stride, padding, d.Q, &x0, &x1);
    float g = 0.f;
    for (int64_t oy = y0; oy <= y1; ++oy)
      for (int64_t ox = x0; ox <= x1; ++ox)
        if (wp[oy * d.Q + ox] == self) g += widen(gp[oy * d.Q + ox]);
    dx[i] = narrow<T>(g);
  }
}

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
__global__ void adaptive_avgpool_forward_kernel(const T* x, T* y, PoolDims d, PoolIndex<Div> at) {
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
__global__ void adaptive_avgpool_backward_kernel(const T* dy, T* dx, PoolDims d,
                                                 PoolIndex<Div> at) {
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

// Calls launch(T(), index) with T the storage type `op`'s activations share (float: F32,
// uint16_t: BF16; cuda::activations_dtype) and the dividers for d: FastDivmod where every
// number divided stays below 2^31 (the flat indices; the adaptive windows' products o * In; a
// coordinate plus the padding and the stride), else WideDivmod. Extents of 0 divide nothing:
// they get divisor 1.
template <class F>
void with_pool_launch(const char* op, std::initializer_list<const Tensor*> activations,
                      const PoolDims& d, int stride, int padding, F&& launch) {
  const auto at_least_1 = [](int64_t v) { return v < 1 ? int64_t(1) : v; };
  const int64_t largest = std::max({d.planes * d.H * d.W, d.planes * d.P * d.Q,
                                    (d.P + 1) * d.H + d.P, (d.Q + 1) * d.W + d.Q,
                                    (d.H + 1) * d.P + d.H, (d.W + 1) * d.Q + d.W,
                                    std::max(d.H, d.W) + int64_t(padding) + stride});
  const auto make = [&](auto div) {
    using Div = decltype(div);
    return PoolIndex<Div>{Div(at_least_1(d.H)), Div(at_least_1(d.W)), Div(at_least_1(d.P)),
                          Div(at_least_1(d.Q)), Div(stride)};
  };
  with_storage(cuda::activations_dtype(op, activations), [&](auto tag) {
    if (cuda::fast_index(largest))
      launch(tag, make(FastDivmod()));
    else
      launch(tag, make(WideDivmod()));
  });
}

PoolDims pool_dims(const Tensor& x, const Tensor& y, const char* op) {
  REPLICA_CHECK(x.ndim() == 4 && y.ndim() == 4 && x.dim(0) == y.dim(0) && x.dim(1) == y.dim(1),
                "{}: expected NCHW input and output with the same N and C, got {} and {}", op,
                shape_str(x.shape()), shape_str(y.shape()));
  return {x.dim(0) * x.dim(1), x.dim(2), x.dim(3), y.dim(2), y.dim(3)};
}

void check_maxpool(const Tensor& x, const Tensor& y, const Pool2dParams& p, const char* op) {
  REPLICA_CHECK(p.kernel >= 1 && p.stride >= 1 && p.padding >= 0 && 2 * p.padding <= p.kernel,
                "{}: kernel {}, stride {}, padding {} is invalid (padding may be at most half "
                "the kernel)",
                op, p.kernel, p.stride, p.padding);
  const int64_t P = window_out(x.dim(2), p.kernel, p.stride, p.padding);
  const int64_t Q = window_out(x.dim(3), p.kernel, p.stride, p.padding);
  REPLICA_CHECK(y.dim(2) == P && y.dim(3) == Q, "{}: output {} should be [{}, {}, {}, {}]", op,
                shape_str(y.shape()), x.dim(0), x.dim(1), P, Q);
}

}  // namespace

void CudaBackend::maxpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y,
                                    const Pool2dParams& p) {
  const char* op = "maxpool2d_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  const PoolDims d = pool_dims(x, y, op);
  check_maxpool(x, y, p, op);
  const int64_t total = d.planes * d.P * d.Q;
  if (total == 0) return;
  with_pool_launch(op, {&x, &y}, d, p.stride, p.padding, [&](auto tag, auto at) {
    using T = decltype(tag);
    maxpool_windows_kernel<<<cuda::grid_for(total), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
        elements<T>(x), elements<T>(y), nullptr, d, at, p.kernel, p.stride, p.padding);
  });
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::maxpool2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& y,
                                     const Tensor& dy, Tensor& dx, const Pool2dParams& p) {
  const char* op = "maxpool2d_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, dy, op, "dy");
  cuda::expect_device(ctx, dx, op, "dx");
  const PoolDims d = pool_dims(x, dy, op);
  check_maxpool(x, dy, p, op);
  if (y.defined()) cuda::expect_shape(y, dy.shape(), op, "y");
  cuda::expect_shape(dx, x.shape(), op, "dx");
  const int64_t total = d.planes * d.H * d.W;
  if (total == 0) return;
  REPLICA_CHECK(d.H * d.W <= INT32_MAX, "{}: a plane of {} is too large", op,
                shape_str(x.shape()));
  // y is not needed: the winners are found again in x with the forward's exact rule.
  const int64_t windows = d.planes * d.P * d.Q;
  const cudaStream_t stream = cuda_state(ctx).stream;
  const Tensor winners = scratch(ctx, windows);
  int* winner = reinterpret_cast<int*>(winners.f32());  // an int per float slot
  with_pool_launch(op, {&x, &dy, &dx}, d, p.stride, p.padding, [&](auto tag, auto at) {
    using T = decltype(tag);
    if (windows > 0) {
      maxpool_windows_kernel<<<cuda::grid_for(windows), cuda::kThreads, 0, stream>>>(
          elements<T>(x), static_cast<T*>(nullptr), winner, d, at, p.kernel, p.stride,
          p.padding);
      REPLICA_LAUNCH_CHECK();
    }
    maxpool_backward_kernel<<<cuda::grid_for(total), cuda::kThreads, 0, stream>>>(
        winner, elements<T>(dy), elements<T>(dx), d, at, p.kernel, p.padding);
    REPLICA_LAUNCH_CHECK();
  });
}

void CudaBackend::adaptive_avgpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y) {
  const char* op = "adaptive_avgpool2d_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  const PoolDims d = pool_dims(x, y, op);
  const int64_t total = d.planes * d.P * d.Q;
  if (total == 0) return;
  REPLICA_CHECK(d.H >= 1 && d.W >= 1, "{}: empty input plane {}", op, shape_str(x.shape()));
  with_pool_launch(op, {&x, &y}, d, 1, 0, [&](auto tag, auto at) {
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
  const PoolDims d = pool_dims(dx, dy, op);
  const int64_t total = d.planes * d.H * d.W;
  if (total == 0) return;
  if (d.P == 0 || d.Q == 0) {  // no outputs: no gradient
    REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), cuda_state(ctx).stream));
    return;
  }
  with_pool_launch(op, {&dy, &dx}, d, 1, 0, [&](auto tag, auto at) {
    using T = decltype(tag);
    adaptive_avgpool_backward_kernel<<<cuda::grid_for(total), cuda::kThreads, 0,
                                       cuda_state(ctx).stream>>>(elements<T>(dy),
                                                                 elements<T>(dx), d, at);
  });
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
