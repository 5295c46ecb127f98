#include "engine/cpu/direct_conv.h"

#include <algorithm>
#include <cstring>

#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/weight_chunks.h"
#include "engine/error.h"

namespace replica::cpu {

namespace {

// Where direct_conv_pays says yes, measured against im2col + GEMM forward and backward
// (bench/results/2026-11-29-cpu-direct-convolution.md): up to 32 output channels, from 4 input
// channels (with 1 to 3 the columns are few and cheap to build), on planes of 10x10 outputs and
// more (on 8x8 the wide rows' blocks of 64 are half padding and the weight gradient's loops too
// short); and in builds for AVX-512 only. Built for AVX2 (the GPU machine's package,
// -march=x86-64-v3) the 16-lane vectors run as pairs of 8 in half the registers, and it measured
// 0.5-0.8x im2col + GEMM on the same layers.
constexpr int64_t kMaxDirectChannels = 32, kMinDirectInputs = 4, kMinDirectPixels = 100;

}  // namespace

bool direct_conv_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool direct_conv_pays(const ConvGeometry& g) {
  return direct_conv_built() && g.stride == 1 && g.r > 1 && g.n > 0 && g.k > 0 &&
         g.k <= kMaxDirectChannels && g.c >= kMinDirectInputs && g.pq() >= kMinDirectPixels;
}

#if defined(__AVX512F__)

namespace {

// Register blocks for AVX-512's 32 vector registers. Forward and input gradient: kRows
// channels by kVecs vectors of pixels held as sums. Weight gradient: kGradRows output channels
// by kGradTaps taps (kLanes sums, added across lanes together), one vector of pixels at a time.
constexpr int kLanes = 16, kVecs = 4, kGradRows = 4;
typedef int Lanes __attribute__((vector_size(kLanes * sizeof(int))));
const Lanes kEven = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
const Lanes kOdd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
constexpr int kRows = 5, kGradTaps = kLanes / kGradRows;
constexpr int64_t kPixelBlock = int64_t(kLanes) * kVecs;


typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
// Every lane s: a broadcast. s - 0 is s for every s, so no subtraction is left; 0 + s would
// cost an add, since 0 + -0 is +0.
inline Vec splat(float s) { return s - Vec{}; }
// A vector a kernel multiplies several times, loaded once: held in a register, so that the
// compiler does not fold a load of it into each multiply-add (loads, not multiply-adds, would
// then bound the loop).
inline Vec load_held(const float* p) {
  Vec v = load(p);
  asm("" : "+v"(v));
  return v;
}

// The sum of v's lanes, in a fixed order.
inline float lane_sum(Vec v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// Lane e of the result = the sum of v[e]'s lanes, for kLanes vectors at once (v overwritten):
// each step adds the even lanes of two vectors to their odd lanes, so pairs of lanes, then
// pairs of pairs, are added in the same tree for every vector.
inline Vec lane_sums(Vec* v) {
  for (int n = kLanes; n > 1; n /= 2)
    for (int m = 0; m < n / 2; ++m)
      v[m] = __builtin_shuffle(v[2 * m], v[2 * m + 1], kEven) +
             __builtin_shuffle(v[2 * m], v[2 * m + 1], kOdd);
  return v[0];
}

// A stride-1 valid correlation of c planes hi x wi (padding already in them) with an r x r
// kernel, in the wide index: output pixel t = oy*wi + ox for t < (p-1)*wi + q, computed in
// blocks of kPixelBlock up to `tpad`. Reads reach tpad - t floats past the last plane: the
// buffer a frame is copied into holds them as zeros.
struct Frame {
  int64_t c, hi, wi, r, p, q, t, tpad;
  Frame(int64_t c_, int64_t hi_, int64_t wi_, int64_t r_)
      : c(c_), hi(hi_), wi(wi_), r(r_), p(hi_ - r_ + 1), q(wi_ - r_ + 1) {
    t = (p - 1) * wi + q;
    tpad = (t + kPixelBlock - 1) / kPixelBlock * kPixelBlock;
  }
  int64_t plane() const { return hi * wi; }
  int64_t floats() const { return c * plane() + tpad - t; }
  // Where kernel tap (c, i, j), numbered c*r*r + i*r + j, reads a frame: output pixel t reads
  // t + tap_offset.
  int64_t tap_offset(int64_t tap) const {
    return tap / (r * r) * plane() + tap / r % r * wi + tap % r;
  }
};

// Where planes of floats lie: the floats from one plane to the next, and from one row to the
// next.
struct Strides {
  int64_t plane, row;
};

// planes x rows x cols floats from src to dst, each laid out by its strides: a sample's NCHW
// planes into a frame or out of one.
void copy_planes(const float* src, Strides s, float* dst, Strides d, int64_t planes, int64_t rows,
                 int64_t cols) {
  for (int64_t c = 0; c < planes; ++c)
    for (int64_t y = 0; y < rows; ++y)
      std::memcpy(dst + c * d.plane + y * d.row, src + c * s.plane + y * s.row,
                  size_t(cols) * sizeof(float));
}

// dst (f.floats()) = the c planes h x w of src, `pad` zeros on every side, zeros after.
void pad_into(const float* src, int64_t h, int64_t w, int64_t pad, const Frame& f, float* dst) {
  std::fill(dst, dst + f.floats(), 0.f);
  copy_planes(src, {h * w, w}, dst + pad * f.wi + pad, {f.plane(), f.wi}, f.c, h, w);
}

// yw[rows, tpad] (rows k0.. of the output, wide) for the weights w[k][c][r][r], R rows at once.
template <int R>
void correlate_rows(const Frame& f, const float* xs, const float* w, int64_t k0, float* yw) {
  const int64_t crr = f.c * f.r * f.r;
  for (int64_t t0 = 0; t0 < f.tpad; t0 += kPixelBlock) {
    Vec acc[R][kVecs] = {};
    for (int64_t cc = 0; cc < f.c; ++cc)
      for (int64_t i = 0; i < f.r; ++i) {
        const float* run = xs + cc * f.plane() + i * f.wi + t0;
        const float* taps = w + k0 * crr + (cc * f.r + i) * f.r;
        for (int64_t j = 0; j < f.r; ++j) {
          Vec xv[kVecs];
          for (int v = 0; v < kVecs; ++v) xv[v] = load(run + j + v * kLanes);
          for (int a = 0; a < R; ++a) {
            const Vec wv = splat(taps[a * crr + j]);
            for (int v = 0; v < kVecs; ++v) acc[a][v] += wv * xv[v];
          }
        }
      }
    for (int a = 0; a < R; ++a)
      for (int v = 0; v < kVecs; ++v) store(yw + (k0 + a) * f.tpad + t0 + v * kLanes, acc[a][v]);
  }
}

// yw[k, tpad] = the correlation of the frame xs with w[k][c][r][r]. Each sum runs over
// (c, i, j) in order whatever the block, so every output has the same bits.
void correlate(const Frame& f, const float* xs, const float* w, int64_t k, float* yw) {
  int64_t k0 = 0;
  for (; k0 + kRows <= k; k0 += kRows) correlate_rows<kRows>(f, xs, w, k0, yw);
  for (; k0 < k; ++k0) correlate_rows<1>(f, xs, w, k0, yw);
}

// dw[k0.., tap0..] += sum over t of dyw[k][t] * xs[t + tap_offset(tap)], R channels by T taps
// at once.
template <int R, int T>
void weight_grad_block(const Frame& f, const float* xs, const float* dyw, int64_t k0,
                       int64_t tap0, int64_t crr, float* dw) {
  const float* run[T];
  for (int b = 0; b < T; ++b) run[b] = xs + f.tap_offset(tap0 + b);
  Vec acc[R * T] = {};
  for (int64_t t = 0; t < f.tpad; t += kLanes) {
    Vec d[R];
    for (int a = 0; a < R; ++a) d[a] = load_held(dyw + (k0 + a) * f.tpad + t);
    for (int b = 0; b < T; ++b) {
      const Vec xv = load_held(run[b] + t);
      for (int a = 0; a < R; ++a) acc[a * T + b] += d[a] * xv;
    }
  }
  if constexpr (R * T == kLanes) {
    const Vec sums = lane_sums(acc);
    for (int e = 0; e < R * T; ++e) dw[(k0 + e / T) * crr + tap0 + e % T] += sums[e];
  } else {
    for (int e = 0; e < R * T; ++e) dw[(k0 + e / T) * crr + tap0 + e % T] += lane_sum(acc[e]);
  }
}

template <int R>
void weight_grad_rows(const Frame& f, const float* xs, const float* dyw, int64_t k0, int64_t crr,
                      float* dw) {
  int64_t tap = 0;
  for (; tap + kGradTaps <= crr; tap += kGradTaps)
    weight_grad_block<R, kGradTaps>(f, xs, dyw, k0, tap, crr, dw);
  for (; tap < crr; ++tap) weight_grad_block<R, 1>(f, xs, dyw, k0, tap, crr, dw);
}

// dw[k, c*r*r] += the weight gradient of one sample: xs its input frame, dyw its output gradient
// wide (zero in the columns ox >= q and past t).
void weight_grad(const Frame& f, const float* xs, const float* dyw, int64_t k, float* dw) {
  const int64_t crr = f.c * f.r * f.r;
  int64_t k0 = 0;
  for (; k0 + kGradRows <= k; k0 += kGradRows) weight_grad_rows<kGradRows>(f, xs, dyw, k0, crr, dw);
  for (; k0 < k; ++k0) weight_grad_rows<1>(f, xs, dyw, k0, crr, dw);
}

// dxs[c0.., plane] += at each tap (i, j), shifted by i*wi + j, the sum over k of
// w[k][c][i][j] * dyw[k][t]: the adjoint of correlate_rows for R input channels at once.
template <int R>
void scatter_rows(const Frame& f, const float* dyw, const float* w, int64_t k, int64_t c0,
                  float* dxs) {
  const int64_t rr = f.r * f.r, crr = f.c * rr;
  for (int64_t t0 = 0; t0 < f.tpad; t0 += kPixelBlock)
    for (int64_t tap = 0; tap < rr; ++tap) {
      Vec acc[R][kVecs] = {};
      for (int64_t kk = 0; kk < k; ++kk) {
        Vec d[kVecs];
        for (int v = 0; v < kVecs; ++v) d[v] = load(dyw + kk * f.tpad + t0 + v * kLanes);
        const float* taps = w + kk * crr + c0 * rr + tap;
        for (int a = 0; a < R; ++a) {
          const Vec wv = splat(taps[a * rr]);
          for (int v = 0; v < kVecs; ++v) acc[a][v] += wv * d[v];
        }
      }
      const int64_t shift = f.tap_offset(tap) + t0;  // tap < r*r: in its own plane
      for (int a = 0; a < R; ++a)
        for (int v = 0; v < kVecs; ++v) {
          float* dst = dxs + (c0 + a) * f.plane() + shift + v * kLanes;
          store(dst, load(dst) + acc[a][v]);
        }
    }
}

// dxs (f.floats(), zeroed by the caller) += the input gradient of one sample, padded like its
// input frame, from dyw as weight_grad reads it. Writes past a plane's end land in the next
// plane's first pixels; they come from dyw's zero columns, and add nothing.
void scatter(const Frame& f, const float* dyw, const float* w, int64_t k, float* dxs) {
  int64_t c0 = 0;
  for (; c0 + kRows <= f.c; c0 += kRows) scatter_rows<kRows>(f, dyw, w, k, c0, dxs);
  for (; c0 < f.c; ++c0) scatter_rows<1>(f, dyw, w, k, c0, dxs);
}

}  // namespace

void direct_conv_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                         float* y, const ConvGeometry& g) {
  const Frame f(g.c, g.h + 2 * g.pad, g.w + 2 * g.pad, g.r);
  parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    Tensor xs = scratch(ctx, f.floats()), yw = scratch(ctx, g.k * f.tpad);
    for (int64_t n = n0; n < n1; ++n) {
      pad_into(x + n * g.c * g.hw(), g.h, g.w, g.pad, f, xs.f32());
      correlate(f, xs.f32(), w, g.k, yw.f32());
      float* yn = y + n * g.k * g.pq();
      for (int64_t kk = 0; kk < g.k; ++kk)
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const float* src = yw.f32() + kk * f.tpad + oy * f.wi;
          float* dst = yn + (kk * g.p + oy) * g.q;
          for (int64_t ox = 0; ox < g.q; ++ox) dst[ox] = b ? src[ox] + b[kk] : src[ox];
        }
    }
  });
}

void direct_conv_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, const ConvGeometry& g) {
  const Frame f(g.c, g.h + 2 * g.pad, g.w + 2 * g.pad, g.r);
  for_weight_chunks(ctx, g.n, g.k * g.crr(), dw, [&](int64_t first, int64_t last, float* pc) {
    Tensor xs = scratch(ctx, f.floats()), dyw = scratch(ctx, g.k * f.tpad);
    Tensor dxs = scratch(ctx, dx ? f.floats() : 0);
    // dy's rows at their wide places; the columns ox >= q and the tail stay zero.
    std::fill(dyw.f32(), dyw.f32() + g.k * f.tpad, 0.f);
    for (int64_t n = first; n < last; ++n) {
      const float* dyn = dy + n * g.k * g.pq();
      copy_planes(dyn, {g.pq(), g.q}, dyw.f32(), {f.tpad, f.wi}, g.k, g.p, g.q);
      pad_into(x + n * g.c * g.hw(), g.h, g.w, g.pad, f, xs.f32());
      weight_grad(f, xs.f32(), dyw.f32(), g.k, pc);
      if (!dx) continue;
      std::fill(dxs.f32(), dxs.f32() + f.floats(), 0.f);
      scatter(f, dyw.f32(), w, g.k, dxs.f32());
      copy_planes(dxs.f32() + g.pad * f.wi + g.pad, {f.plane(), f.wi}, dx + n * g.c * g.hw(),
                  {g.hw(), g.w}, g.c, g.h, g.w);
    }
  });
}

#else  // builds without AVX-512 never take the direct path (direct_conv_pays)

void direct_conv_forward(DeviceContext&, const float*, const float*, const float*, float*,
                         const ConvGeometry&) {
  REPLICA_CHECK(false, "the direct convolution is not in builds without AVX-512");
}

void direct_conv_backward(DeviceContext&, const float*, const float*, const float*, float*,
                          float*, const ConvGeometry&) {
  REPLICA_CHECK(false, "the direct convolution is not in builds without AVX-512");
}

#endif

}  // namespace replica::cpu
