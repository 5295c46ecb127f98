// The index arithmetic both pooling files share (pool.cu: max pooling; adaptive_pool.cu:
// adaptive average pooling): a pooling's extents, its dividers (engine/cuda/index_math.h), and
// the launch that picks the activations' storage type and the divider width. Every division in
// a pooling kernel is by an extent, the stride or a channel group count, through these
// dividers: with 64-bit `/` and `%` (eight per input element in max pooling's backward) that
// backward took 1.06 ms of ResNet-50's step on an H200, about 10x its memory traffic, and the
// global average pool's backward 0.24 ms for 25 MB.
// Included by the CUDA backend's pooling .cu files only.
#pragma once
#include <algorithm>
#include <initializer_list>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/index_math.h"

namespace replica {
namespace cuda {

struct PoolDims {
  int64_t planes, H, W, P, Q;  // planes = N*C; input H x W; output P x Q
  int64_t C;                   // channels: the step between an NHWC plane's neighbours
};

// The dividers a pooling kernel needs: by the input's and the output's extents, by the stride
// (max pooling; 1 for adaptive pooling), and by the channel groups of an NHWC pixel (C / kVec;
// 1 over NCHW).
template <class Div>
struct PoolIndex {
  using Index = typename Div::Index;
  Div by_h, by_w, by_p, by_q, by_stride, by_groups;
  // Flat index i of planes of R x S (by_rows = R, by_cols = S): (plane, row, column).
  __device__ __forceinline__ void split3(Index i, const Div& by_rows, const Div& by_cols,
                                         Index* plane, Index* row, Index* col) const {
    const Index t = cuda::split(by_cols, i, col);
    *plane = cuda::split(by_rows, t, row);
  }
};

// Calls launch(T(), index) with T the storage type `op`'s activations share (float: F32,
// uint16_t: BF16; cuda::activations_dtype) and the dividers for d, `groups` channel groups to
// an NHWC pixel (1 over NCHW): FastDivmod where every number divided stays below 2^31 (the
// flat indices; the adaptive windows' products o * In; a coordinate plus the padding and the
// stride), else WideDivmod. Extents of 0 divide nothing: they get divisor 1.
template <class F>
void with_pool_launch(const char* op, std::initializer_list<const Tensor*> activations,
                      const PoolDims& d, int stride, int padding, int64_t groups, F&& launch) {
  const auto at_least_1 = [](int64_t v) { return v < 1 ? int64_t(1) : v; };
  const int64_t largest = std::max({d.planes * d.H * d.W, d.planes * d.P * d.Q,
                                    (d.P + 1) * d.H + d.P, (d.Q + 1) * d.W + d.Q,
                                    (d.H + 1) * d.P + d.H, (d.W + 1) * d.Q + d.W,
                                    std::max(d.H, d.W) + int64_t(padding) + stride});
  const auto make = [&](auto div) {
    using Div = decltype(div);
    return PoolIndex<Div>{Div(at_least_1(d.H)), Div(at_least_1(d.W)), Div(at_least_1(d.P)),
                          Div(at_least_1(d.Q)), Div(stride),        Div(at_least_1(groups))};
  };
  with_storage(cuda::activations_dtype(op, activations), [&](auto tag) {
    if (cuda::fast_index(largest))
      launch(tag, make(FastDivmod()));
    else
      launch(tag, make(WideDivmod()));
  });
}

inline PoolDims pool_dims(const Tensor& x, const Tensor& y, const char* op) {
  REPLICA_CHECK(x.ndim() == 4 && y.ndim() == 4 && x.dim(0) == y.dim(0) && x.dim(1) == y.dim(1),
                "{}: expected NCHW input and output with the same N and C, got {} and {}", op,
                shape_str(x.shape()), shape_str(y.shape()));
  return {x.dim(0) * x.dim(1), x.dim(2), x.dim(3), y.dim(2), y.dim(3), x.dim(1)};
}

}  // namespace cuda
}  // namespace replica
