// Per-channel sums and the per-channel affine pass (engine/cuda/channel_pass.h).
//
// These passes only move memory, so they are written to keep it moving. On an H200 BatchNorm's
// first kernels ran at about a quarter of the memory's bandwidth (ResNet-50 TF32, batch 64:
// 129 us per forward, 176 per backward, 16 of the step's 37 ms): one load in flight per thread,
// a 64-bit division per value where planes are small (7x7), and output blocks of one plane
// that left 80% of their threads idle at 7x7. Here every thread of the sums has four loads in
// flight before it adds, indices are split with FastDivmod (engine/cuda/index_math.h), and the
// affine pass is flat, a float4 per thread where a plane is a whole number of float4s. Rows of
// channels side by side (NHWC) have row passes: a thread keeps to 1, 2 or 4 adjacent channels
// down a slice of rows, so a warp's load is a whole row's run of channels and a channel's own
// values (its scale and shift, its pivot) are read once per thread.
#include "engine/cuda/channel_pass.h"

namespace replica {
namespace cuda {

namespace {

// Block (c, s) of slices S: the sums over slice s of channel c's values (slice_sums).
template <class Div, ChannelSum kWhat, class T>
__global__ void channel_partials_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                        const T* __restrict__ relu_y, const float* mean,
                                        const float* invstd, ChannelDims d, Div by_hw, int S,
                                        int64_t per, double* part_a, double* part_b) {
  using Index = typename Div::Index;
  __shared__ double sh[kThreads];
  const int64_t c = blockIdx.x / S, s = blockIdx.x % S;
  const int64_t first = s * per;  // per: values per slice, ceil(m / S) (the host divides)
  const Index j0 = Index(first), j1 = Index(first + per < d.m() ? first + per : d.m());
  double a, b;
  slice_sums<kWhat>(x, dy, relu_y, mean, invstd, d, by_hw, c, j0, j1, sh, &a, &b);
  if (threadIdx.x == 0) {
    part_a[blockIdx.x] = a;
    if constexpr (kWhat != ChannelSum::Values) part_b[blockIdx.x] = b;
  }
}

// The same sums where a channel's values are every C-th (hw = 1: [N, C], or an NHWC tensor seen
// as [N*H*W, C]): there the kernel above would read a value per 2-4 bytes of a 32-byte sector.
// A block reads a slice of rows of 32 kPer channels (RowSlice, channel_pass.h); then each
// channel's 8 warp sums are added in warp order. A channel's values meet in the same order
// whatever kPer is: kPer only widens the loads (one channel a thread moved 64 bytes a warp
// load in BF16, half a cache line).
template <ChannelSum kWhat, int kPer, class T>
__global__ void row_partials_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                    const T* __restrict__ relu_y, const float* mean,
                                    const float* invstd, ChannelDims d, int S, int64_t per,
                                    double* part_a, double* part_b) {
  constexpr bool kGrad = kWhat == ChannelSum::GradMoments;
  __shared__ double sh_a[kRowWarps][32 * kPer], sh_b[kRowWarps][32 * kPer];
  const RowSlice<kPer> rows(d, S, per);
  const int64_t c0 = rows.c0;
  double a[kPer] = {}, b[kPer] = {};
  if (c0 < d.c) {
    double pivot[kPer], is[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      pivot[k] = 0, is[k] = 1;
      if constexpr (kWhat == ChannelSum::Moments) pivot[k] = widen(x[c0 + k]);
      if constexpr (kGrad) pivot[k] = mean[c0 + k], is[k] = invstd[c0 + k];
    }
    for (int64_t r = rows.first(); r < rows.r1; r += rows.kStep) {
      float xv[kUnroll][kPer], gv[kUnroll][kPer] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ru = r + u * kRowWarps;
        if (ru < rows.r1) {
          const int64_t i = ru * d.c + c0;
          load_adjacent<kPer>(x, i, xv[u]);
          if constexpr (kGrad) {
            float g[kPer], mask[kPer];
            load_adjacent<kPer>(dy, i, g);
            if (relu_y) load_adjacent<kPer>(relu_y, i, mask);
#pragma unroll
            for (int k = 0; k < kPer; ++k)
              gv[u][k] = masked_grad(g[k], relu_y ? mask[k] : 1.f, relu_y);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * kRowWarps >= rows.r1) break;
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          add_value<kWhat>(xv[u][k], gv[u][k], pivot[k], is[k], a[k], b[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    sh_a[threadIdx.y][threadIdx.x * kPer + k] = a[k];
    sh_b[threadIdx.y][threadIdx.x * kPer + k] = b[k];
  }
  __syncthreads();
  if (threadIdx.y != 0 || c0 >= d.c) return;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    for (int w = 1; w < kRowWarps; ++w) {
      a[k] += sh_a[w][threadIdx.x * kPer + k];
      b[k] += sh_b[w][threadIdx.x * kPer + k];
    }
    part_a[(c0 + k) * S + rows.s] = a[k];
    if constexpr (kWhat != ChannelSum::Values) part_b[(c0 + k) * S + rows.s] = b[k];
  }
}

template <ChannelSum kWhat, class T>
void launch_partials(const ChannelDims& d, int S, const T* x, const T* dy, const T* relu_y,
                     const float* mean, const float* invstd, double* part_a, double* part_b,
                     cudaStream_t stream) {
  if (d.hw == 1) {
    with_row_blocks(d, S, {x, dy, relu_y}, [&](auto width, const RowGrid& g) {
      row_partials_kernel<kWhat, decltype(width)::value, T>
          <<<g.blocks, dim3(32, kRowWarps), 0, stream>>>(x, dy, relu_y, mean, invstd, d, g.S,
                                                         g.per, part_a, part_b);
    });
    REPLICA_LAUNCH_CHECK();
    return;
  }
  const unsigned blocks = unsigned(d.c * S);
  const int64_t per = (d.m() + S - 1) / S;
  if (fast_index(d.numel())) {
    channel_partials_kernel<FastDivmod, kWhat, T><<<blocks, kThreads, 0, stream>>>(
        x, dy, relu_y, mean, invstd, d, FastDivmod(d.hw), S, per, part_a, part_b);
  } else {
    channel_partials_kernel<WideDivmod, kWhat, T><<<blocks, kThreads, 0, stream>>>(
        x, dy, relu_y, mean, invstd, d, WideDivmod(d.hw), S, per, part_a, part_b);
  }
  REPLICA_LAUNCH_CHECK();
}

// Where a channel's values are one slice of planes (one_block_channels): block c adds them up
// (slice_sums, as channel_partials_kernel does) and adds the sum to out[c] itself, one launch
// for the two of the sliced way, with the same bits.
template <class Div, class T>
__global__ void channel_sum_block_kernel(const T* __restrict__ x, ChannelDims d, Div by_hw,
                                         float* out) {
  using Index = typename Div::Index;
  __shared__ double sh[kThreads];
  double sum, unused;
  slice_sums<ChannelSum::Values>(x, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr),
                                 nullptr, nullptr, d, by_hw, blockIdx.x, Index(0), Index(d.m()),
                                 sh, &sum, &unused);
  if (threadIdx.x == 0) out[blockIdx.x] += float(sum);
}

__global__ void channel_accumulate_kernel(const double* part, int S, int64_t C, float* out) {
  REPLICA_CHANNEL_WARPS(c, C) {
    double sum, unused;
    channel_sums(part, nullptr, S, c, &sum, &unused);
    if (threadIdx.x % 32 == 0) out[c] += float(sum);
  }
}

template <class At, int kVec, class T>
__global__ void channel_affine_kernel(const T* x, T* y, const float* scale, const float* shift,
                                      const T* residual, At at, bool relu) {
  using Index = typename At::Index;
  REPLICA_CHANNEL_GROUPS(g, at) {
    const Index c = at.channel(g * kVec);
    const float a = scale ? scale[c] : 1.f, b = shift[c];
    Pack<kVec> v, r;
    v.load(x, g);
    if (residual) r.load(residual, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      v.v[k] = affine_value(v.v[k], a, b, residual, residual ? r.v[k] : 0.f, relu);
    v.store(y, g);
  }
}

// The same pass over rows of channels (hw = 1), a row pass: each thread reads its channels'
// scale and shift once, where the flat pass read them for every element.
template <int kPer, class T>
__global__ void channel_affine_rows_kernel(const T* x, T* y, const float* scale,
                                           const float* shift, const T* residual, ChannelDims d,
                                           int S, int64_t per, bool relu) {
  const RowSlice<kPer> rows(d, S, per);
  if (rows.c0 >= d.c) return;
  float a[kPer], b[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    a[k] = scale ? scale[rows.c0 + k] : 1.f;
    b[k] = shift[rows.c0 + k];
  }
  for (int64_t r = rows.first(); r < rows.r1; r += rows.kStep) {
    float v[kUnroll][kPer], res[kUnroll][kPer];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t ru = r + u * kRowWarps;
      if (ru >= rows.r1) break;
      load_adjacent<kPer>(x, ru * d.c + rows.c0, v[u]);
      if (residual) load_adjacent<kPer>(residual, ru * d.c + rows.c0, res[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t ru = r + u * kRowWarps;
      if (ru >= rows.r1) break;
#pragma unroll
      for (int k = 0; k < kPer; ++k)
        v[u][k] = affine_value(v[u][k], a[k], b[k], residual, residual ? res[u][k] : 0.f, relu);
      store_adjacent<kPer>(y, ru * d.c + rows.c0, v[u]);
    }
  }
}

}  // namespace

int channel_slices(const ChannelDims& d, const char* op) {
  // Rows of channels side by side (hw = 1) are read 32 to 128 channels a block: slices of 512
  // rows, up to 1024 of them, give a channel-poor NHWC tensor (64 channels) blocks enough to
  // fill the GPU.
  const int64_t per = d.hw == 1 ? 512 : 4096, cap = d.hw == 1 ? 1024 : 128;
  const int64_t s = (d.m() + per - 1) / per;
  const int S = int(s < 1 ? 1 : (s > cap ? cap : s));
  REPLICA_CHECK(d.c * S <= INT32_MAX, "{}: {} channels are too many for one launch", op, d.c);
  return S;
}

template <class T>
void channel_partials(ChannelSum what, const ChannelDims& d, int S, const T* x, const T* dy,
                      const T* relu_y, const float* mean, const float* invstd, double* part_a,
                      double* part_b, cudaStream_t stream) {
  const auto launch = what == ChannelSum::Values    ? launch_partials<ChannelSum::Values, T>
                      : what == ChannelSum::Moments ? launch_partials<ChannelSum::Moments, T>
                                                    : launch_partials<ChannelSum::GradMoments, T>;
  launch(d, S, x, dy, relu_y, mean, invstd, part_a, part_b, stream);
}

template <class T>
void channel_sum_accumulate(const ChannelDims& d, int S, const T* x, float* scratch, float* out,
                            cudaStream_t stream) {
  if (one_block_channels(d, S)) {
    const auto launch = [&](auto by_hw) {
      channel_sum_block_kernel<<<unsigned(d.c), kThreads, 0, stream>>>(x, d, by_hw, out);
    };
    if (fast_index(d.numel()))
      launch(FastDivmod(d.hw));
    else
      launch(WideDivmod(d.hw));
    REPLICA_LAUNCH_CHECK();
    return;
  }
  double* part = reinterpret_cast<double*>(scratch);
  launch_partials<ChannelSum::Values, T>(d, S, x, nullptr, nullptr, nullptr, nullptr, part,
                                         nullptr, stream);
  channel_accumulate_kernel<<<grid_for(d.c * 32), kThreads, 0, stream>>>(part, S, d.c, out);
  REPLICA_LAUNCH_CHECK();
}

template <class T>
void channel_affine(const ChannelDims& d, const T* x, T* y, const float* scale,
                    const float* shift, const T* residual, bool relu, cudaStream_t stream) {
  if (d.hw == 1) {
    with_row_blocks(d, 0, {x, y, residual}, [&](auto width, const RowGrid& g) {
      channel_affine_rows_kernel<decltype(width)::value, T>
          <<<g.blocks, dim3(32, kRowWarps), 0, stream>>>(x, y, scale, shift, residual, d, g.S,
                                                         g.per, relu);
    });
    REPLICA_LAUNCH_CHECK();
    return;
  }
  with_channel_index(d, {x, y, residual}, [&](auto at, auto width) {
    constexpr int kVec = decltype(width)::value;
    channel_affine_kernel<decltype(at), kVec, T>
        <<<grid_for(d.numel() / kVec), kThreads, 0, stream>>>(
        x, y, scale, shift, residual, at, relu);
  });
  REPLICA_LAUNCH_CHECK();
}

void add_channel_bias(const ChannelDims& d, Tensor& y, const Tensor& b, cudaStream_t stream) {
  with_storage(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* yp = elements<T>(y);
    channel_affine<T>(d, yp, yp, nullptr, b.f32(), nullptr, false, stream);
  });
}

void accumulate_bias_grad(const ChannelDims& d, int S, const Tensor& dy, const Tensor& scratch,
                          Tensor& db, cudaStream_t stream) {
  with_storage(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    channel_sum_accumulate<T>(d, S, elements<T>(dy), scratch.f32(), db.f32(), stream);
  });
}

// The storage types the passes run on: F32 and BF16.
#define REPLICA_CHANNEL_PASSES(T)                                                              \
  template void channel_partials<T>(ChannelSum, const ChannelDims&, int, const T*, const T*,   \
                                    const T*, const float*, const float*, double*, double*,    \
                                    cudaStream_t);                                             \
  template void channel_sum_accumulate<T>(const ChannelDims&, int, const T*, float*, float*,   \
                                          cudaStream_t);                                       \
  template void channel_affine<T>(const ChannelDims&, const T*, T*, const float*, const float*, \
                                  const T*, bool, cudaStream_t);
REPLICA_CHANNEL_PASSES(float)
REPLICA_CHANNEL_PASSES(uint16_t)
#undef REPLICA_CHANNEL_PASSES

}  // namespace cuda
}  // namespace replica
