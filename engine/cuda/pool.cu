// CUDA backend: max pooling, own kernels, over NCHW and over NHWC (channels_last, engine/tensor.h)
// as the tensors come (Backend::Layouts::Uniform). Over NHWC a thread takes four adjacent
// channels of a position where C allows, so a warp reads whole runs of a pixel's channels; a
// ResNet's stem then pools its channels_last output where it is, not on NCHW copies.
//
// The backward is a gather (one thread per input element sums the outputs whose window it won,
// in ascending output order): no atomics, deterministic, and the same summation order as the
// CPU backend's loops. It first finds every window's winner once (into scratch), then gathers:
// searching the windows from each input element instead repeated every window's search for
// each element it covers (9 times for 3x3 stride 2), 3.7 ms of ResNet-50's step on an H100.
//
// Activations may be BF16 (bf16 storage, engine/bf16_storage.h): read widened, summed in fp32,
// stored rounded, as the CPU's pooling on their F32 widening; a max is copied as it is.
#include <algorithm>
#include <type_traits>

#include "engine/cuda/pool_index.h"

namespace replica {

namespace {

// Where a max-pooling thread's kVec elements lie: their plane's first element in the input
// and in the output (y, the winners, dy), and the step between a plane's neighbouring
// positions. NCHW: a plane n*C + c, its positions 1 apart, one element a thread. NHWC: image n's
// channels c..c+kVec-1 side by side, positions C apart.
struct PlaneOffsets {
  int64_t in, out, step;
};

template <bool kNhwc, int kVec, class Div>
__device__ __forceinline__ PlaneOffsets locate(typename Div::Index i,
                                               const cuda::PoolIndex<Div>& at,
                                               const Div& by_rows, const Div& by_cols,
                                               const cuda::PoolDims& d, int* row, int* col) {
  using Index = typename Div::Index;
  Index group = 0, r, c, plane;
  if constexpr (kNhwc) i = cuda::split(at.by_groups, i, &group);
  at.split3(i, by_rows, by_cols, &plane, &r, &c);
  *row = int(r), *col = int(c);
  if constexpr (kNhwc) {
    const int64_t channel = int64_t(group) * kVec;
    return {int64_t(plane) * d.H * d.W * d.C + channel,
            int64_t(plane) * d.P * d.Q * d.C + channel, d.C};
  } else {
    return {int64_t(plane) * d.H * d.W, int64_t(plane) * d.P * d.Q, 1};
  }
}

// Each of kVec planes' first maximum in window (oy, ox), in row-major window order, as its
// position in the plane (iy * W + ix) and value: padding is never chosen (counts as -inf); the
// first NaN wins (as max propagates NaN). -1 and -inf when the window is all padding. Same rule
// as the CPU backend. `plane` is the planes' first element, `step` apart from one position to
// the next.
template <int kVec, class T>
__device__ __forceinline__ void window_argmax(const T* plane, int64_t step, const cuda::PoolDims& d,
                                              int kernel, int stride, int padding, int oy, int ox,
                                              int (&best)[kVec], cuda::Pack<kVec>& best_v) {
  const int H = int(d.H), W = int(d.W);
  for (int k = 0; k < kVec; ++k) best[k] = -1, best_v.v[k] = -INFINITY;
  for (int i = 0; i < kernel; ++i) {
    const int iy = oy * stride - padding + i;
    if (iy < 0 || iy >= H) continue;
    for (int j = 0; j < kernel; ++j) {
      const int ix = ox * stride - padding + j;
      if (ix < 0 || ix >= W) continue;
      const int pos = iy * W + ix;
      cuda::Pack<kVec> v;
      v.load(plane, int64_t(pos) * step / kVec);
      for (int k = 0; k < kVec; ++k) {
        const bool settled = best[k] >= 0 && isnan(best_v.v[k]);  // a NaN already won
        if (!settled && (best[k] < 0 || v.v[k] > best_v.v[k] || isnan(v.v[k])))
          best[k] = pos, best_v.v[k] = v.v[k];
      }
    }
  }
}

// Every window o's winner: forward writes its value y[o] (-inf when all padding), backward its
// plane position winner[o] (-1 then); the other pointer is null. T: how x and y store their
// elements (F32 or BF16, widen in engine/ops.h): a BF16 winner stays itself (a NaN quieted, as
// the CPU's round trip through fp32 does). A thread per kVec windows (NHWC: adjacent channels).
template <bool kNhwc, int kVec, class Div, class T>
__global__ void maxpool_windows_kernel(const T* x, T* y, int* winner, cuda::PoolDims d,
                                       cuda::PoolIndex<Div> at, int kernel, int stride,
                                       int padding) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.P * d.Q / kVec;
  REPLICA_GRID_STRIDE(t, total) {
    int oy, ox;
    const PlaneOffsets p = locate<kNhwc, kVec>(Index(t), at, at.by_p, at.by_q, d, &oy, &ox);
    int best[kVec];
    cuda::Pack<kVec> value;
    window_argmax<kVec>(x + p.in, p.step, d, kernel, stride, padding, oy, ox, best, value);
    const int64_t o = p.out + (oy * d.Q + ox) * p.step;
    if (y) value.store(y, o / kVec);
    if (winner)
      for (int k = 0; k < kVec; ++k) winner[o + k] = best[k];
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

// dx at each input position: the sum of dy over the windows it won, in ascending window order
// (the CPU's), a thread per kVec elements; dy is read only where a window was won.
template <bool kNhwc, int kVec, class Div, class T>
__global__ void maxpool_backward_kernel(const int* winner, const T* dy, T* dx, cuda::PoolDims d,
                                        cuda::PoolIndex<Div> at, int kernel, int padding) {
  using Index = typename Div::Index;
  const int64_t total = d.planes * d.H * d.W / kVec;
  REPLICA_GRID_STRIDE(t, total) {
    int iy, ix;
    const PlaneOffsets p = locate<kNhwc, kVec>(Index(t), at, at.by_h, at.by_w, d, &iy, &ix);
    const int self = iy * int(d.W) + ix;
    int64_t y0, y1, x0, x1;
    covering_windows(iy, kernel, at.by_stride, padding, d.P, &y0, &y1);
    covering_windows(ix, kernel, at.by_stride, padding, d.Q, &x0, &x1);
    cuda::Pack<kVec> g;
    for (int k = 0; k < kVec; ++k) g.v[k] = 0.f;
    for (int64_t oy = y0; oy <= y1; ++oy)
      for (int64_t ox = x0; ox <= x1; ++ox) {
        const int64_t o = p.out + (oy * d.Q + ox) * p.step;
        bool won[kVec], any = false;
        for (int k = 0; k < kVec; ++k) any |= won[k] = winner[o + k] == self;
        if (!any) continue;
        cuda::Pack<kVec> gy;
        gy.load(dy, o / kVec);
        for (int k = 0; k < kVec; ++k)
          if (won[k]) g.v[k] += gy.v[k];
      }
    g.store(dx, (p.in + self * p.step) / kVec);
  }
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
  // Positions in a plane are ints (the winners, the kernels' coordinates).
  REPLICA_CHECK(x.dim(2) * x.dim(3) <= INT32_MAX && P * Q <= INT32_MAX,
                "{}: a plane of {} is too large", op, shape_str(x.shape()));
}

// Calls launch(nhwc, width, T(), index) for max pooling over the layout its tensors share
// (engine/tensor.h; Backend::Layouts::Uniform: the layer around the backend gives NCHW copies
// where they differ): nhwc a std::bool_constant, NHWC where any is laid out so (one whose
// layout is NCHW's too fits either); width 4 (four adjacent channels a thread, in one load)
// where NHWC's C is a multiple of 4 and every pointer is 16-byte aligned, else 1; T and the
// dividers as cuda::with_pool_launch gives them, with C / width channel groups to a pixel. Over
// NHWC a warp reads 32 or 128 adjacent channels of a position; over NCHW, a row's neighbours.
template <class F>
void with_maxpool_launch(const char* op, std::initializer_list<const Tensor*> tensors,
                         std::initializer_list<const void*> pointers, const cuda::PoolDims& d,
                         const Pool2dParams& p, F&& launch) {
  bool nhwc = false;
  for (const Tensor* t : tensors) nhwc |= t->nhwc_memory();
  for (const Tensor* t : tensors)
    REPLICA_CHECK(!t->defined() || t->nhwc_memory() == nhwc || t->layout_free(),
                  "{}: its tensors are in different memory layouts (NCHW and channels_last)", op);
  const auto run = [&](auto layout, auto width) {
    const int64_t groups = decltype(layout)::value ? d.C / decltype(width)::value : 1;
    cuda::with_pool_launch(op, tensors, d, p.stride, p.padding, groups,
                           [&](auto tag, auto at) { launch(layout, width, tag, at); });
  };
  if (!nhwc)
    run(std::false_type(), std::integral_constant<int, 1>());
  else
    cuda::with_width(d.C % 4 == 0 && cuda::aligned16(pointers),
                     [&](auto width) { run(std::true_type(), width); });
}

}  // namespace

void CudaBackend::maxpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y,
                                    const Pool2dParams& p) {
  const char* op = "maxpool2d_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  const cuda::PoolDims d = cuda::pool_dims(x, y, op);
  check_maxpool(x, y, p, op);
  if (d.planes * d.P * d.Q == 0) return;
  const cudaStream_t stream = cuda_state(ctx).stream;
  with_maxpool_launch(op, {&x, &y}, {x.raw(), y.raw()}, d, p,
                      [&](auto nhwc, auto width, auto tag, auto at) {
    using T = decltype(tag);
    constexpr int kVec = decltype(width)::value;
    maxpool_windows_kernel<decltype(nhwc)::value, kVec>
        <<<cuda::grid_for(d.planes * d.P * d.Q / kVec), cuda::kThreads, 0, stream>>>(
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
  const cuda::PoolDims d = cuda::pool_dims(x, dy, op);
  check_maxpool(x, dy, p, op);
  if (y.defined()) cuda::expect_shape(y, dy.shape(), op, "y");
  cuda::expect_shape(dx, x.shape(), op, "dx");
  const int64_t total = d.planes * d.H * d.W;
  if (total == 0) return;
  // y is not needed: the winners are found again in x with the forward's exact rule.
  const int64_t windows = d.planes * d.P * d.Q;
  const cudaStream_t stream = cuda_state(ctx).stream;
  const Tensor winners = scratch(ctx, windows);
  int* winner = reinterpret_cast<int*>(winners.f32());  // an int per float slot
  with_maxpool_launch(op, {&x, &dy, &dx}, {x.raw(), dy.raw(), dx.raw(), winner}, d, p,
                      [&](auto nhwc, auto width, auto tag, auto at) {
    using T = decltype(tag);
    constexpr bool kNhwc = decltype(nhwc)::value;
    constexpr int kVec = decltype(width)::value;
    if (windows > 0) {
      maxpool_windows_kernel<kNhwc, kVec>
          <<<cuda::grid_for(windows / kVec), cuda::kThreads, 0, stream>>>(
              elements<T>(x), static_cast<T*>(nullptr), winner, d, at, p.kernel, p.stride,
              p.padding);
      REPLICA_LAUNCH_CHECK();
    }
    maxpool_backward_kernel<kNhwc, kVec>
        <<<cuda::grid_for(total / kVec), cuda::kThreads, 0, stream>>>(
            winner, elements<T>(dy), elements<T>(dx), d, at, p.kernel, p.padding);
    REPLICA_LAUNCH_CHECK();
  });
}

}  // namespace replica
