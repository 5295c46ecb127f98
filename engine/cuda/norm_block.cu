// CUDA backend: BatchNorm with a block per channel, where a channel's values fit one slice of
// the sums (engine/cuda/norm_channel.h says when and why). The block adds the channel's values
// up as the sliced passes' first kernel does (slice_sums, so the same sums in the same order),
// derives what the sliced passes' second kernel derives (norm_channel.h's formulas), and then,
// after a barrier, writes the channel's output or dx itself: three launches become one, and no
// scratch is taken.
//
// Reads before writes: every value the sums read, the channel's first value included, is read
// before the barrier in the sums' block_sum, and afterwards each thread reads and writes only
// its own elements. So y may be x (and dx may be dy), and no pointer is __restrict__.
#include "engine/cuda/norm_channel.h"

namespace replica {
namespace cuda {

namespace {

// The tensor's group (of kVec elements) holding channel c's j-th value, j a multiple of kVec
// (HW is, where kVec is 4).
template <int kVec, class Div>
__device__ __forceinline__ typename Div::Index channel_group(const ChannelDims& d,
                                                             const Div& by_hw, int64_t c,
                                                             typename Div::Index j) {
  using Index = typename Div::Index;
  Index p;
  const Index n = split(by_hw, j, &p);
  return ((n * Index(d.c) + Index(c)) * Index(d.hw) + p) / kVec;
}

// Channel c's values in groups of kVec, kUnroll groups a thread a round: load(u, g) for each
// of a round's groups (g: its index among the tensor's groups), then store(u, g) for each, so a
// round's loads are all in flight before any store.
template <int kVec, class Div, class Load, class Store>
__device__ __forceinline__ void channel_rounds(const ChannelDims& d, const Div& by_hw, int64_t c,
                                               Load&& load, Store&& store) {
  using Index = typename Div::Index;
  const Index m = Index(d.m()), step = Index(blockDim.x) * kVec;
  for (Index j = Index(threadIdx.x) * kVec; j < m; j += kUnroll * step) {
    Index g[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * step >= m) break;
      g[u] = channel_group<kVec>(d, by_hw, c, j + u * step);
      load(u, g[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * step >= m) break;
      store(u, g[u]);
    }
  }
}

// Block c: channel c's statistics and output.
template <class Div, int kVec, class T>
__global__ void bn_forward_block_kernel(const T* x, T* y, const T* residual, bool relu,
                                        const float* gamma, const float* beta, float momentum,
                                        float eps, TrainOut out, ChannelDims d, Div by_hw) {
  using Index = typename Div::Index;
  __shared__ double sh[kThreads];
  const int64_t c = blockIdx.x;
  const double first = widen(x[c * d.hw]);  // K of the moments, read before any write
  const Index m = Index(d.m());
  double sum, sq;
  slice_sums<ChannelSum::Moments>(x, static_cast<const T*>(nullptr),
                                  static_cast<const T*>(nullptr), nullptr, nullptr, d, by_hw, c,
                                  Index(0), m, sh, &sum, &sq);
  const BnCoeffs k = bn_train_coeffs(first, sum, sq, double(d.m()), c, gamma, beta, momentum,
                                     eps, out, threadIdx.x == 0);
  Pack<kVec> v[kUnroll], r[kUnroll];
  channel_rounds<kVec>(
      d, by_hw, c,
      [&](int u, Index g) {
        v[u].load(x, g);
        if (residual) r[u].load(residual, g);
      },
      [&](int u, Index g) {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          v[u].v[e] = affine_value(v[u].v[e], k.scale, k.shift, residual,
                                   residual ? r[u].v[e] : 0.f, relu);
        v[u].store(y, g);
      });
}

// Block c: channel c's gradient sums, dgamma and dbeta, then its dx (where dx is not null).
template <class Div, int kVec, class T>
__global__ void bn_backward_block_kernel(const T* x, const T* dy, const T* relu_y,
                                         const float* gamma, const float* mean,
                                         const float* invstd, float* dgamma, float* dbeta, T* dx,
                                         ChannelDims d, Div by_hw) {
  using Index = typename Div::Index;
  __shared__ double sh[kThreads];
  const int64_t c = blockIdx.x;
  const Index m = Index(d.m());
  double s_g, s_g_xhat;
  slice_sums<ChannelSum::GradMoments>(x, dy, relu_y, mean, invstd, d, by_hw, c, Index(0), m, sh,
                                      &s_g, &s_g_xhat);
  const BnDxChannel ch = bn_grad_channel(s_g, s_g_xhat, double(d.m()), c, gamma, mean, invstd,
                                         dgamma, dbeta, threadIdx.x == 0);
  if (!dx) return;
  Pack<kVec> xv[kUnroll], gv[kUnroll], rv[kUnroll];
  channel_rounds<kVec>(
      d, by_hw, c,
      [&](int u, Index g) {
        xv[u].load(x, g);
        gv[u].load(dy, g);
        if (relu_y) rv[u].load(relu_y, g);
      },
      [&](int u, Index g) {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          gv[u].v[e] = ch.dx(xv[u].v[e], gv[u].v[e], relu_y ? rv[u].v[e] : 1.f, relu_y,
                             double(d.m()));
        gv[u].store(dx, g);
      });
}

}  // namespace

template <class T>
void bn_forward_one_block(const ChannelDims& d, const T* x, T* y, const T* residual, bool relu,
                          const float* gamma, const float* beta, float momentum, float eps,
                          const TrainOut& out, cudaStream_t stream) {
  with_channel_index(d, {x, y, residual}, [&](auto at, auto width) {
    bn_forward_block_kernel<decltype(at.by_hw), decltype(width)::value, T>
        <<<unsigned(d.c), kThreads, 0, stream>>>(x, y, residual, relu, gamma, beta, momentum,
                                                 eps, out, d, at.by_hw);
  });
  REPLICA_LAUNCH_CHECK();
}

template <class T>
void bn_backward_one_block(const ChannelDims& d, const T* x, const T* dy, const T* relu_y,
                           const float* gamma, const float* mean, const float* invstd,
                           float* dgamma, float* dbeta, T* dx, cudaStream_t stream) {
  with_channel_index(d, {x, dy, relu_y, dx}, [&](auto at, auto width) {
    bn_backward_block_kernel<decltype(at.by_hw), decltype(width)::value, T>
        <<<unsigned(d.c), kThreads, 0, stream>>>(x, dy, relu_y, gamma, mean, invstd, dgamma,
                                                 dbeta, dx, d, at.by_hw);
  });
  REPLICA_LAUNCH_CHECK();
}

// The storage types BatchNorm runs on: F32 and BF16.
#define REPLICA_ONE_BLOCK(T)                                                                   \
  template void bn_forward_one_block<T>(const ChannelDims&, const T*, T*, const T*, bool,      \
                                        const float*, const float*, float, float,              \
                                        const TrainOut&, cudaStream_t);                        \
  template void bn_backward_one_block<T>(const ChannelDims&, const T*, const T*, const T*,     \
                                         const float*, const float*, const float*, float*,     \
                                         float*, T*, cudaStream_t);
REPLICA_ONE_BLOCK(float)
REPLICA_ONE_BLOCK(uint16_t)
#undef REPLICA_ONE_BLOCK

}  // namespace cuda
}  // namespace replica
