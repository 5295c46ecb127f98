// Per-channel passes over a [N, C, HW] tensor (HW = 1 for [N, C]), shared by BatchNorm
// (norm.cu), the convolutions' and linear layers' biases (conv.cu, dense.cu):
// - sums per channel, in two steps so that every channel's values spread over many blocks:
//   channel_partials writes a double per (channel, slice of ~4096 values), and channel_sums
//   adds a channel's slices in order (in a per-channel kernel). The order is fixed by the shape,
//   so a run reproduces to the bit. Where a channel is one slice (S = 1), a block per channel
//   can finish the job itself after slice_sums (a bias gradient here, BatchNorm in
//   norm_block.cu): the same sums, one launch instead of two or three.
// - channel_affine, y = x * scale[c] + shift[c] (then a ReLU): a flat pass over planes, float4s
//   per thread where HW is a multiple of 4 and the buffers are 16-byte aligned; over rows of
//   channels side by side (HW = 1, NHWC) a row pass, each thread on its own few channels.
// A block of one channel alone, as the bias gradients had, reads with a few KB in flight: on an
// H200 that is a few GB/s per channel, and a 64-channel layer used half the SMs.
// Included by the CUDA backend's .cu files only.
#pragma once
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/index_math.h"
#include "engine/env_switch.h"

namespace replica {
namespace cuda {

struct ChannelDims {
  int64_t n, c, hw;
  __host__ __device__ int64_t m() const { return n * hw; }  // values per channel
  int64_t numel() const { return n * c * hw; }
};

// The channels of t ([N, C, ...], at least 2-D): [N, C, the product of the rest], or for a
// channels_last t (engine/tensor.h) [N*H*W, C, 1], its channels side by side in rows.
inline ChannelDims channel_dims(const Tensor& t) {
  int64_t hw = 1;
  for (int i = 2; i < t.ndim(); ++i) hw *= t.dim(i);
  if (t.channels_last()) return {t.dim(0) * hw, t.dim(1), 1};
  return {t.dim(0), t.dim(1), hw};
}

// Slices per channel for channel_partials: about 4096 values each (four rounds of four loads
// per thread), at most 128; where hw = 1 (a channel's values every C-th: [N, C], or NHWC
// seen as [N*H*W, C]), 512 rows each, at most 1024, read 32 to 128 channels to a block. Fixed by
// the shape alone: the sums' order, and so their bits, do not depend on the GPU. Throws if
// C * slices is too many blocks for one launch (checked before any launch, so a refused shape
// changes nothing).
int channel_slices(const ChannelDims& d, const char* op);

// Whether a block per channel takes a channel's values whole and finishes the channel itself
// (a bias gradient here, BatchNorm in norm_block.cu): planes (HW > 1) whose channels are one
// slice each (S = channel_slices(d) is 1). Rows of channels (HW = 1) keep the row passes, whose
// output passes want more blocks than one per 32-128 channels. REPLICA_CUDA_SLICED_SUMS=1 in
// the environment turns this way off, every channel then summed in slices as larger planes
// are: the same bits (the parity tests hold them equal), to time the two ways in one run.
inline bool one_block_channels(const ChannelDims& d, int S) {
  return S == 1 && d.hw > 1 && !switches::kCudaSlicedSums.on();
}

// What channel_partials adds up per channel (a, b):
// - Values: sum(x) alone (part_b is not written and may be null).
// - Moments: sum(x - K), sum((x - K)^2), with K the channel's first value (a shift that keeps
//   the one-pass variance exact in spirit).
// - GradMoments: sum(g), sum(g * (x - mean) * invstd), with g = dy, or dy where relu_y > 0 when
//   relu_y is given (a ReLU fused after a BatchNorm).
enum class ChannelSum { Values, Moments, GradMoments };

// part_a, part_b: C * S doubles each, channel c's slices at [c * S, c * S + S). Unused
// pointers may be null (dy, relu_y, mean, invstd for Values and Moments). T: how x, dy and
// relu_y are stored (float: F32, uint16_t: BF16; widen in engine/ops.h); the sums are the
// same either way.
template <class T>
void channel_partials(ChannelSum what, const ChannelDims& d, int S, const T* x, const T* dy,
                      const T* relu_y, const float* mean, const float* invstd, double* part_a,
                      double* part_b, cudaStream_t stream);

// Channel c's slices added up by the warp that calls it (every lane, with the same c): lane l
// adds slices l, l + 32, ... in order, then the lanes' sums meet in a fixed butterfly, after
// which every lane holds the same bits (a + b is b + a). One thread per channel had walked up to
// 1,024 slices, each add waiting on its load, twice per BatchNorm step.
__device__ __forceinline__ void channel_sums(const double* part_a, const double* part_b, int S,
                                             int64_t c, double* a, double* b) {
  double sa = 0, sb = 0;
  for (int s = threadIdx.x % 32; s < S; s += 32) {
    sa += part_a[c * S + s];
    if (part_b) sb += part_b[c * S + s];
  }
  for (int lanes = 16; lanes > 0; lanes /= 2) {
    sa += __shfl_xor_sync(0xffffffffu, sa, lanes);
    sb += __shfl_xor_sync(0xffffffffu, sb, lanes);
  }
  *a = sa;
  *b = sb;
}

// The grid-stride loop of a per-channel kernel that calls channel_sums: a warp per channel c
// (launched with grid_for(C * 32) blocks of a multiple of 32 threads); lane 0 writes.
#define REPLICA_CHANNEL_WARPS(c, C)                                                       \
  for (int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; c < (C);        \
       c += int64_t(gridDim.x) * blockDim.x / 32)

// Floats of scratch channel_sum_accumulate takes for d and its S slices (a double each), none
// where one block per channel sums it (one_block_channels).
inline int64_t channel_sum_scratch(const ChannelDims& d, int S) {
  return one_block_channels(d, S) ? 0 : 2 * d.c * S;
}

// out[c] += the sum of channel c of x (a bias gradient), S = channel_slices(d), on `scratch` of
// channel_sum_scratch(d, S) floats (none where S is 1 over planes: a block per channel then
// adds its values up and adds them to out in one launch).
template <class T>
void channel_sum_accumulate(const ChannelDims& d, int S, const T* x, float* scratch, float* out,
                            cudaStream_t stream);

// y = x * scale[c] + shift[c] (scale null: x + shift[c]), plus residual where it is not null
// (add's rule), then max(., 0) where relu (relu_forward's rule). x may be y. T: how x, y and
// residual are stored; in fp32 either way, a BF16 y rounded once as it is stored.
template <class T>
void channel_affine(const ChannelDims& d, const T* x, T* y, const float* scale,
                    const float* shift, const T* residual, bool relu, cudaStream_t stream);

// A convolution's or linear layer's bias, y of d's shape in F32 or BF16 (bf16 storage):
// y += b[c] (channel_affine), and db[c] += the sum of dy's channel c (channel_sum_accumulate,
// S = channel_slices(d), on `scratch` of channel_sum_scratch(d, S) floats).
void add_channel_bias(const ChannelDims& d, Tensor& y, const Tensor& b, cudaStream_t stream);
void accumulate_bias_grad(const ChannelDims& d, int S, const Tensor& dy, const Tensor& scratch,
                          Tensor& db, cudaStream_t stream);

// The row passes (hw = 1: [N, C], an NHWC tensor seen as [N*H*W, C]): block (s, t) of S
// slices takes rows [s * per, (s + 1) * per) of channels [32 kPer t, 32 kPer (t + 1)), launched
// as dim3(32, kRowWarps) threads: a warp reads a row's 32 kPer channels side by side, kPer
// adjacent ones a thread in one load (load_adjacent), its kRowWarps warps every kRowWarps-th
// row, kUnroll rows in flight each. A thread keeps to its kPer channels, so what it needs of
// them is read once, not once a value.
constexpr int kUnroll = 4;  // loads each thread issues before it uses them
constexpr int kRowWarps = 8;

template <int kPer>
struct RowSlice {
  static constexpr int64_t kStep = int64_t(kUnroll) * kRowWarps;  // rows a round covers
  int64_t s, c0, r0, r1;  // the block's slice, the thread's first channel, the slice's rows
  __device__ RowSlice(const ChannelDims& d, int S, int64_t per)
      : s(blockIdx.x % S), c0(int64_t(blockIdx.x / S) * 32 * kPer + threadIdx.x * kPer),
        r0(s * per), r1(r0 + per < d.n ? r0 + per : d.n) {}
  __device__ int64_t first() const { return r0 + threadIdx.y; }  // the thread's first row
};

// v = the kPer values at p[i], p[i + 1], ... in one load (i a multiple of kPer, p 16-byte
// aligned), widened; store_adjacent writes them back (rounded where T is BF16).
template <int kPer, class T>
__device__ __forceinline__ void load_adjacent(const T* p, int64_t i, float (&v)[kPer]) {
  if constexpr (kPer == 1) {
    v[0] = widen(p[i]);
  } else if constexpr (std::is_same_v<T, float>) {
    if constexpr (kPer == 2) {
      const float2 f = *reinterpret_cast<const float2*>(p + i);
      v[0] = f.x, v[1] = f.y;
    } else {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
  } else if constexpr (kPer == 2) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p + i);  // element 0 in the low half
    v[0] = widen(uint16_t(u)), v[1] = widen(uint16_t(u >> 16));
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p + i);
    v[0] = widen(uint16_t(u.x)), v[1] = widen(uint16_t(u.x >> 16));
    v[2] = widen(uint16_t(u.y)), v[3] = widen(uint16_t(u.y >> 16));
  }
}

template <int kPer, class T>
__device__ __forceinline__ void store_adjacent(T* p, int64_t i, const float (&v)[kPer]) {
  if constexpr (kPer == 1) {
    p[i] = narrow<T>(v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    if constexpr (kPer == 2)
      *reinterpret_cast<float2*>(p + i) = make_float2(v[0], v[1]);
    else
      *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    const auto bits = [&](int k) { return uint32_t(narrow<uint16_t>(v[k])); };
    if constexpr (kPer == 2)
      *reinterpret_cast<uint32_t*>(p + i) = bits(0) | (bits(1) << 16);
    else
      *reinterpret_cast<uint2*>(p + i) = make_uint2(bits(0) | (bits(1) << 16),
                                                    bits(2) | (bits(3) << 16));
  }
}

// A row pass's launch: blocks of dim3(32, kRowWarps), S slices of `per` rows (RowSlice).
struct RowGrid {
  unsigned blocks;
  int S;
  int64_t per;
};

// Calls launch(width, grid) for a row pass over d (hw = 1): width a std::integral_constant
// kPer, 4 where a block's 128 channels are all there, 2 where 64 are, and every pointer is
// 16-byte aligned, else 1. S: the sums' slices (channel_slices: their order fixes the bits), or
// 0 for a pass whose elements are each on their own (dx, affine), which gets slices enough for
// about 2048 blocks, each of at least one round of rows: few rows of many channels (ResNet's
// last stage at a small batch) would otherwise leave most SMs without a block.
template <class F>
void with_row_blocks(const ChannelDims& d, int S, std::initializer_list<const void*> pointers,
                     F&& launch) {
  const bool aligned = aligned16(pointers);
  const auto run = [&](auto width) {
    constexpr int kPer = decltype(width)::value;
    const int64_t channel_blocks = (d.c + 32 * kPer - 1) / (32 * kPer);
    int64_t s = S;
    if (s <= 0) {
      const int64_t rounds = (d.n + RowSlice<kPer>::kStep - 1) / RowSlice<kPer>::kStep;
      s = std::max<int64_t>(1, std::min(rounds, (2048 + channel_blocks - 1) / channel_blocks));
    }
    launch(width, RowGrid{unsigned(s * channel_blocks), int(s), (d.n + s - 1) / s});
  };
  if (aligned && d.c % 128 == 0)
    run(std::integral_constant<int, 4>());
  else if (aligned && d.c % 64 == 0)
    run(std::integral_constant<int, 2>());
  else
    run(std::integral_constant<int, 1>());
}

// Where the flat passes over planes (HW > 1; rows of channels go to the row passes above) find
// an element's channel: i = (n * C + c) * HW + p. A group of kVec elements
// (REPLICA_CHANNEL_GROUPS) shares its first element's channel, HW being a multiple of kVec.
template <class Div>
struct ChannelIndex {
  using Index = typename Div::Index;
  Div by_hw, by_c;
  Index numel;
  __device__ __forceinline__ Index channel(Index i) const {
    const Index plane = by_hw.div(i);
    return plane - by_c.div(plane) * by_c.divisor();
  }
};

// The grid-stride loop of a flat pass over groups of kVec elements of one channel each.
#define REPLICA_CHANNEL_GROUPS(g, at)                                                     \
  for (Index g = Index(blockIdx.x) * blockDim.x + threadIdx.x; g < (at).numel / kVec;    \
       g += Index(gridDim.x) * blockDim.x)

// Calls launch(index, width) for a flat pass over the elements of d (HW > 1): the FastDivmod
// index where every index is below 2^31 (else WideDivmod), and width 4 (float4 loads and
// stores) where HW is a multiple of 4 and every pointer the pass touches is 16-byte aligned
// (else 1).
template <class F>
void with_channel_index(const ChannelDims& d, std::initializer_list<const void*> pointers,
                        F&& launch) {
  const bool vec4 = d.hw % 4 == 0 && aligned16(pointers);
  const auto run = [&](auto at) { with_width(vec4, [&](auto width) { launch(at, width); }); };
  if (fast_index(d.numel()))
    run(ChannelIndex<FastDivmod>{FastDivmod(d.hw), FastDivmod(d.c), uint32_t(d.numel())});
  else
    run(ChannelIndex<WideDivmod>{WideDivmod(d.hw), WideDivmod(d.c), uint64_t(d.numel())});
}

// The gradient reaching a BatchNorm: dy, or with a fused ReLU dy where its output passes
// (relu_passes, engine/ops.h).
// Callers load both values unconditionally, so neither load waits on the other.
__device__ __forceinline__ float masked_grad(float dy, float relu_y, bool masked) {
  return masked && !relu_passes(relu_y) ? 0.f : dy;
}

// Adds one value (x, and g its gradient for GradMoments) to a thread's sums a and b, as
// ChannelSum says; pivot and is: the channel's K, or mean and invstd.
template <ChannelSum kWhat>
__device__ __forceinline__ void add_value(float x, float g, double pivot, double is, double& a,
                                          double& b) {
  if constexpr (kWhat == ChannelSum::Values) {
    a += x;
  } else if constexpr (kWhat == ChannelSum::Moments) {
    const double v = x - pivot;
    a += v;
    b += v * v;
  } else {
    a += g;
    b += g * (x - pivot) * is;
  }
}

// The block's sums (ChannelSum) over values [j0, j1) of channel c of a [N, C, HW] tensor,
// taken in n, then position order; every thread gets them (b: 0 for Values). Each thread reads
// kUnroll values a block's width apart, then adds them in that order. sh: blockDim.x doubles
// of shared memory (block_sum's). Called by every thread of the block.
template <ChannelSum kWhat, class Div, class T>
__device__ __forceinline__ void slice_sums(const T* x, const T* dy, const T* relu_y,
                                           const float* mean, const float* invstd,
                                           const ChannelDims& d, const Div& by_hw, int64_t c,
                                           typename Div::Index j0, typename Div::Index j1,
                                           double* sh, double* sum_a, double* sum_b) {
  using Index = typename Div::Index;
  constexpr bool kGrad = kWhat == ChannelSum::GradMoments;
  double pivot = 0, is = 1;
  if constexpr (kWhat == ChannelSum::Moments) pivot = widen(x[c * d.hw]);
  if constexpr (kGrad) {
    pivot = mean[c];
    is = invstd[c];
  }
  const Index C = Index(d.c), hw = Index(d.hw), step = Index(blockDim.x);
  double a = 0, b = 0;
  for (Index j = j0 + threadIdx.x; j < j1; j += kUnroll * step) {
    float xv[kUnroll], gv[kUnroll] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index ju = j + u * step;
      if (ju < j1) {
        Index p;
        const Index n = split(by_hw, ju, &p);
        const Index i = (n * C + Index(c)) * hw + p;
        xv[u] = widen(x[i]);
        if constexpr (kGrad)
          gv[u] = masked_grad(widen(dy[i]), relu_y ? widen(relu_y[i]) : 1.f, relu_y);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * step >= j1) break;
      add_value<kWhat>(xv[u], gv[u], pivot, is, a, b);
    }
  }
  *sum_a = block_sum(a, sh);
  *sum_b = 0;
  if constexpr (kWhat != ChannelSum::Values) *sum_b = block_sum(b, sh);
}

// One element of channel_affine: v * a + b, plus r where there is a residual, then the ReLU.
__device__ __forceinline__ float affine_value(float v, float a, float b, bool residual, float r,
                                              bool relu) {
  float o = v * a + b;
  if (residual) o = o + r;
  return relu ? relu_value(o) : o;
}

}  // namespace cuda
}  // namespace replica
