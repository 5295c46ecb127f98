#include "engine/cpu/direct_conv.h"

#include <algorithm>
#include <cstring>

#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/vec16.h"
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
constexpr int kVecs = 4, kGradRows = 4, kRows = 5, kGradTaps = kLanes / kGradRows;
constexpr int64_t kPixelBlock = int64_t(kLanes) * kVecs;
// The weight gradient's samples a pass (Group): each block of sums then runs over 4 samples'
// pixels before its lanes are added, so adding lanes and storing them costs a quarter as
// much. The CNN's second layer at batch 64: 2 samples a pass 1.11x the weight gradient of 1, 4
// 1.18x; 8 ran the input gradient slower (the frames outgrow the caches).
constexpr int64_t kGroupSamples = 4;

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

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
// kernel, in the wide index: output pixel t = oy*wi + ox for t < (p-1)*wi + q. The forward
// computes it in blocks of kPixelBlock up to `tpad`, the weight gradient in vectors up to
// `dy_end` (<= tpad). Reads reach tpad - t floats past the last plane: the buffer a frame is
// copied into holds them as zeros.
struct Frame {
  int64_t c, hi, wi, r, p, q, t, tpad;
  Frame(int64_t c_, int64_t hi_, int64_t wi_, int64_t r_)
      : c(c_), hi(hi_), wi(wi_), r(r_), p(hi_ - r_ + 1), q(wi_ - r_ + 1) {
    t = (p - 1) * wi + q;
    tpad = round_up(t, kPixelBlock);
  }
  int64_t plane() const { return hi * wi; }
  int64_t floats() const { return c * plane() + tpad - t; }
  // Where the weight gradient's dot products stop: dy's last vector (dy is zero past t).
  int64_t dy_end() const { return round_up(t, kLanes); }
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

// One correlation of a kernel with wide rows, as the forward and the input gradient both run
// it: `length` wide pixels (whole blocks of kPixelBlock) of each output plane (out_stride
// floats apart), from `ins` input planes (in_stride apart). Tap (i, j) reads the input at the
// pixel + i*row_step + j*col_step and weighs it by w[o*w_out + cc*w_in + i*r + j] for output o
// and input plane cc.
struct Correlation {
  int64_t ins, r, in_stride, row_step, col_step, w_in, w_out, length, out_stride;
};

// The output planes o0.. (R at a time) of a correlation.
template <int R>
void correlate_rows(const Correlation& cr, const float* in, const float* w, int64_t o0,
                    float* out) {
  for (int64_t t0 = 0; t0 < cr.length; t0 += kPixelBlock) {
    Vec acc[R][kVecs] = {};
    for (int64_t cc = 0; cc < cr.ins; ++cc)
      for (int64_t i = 0; i < cr.r; ++i) {
        const float* run = in + cc * cr.in_stride + i * cr.row_step + t0;
        const float* taps = w + o0 * cr.w_out + cc * cr.w_in + i * cr.r;
        for (int64_t j = 0; j < cr.r; ++j) {
          Vec xv[kVecs];
          for (int v = 0; v < kVecs; ++v) xv[v] = load(run + j * cr.col_step + v * kLanes);
          for (int a = 0; a < R; ++a) {
            const Vec wv = splat(taps[a * cr.w_out + j]);
            for (int v = 0; v < kVecs; ++v) acc[a][v] += wv * xv[v];
          }
        }
      }
    for (int a = 0; a < R; ++a)
      for (int v = 0; v < kVecs; ++v)
        store(out + (o0 + a) * cr.out_stride + t0 + v * kLanes, acc[a][v]);
  }
}

// Output planes 0..outs of a correlation. Each sum runs over (cc, i, j) in order whatever the
// block, so every output has the same bits.
void correlate(const Correlation& cr, const float* in, const float* w, int64_t outs, float* out) {
  int64_t o0 = 0;
  for (; o0 + kRows <= outs; o0 += kRows) correlate_rows<kRows>(cr, in, w, o0, out);
  for (; o0 < outs; ++o0) correlate_rows<1>(cr, in, w, o0, out);
}

// The forward: yw[k, tpad] = the correlation of the frame xs with w[k][c][r][r].
Correlation forward_correlation(const Frame& f) {
  const int64_t rr = f.r * f.r;
  return {f.c, f.r, f.plane(), f.wi, 1, rr, f.c * rr, f.tpad, f.tpad};
}

// dy of one sample as both halves of the backward read it: channel kk's wide rows (zero in the
// columns ox >= q) from kk*stride + lead. Zeros lie around each plane, so that the input
// gradient's taps read zeros wherever they reach outside dy: `lead` before it (taps above the
// first row), and after it up to the input gradient's last block, or the weight gradient's
// last vector (Frame::dy_end), whichever is further.
struct GradFrame {
  int64_t lead, stride;
  // The input gradient's wide pixels: `length` of them (whole blocks) from frame pixel
  // `start`, where the unpadded input's first row begins.
  int64_t start, length;
  GradFrame(const Frame& f, int64_t h, int64_t pad)
      : lead(round_up((f.r - 1) * (f.wi + 1), kLanes)),
        start(pad * f.wi),
        length(round_up(h * f.wi, kPixelBlock)) {
    stride = round_up(lead + std::max(start + length, f.dy_end()), kLanes);
  }
};

// The input gradient, gathered: frame pixel u (rows pad.. of the padded input, wide) sums
// w[kk][c][i][j] * dy[kk] at u - i*wi - j over (kk, i, j), the pixels whose tap (i, j) read u in
// the forward; a forward-style correlation of dy with the kernel turned round: rows stepped
// up, columns left, and the weights' two channel axes swapped (its outputs are the input
// channels, r*r floats apart in w; its inputs the output channels, c*r*r apart). dxw[c, length]
// from dyg (the GradFrame's buffer), with no adds to memory and every sum in one order.
Correlation input_grad_correlation(const Frame& f, const GradFrame& d, int64_t k) {
  const int64_t rr = f.r * f.r;
  return {k, f.r, d.stride, -f.wi, -1, f.c * rr, rr, d.length, d.length};
}

// A few samples' frames side by side, whose weight gradients are summed in one pass: each
// block of sums then runs over every pixel of the group before its lanes are added and stored.
struct Group {
  int64_t count;              // samples
  int64_t x_stride, dy_stride;  // from one sample's input frame to the next's, and dy's
};

// dw[k0.., tap0..] += sum over the group's samples and pixels t of dy[k][t] *
// xs[t + tap_offset(tap)], R channels by T taps at once; dy's planes `ds` floats apart.
// Not inlined: inside the chunk's loop GCC ran out of registers for the pointers and spilled
// one to the stack in the innermost loop (this alone: the weight gradient 1.06x).
template <int R, int T>
[[gnu::noinline]] void weight_grad_block(const Frame& f, const Group& gr, const float* xs,
                                         const float* dy, int64_t ds, int64_t k0, int64_t tap0,
                                         int64_t crr, float* dw) {
  Vec acc[R * T] = {};
  for (int64_t s = 0; s < gr.count; ++s) {
    const float* run[T];
    for (int b = 0; b < T; ++b) run[b] = xs + s * gr.x_stride + f.tap_offset(tap0 + b);
    const float* dys = dy + s * gr.dy_stride + k0 * ds;
    for (int64_t t = 0; t < f.dy_end(); t += kLanes) {
      Vec d[R];
      for (int a = 0; a < R; ++a) d[a] = load_held(dys + a * ds + t);
      for (int b = 0; b < T; ++b) {
        const Vec xv = load_held(run[b] + t);
        for (int a = 0; a < R; ++a) acc[a * T + b] += d[a] * xv;
      }
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
void weight_grad_rows(const Frame& f, const Group& gr, const float* xs, const float* dy,
                      int64_t ds, int64_t k0, int64_t crr, float* dw) {
  int64_t tap = 0;
  for (; tap + kGradTaps <= crr; tap += kGradTaps)
    weight_grad_block<R, kGradTaps>(f, gr, xs, dy, ds, k0, tap, crr, dw);
  for (; tap < crr; ++tap) weight_grad_block<R, 1>(f, gr, xs, dy, ds, k0, tap, crr, dw);
}

// dw[k, c*r*r] += the weight gradient of a group of samples: xs their input frames, dyg their
// output gradients as the GradFrame d lays them out (zero in the columns ox >= q and past t).
void weight_grad(const Frame& f, const GradFrame& d, const Group& gr, const float* xs,
                 const float* dyg, int64_t k, float* dw) {
  const int64_t crr = f.c * f.r * f.r;
  const float* dy = dyg + d.lead;
  int64_t k0 = 0;
  for (; k0 + kGradRows <= k; k0 += kGradRows)
    weight_grad_rows<kGradRows>(f, gr, xs, dy, d.stride, k0, crr, dw);
  for (; k0 < k; ++k0) weight_grad_rows<1>(f, gr, xs, dy, d.stride, k0, crr, dw);
}

}  // namespace

void direct_conv_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                         float* y, const ConvGeometry& g) {
  const Frame f(g.c, g.h + 2 * g.pad, g.w + 2 * g.pad, g.r);
  const Correlation forward = forward_correlation(f);
  parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    Tensor xs = scratch(ctx, f.floats()), yw = scratch(ctx, g.k * f.tpad);
    for (int64_t n = n0; n < n1; ++n) {
      pad_into(x + n * g.c * g.hw(), g.h, g.w, g.pad, f, xs.f32());
      correlate(forward, xs.f32(), w, g.k, yw.f32());
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
  const GradFrame d(f, g.h, g.pad);
  const Correlation input_grad = input_grad_correlation(f, d, g.k);
  const int64_t x_stride = round_up(f.floats(), kLanes), dy_stride = g.k * d.stride;
  for_weight_chunks(ctx, g.n, g.k * g.crr(), dw, [&](int64_t first, int64_t last, float* pc) {
    const int64_t most = std::min(kGroupSamples, last - first);
    Tensor xs = scratch(ctx, most * x_stride), dyg = scratch(ctx, most * dy_stride);
    Tensor dxw = scratch(ctx, dx ? g.c * d.length : 0);
    // dy's rows at their wide places; the columns ox >= q and the zeros around them stay zero.
    std::fill(dyg.f32(), dyg.f32() + most * dy_stride, 0.f);
    for (int64_t n0 = first; n0 < last; n0 += most) {
      const Group gr{std::min(most, last - n0), x_stride, dy_stride};
      for (int64_t s = 0; s < gr.count; ++s) {
        const int64_t n = n0 + s;
        copy_planes(dy + n * g.k * g.pq(), {g.pq(), g.q}, dyg.f32() + s * dy_stride + d.lead,
                    {d.stride, f.wi}, g.k, g.p, g.q);
        pad_into(x + n * g.c * g.hw(), g.h, g.w, g.pad, f, xs.f32() + s * x_stride);
      }
      weight_grad(f, d, gr, xs.f32(), dyg.f32(), g.k, pc);
      if (!dx) continue;
      for (int64_t s = 0; s < gr.count; ++s) {
        correlate(input_grad, dyg.f32() + s * dy_stride + d.lead + d.start, w, g.c, dxw.f32());
        copy_planes(dxw.f32() + g.pad, {d.length, f.wi}, dx + (n0 + s) * g.c * g.hw(),
                    {g.hw(), g.w}, g.c, g.h, g.w);
      }
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
