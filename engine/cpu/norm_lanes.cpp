#include "engine/cpu/norm_lanes.h"

#include <algorithm>

#include "engine/cpu/vec16.h"
#include "engine/error.h"

namespace replica::cpu {

#if defined(__AVX512F__)

namespace {

// On planes of more than 4 positions 8 channels' rows outgrow two vectors. Gathers (8 floats
// from 8 planes each) took them there, and ran no faster than the element-wise loops.
constexpr int kChannelLanes = 8;
constexpr int64_t kMaxPositions = 4;

typedef double Doubles __attribute__((vector_size(kChannelLanes * sizeof(double))));

Doubles every_lane(double v) { return v - Doubles{}; }

// 8 channels' rows of one sample: their 8 * hw floats, in two vectors.
using Rows = VecPair;

// v where test passes a ReLU (not <= 0, NaN included), +0 elsewhere: relu_passes and
// relu_value (engine/ops.h) on 16 lanes.
Vec relu_keep(Vec test, Vec v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(test, _mm512_setzero_ps(), _CMP_NLE_UQ), v);
}

// [a | b].
Vec join(__m256 a, __m256 b) {
  const __m512d low = _mm512_maskz_insertf64x4(0xFF, _mm512_setzero_pd(), __m256d(a), 0);
  return __m512(_mm512_maskz_insertf64x4(0xFF, low, __m256d(b), 1));
}

// Index vectors over the 32 floats of two vectors (a's 0-15, then b's).
__m512i indices(int (*of)(int j, int hw), int first, int hw) {
  alignas(64) int at[16];
  for (int j = 0; j < 16; ++j) at[j] = of(first + j, hw);
  return _mm512_load_si512(at);
}

// The permutes between 8 channels' rows and their positions, for one plane size (hw <= 4).
struct PositionTables {
  __m512i pick[kMaxPositions];  // position p of every channel: rows' floats p, p + hw, ...
  __m512i unpick_lo, unpick_hi;  // rows' floats back from [position 0 | 1], [2 | 3]
  __m512i spread_lo, spread_hi;  // rows' floats from one value per channel
  explicit PositionTables(int hw) {
    const __m512i row_start = indices([](int j, int hw) { return j < 8 ? j * hw : 0; }, 0, hw);
    for (int p = 0; p < hw; ++p) pick[p] = _mm512_add_epi32(row_start, _mm512_set1_epi32(p));
    // Float j of the rows is channel j / hw's position j % hw, lane j / hw of the position's
    // vector, which the two vectors hold at 8 * position + lane.
    auto unpick = [](int j, int hw) { return j % hw * 8 + j / hw; };
    unpick_lo = indices(unpick, 0, hw);
    unpick_hi = indices(unpick, 16, hw);
    auto spread = [](int j, int hw) { return j / hw; };
    spread_lo = indices(spread, 0, hw);
    spread_hi = indices(spread, 16, hw);
  }
};

// Up to 8 consecutive channels. Lanes past `count` read nothing, hold 0, and are not stored.
// (The zero-masked forms of the extract and the conversions, every lane kept: GCC 12's plain
// forms warn of an undefined operand.)
struct ChannelGroup {
  const PositionTables& tables;
  int64_t first, hw, floats;  // floats: the rows' 8 * hw, fewer in a part-filled group
  __mmask8 lanes;
  ChannelGroup(const PositionTables& t, int64_t c, int64_t count, int64_t hw_)
      : tables(t), first(c), hw(hw_), floats(count * hw_), lanes(__mmask8((1u << count) - 1)) {}
  Rows rows(const float* at) const { return load_floats(at, floats); }
  void store(float* at, const Rows& r) const { store_floats(at, floats, r); }
  // Position p of the 8 channels, widened to double.
  Doubles position(const Rows& r, int64_t p) const {
    const __m512 picked = _mm512_permutex2var_ps(r.lo, tables.pick[p], r.hi);
    const __m256 low = __m256(_mm512_maskz_extractf64x4_pd(0xF, __m512d(picked), 0));
    return Doubles(_mm512_maskz_cvtps_pd(0xFF, low));
  }
  // Rows from the positions' values (narrowed to float), the inverse of position().
  Rows unpositions(const Doubles* at) const {
    __m256 f[kMaxPositions] = {};
    for (int64_t p = 0; p < hw; ++p) f[p] = _mm512_maskz_cvtpd_ps(0xFF, __m512d(at[p]));
    const Vec a = join(f[0], f[1]), b = join(f[2], f[3]);
    return {_mm512_permutex2var_ps(a, tables.unpick_lo, b),
            _mm512_permutex2var_ps(a, tables.unpick_hi, b)};
  }
  // Rows holding each channel's value at every position.
  Rows spread(const double* per_channel) const {
    const __m512d v = _mm512_maskz_loadu_pd(lanes, per_channel + first);
    const Vec f = join(_mm512_maskz_cvtpd_ps(0xFF, v), _mm256_setzero_ps());
    return {_mm512_maskz_permutexvar_ps(0xFFFF, tables.spread_lo, f),
            _mm512_maskz_permutexvar_ps(0xFFFF, tables.spread_hi, f)};
  }
  Doubles load(const double* per_channel) const {
    return Doubles(_mm512_maskz_loadu_pd(lanes, per_channel + first));
  }
  Doubles load(const float* per_channel) const {
    const __m256 v = _mm256_maskz_loadu_ps(lanes, per_channel + first);
    return Doubles(_mm512_maskz_cvtps_pd(0xFF, v));
  }
  void store(double* per_channel, Doubles v) const {
    _mm512_mask_storeu_pd(per_channel + first, lanes, __m512d(v));
  }
};

// dy's rows, or with relu_y dy where relu_y is not <= 0 and +0 elsewhere.
Rows grad_rows(const ChannelGroup& g, const float* dy, const float* relu_y, int64_t at) {
  Rows r = g.rows(dy + at);
  if (relu_y) {
    const Rows ry = g.rows(relu_y + at);
    r = {relu_keep(ry.lo, r.lo), relu_keep(ry.hi, r.hi)};
  }
  return r;
}

// Channel groups a pass holds at once. Their rows of a sample lie side by side (8 groups of 2x2
// planes: 1 KB), so a pass reads a block of the tensor in address order. A group at a time, its
// samples' rows lie a channel stride apart (16 KB at 1024 channels), one load each that the
// prefetchers do not follow, each a wait on memory. 8 timed faster than 4, 16, 32 and 64
// (bench/results/2026-11-29-cpu-batch-norm-short-rows.md).
constexpr int64_t kBlockGroups = 8;

// body.begin(i, group), body.sample(i, group, at) for every sample in order, body.end(i, group),
// for the groups of channels [c0, c1), kBlockGroups at a time: i is the group's place in its
// block (its state's), `at` the offset of its first row in the sample. Each group still meets
// the samples in order, so its sums take the same adds in the same order.
template <class Body>
void for_each_sample(const NchwDims& d, int64_t c0, int64_t c1, Body&& body) {
  const PositionTables tables(int(d.hw));
  for (int64_t b0 = c0; b0 < c1; b0 += kBlockGroups * kChannelLanes) {
    const int64_t b1 = std::min(c1, b0 + kBlockGroups * kChannelLanes);
    const int64_t groups = (b1 - b0 + kChannelLanes - 1) / kChannelLanes;
    auto group = [&](int64_t i) {
      const int64_t c = b0 + i * kChannelLanes;
      return ChannelGroup(tables, c, std::min<int64_t>(kChannelLanes, b1 - c), d.hw);
    };
    for (int64_t i = 0; i < groups; ++i) body.begin(i, group(i));
    for (int64_t n = 0; n < d.n; ++n)
      for (int64_t i = 0; i < groups; ++i)
        body.sample(i, group(i), (n * d.c + b0 + i * kChannelLanes) * d.hw);
    for (int64_t i = 0; i < groups; ++i) body.end(i, group(i));
  }
}

}  // namespace

bool norm_lanes_take(const NchwDims& d) { return d.hw >= 1 && d.hw <= kMaxPositions; }

void channel_sum(const float* x, const NchwDims& d, int64_t c0, int64_t c1, double* sum) {
  struct {
    const float* x;
    double* sum;
    Doubles s[kBlockGroups];
    void begin(int64_t i, const ChannelGroup&) { s[i] = Doubles{}; }
    void sample(int64_t i, const ChannelGroup& g, int64_t at) {
      const Rows r = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) s[i] += g.position(r, p);
    }
    void end(int64_t i, const ChannelGroup& g) { g.store(sum, s[i]); }
  } body{x, sum, {}};
  for_each_sample(d, c0, c1, body);
}

void channel_sum_sq_dev(const float* x, const NchwDims& d, int64_t c0, int64_t c1,
                        const double* mean, double* sq) {
  struct {
    const float* x;
    const double* mean;
    double* sq;
    Doubles mu[kBlockGroups], s[kBlockGroups];
    void begin(int64_t i, const ChannelGroup& g) {
      mu[i] = g.load(mean);
      s[i] = Doubles{};
    }
    void sample(int64_t i, const ChannelGroup& g, int64_t at) {
      const Rows r = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) {
        const Doubles dev = g.position(r, p) - mu[i];
        s[i] += dev * dev;
      }
    }
    void end(int64_t i, const ChannelGroup& g) { g.store(sq, s[i]); }
  } body{x, mean, sq, {}, {}};
  for_each_sample(d, c0, c1, body);
}

// Elementwise in float, so the rows need no permute: each channel's constants are spread
// across its positions instead.
void channel_scale_shift(const float* x, const float* residual, float* y, const NchwDims& d,
                         int64_t c0, int64_t c1, const double* scale, const double* shift,
                         bool relu) {
  struct {
    const float *x, *residual;
    float* y;
    const double *scale, *shift;
    bool relu;
    Rows sc[kBlockGroups], sh[kBlockGroups];
    void begin(int64_t i, const ChannelGroup& g) {
      sc[i] = g.spread(scale);
      sh[i] = g.spread(shift);
    }
    void sample(int64_t i, const ChannelGroup& g, int64_t at) {
      const Rows r = g.rows(x + at);
      Rows v = {r.lo * sc[i].lo + sh[i].lo, r.hi * sc[i].hi + sh[i].hi};
      if (residual) {
        const Rows res = g.rows(residual + at);
        v = {v.lo + res.lo, v.hi + res.hi};
      }
      if (relu) v = {relu_keep(v.lo, v.lo), relu_keep(v.hi, v.hi)};
      g.store(y + at, v);
    }
    void end(int64_t, const ChannelGroup&) {}
  } body{x, residual, y, scale, shift, relu, {}, {}};
  for_each_sample(d, c0, c1, body);
}

void channel_grad_sums(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                       int64_t c0, int64_t c1, const float* mean, const float* invstd,
                       double* sum_dy, double* sum_dy_xhat) {
  struct {
    const float *x, *dy, *relu_y;
    const float *mean, *invstd;
    double *sum_dy, *sum_dy_xhat;
    Doubles mu[kBlockGroups], is[kBlockGroups], s_dy[kBlockGroups], s_dy_xhat[kBlockGroups];
    void begin(int64_t i, const ChannelGroup& g) {
      mu[i] = g.load(mean);
      is[i] = g.load(invstd);
      s_dy[i] = s_dy_xhat[i] = Doubles{};
    }
    void sample(int64_t i, const ChannelGroup& g, int64_t at) {
      const Rows gr = grad_rows(g, dy, relu_y, at), xr = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) {
        const Doubles gd = g.position(gr, p);
        s_dy[i] += gd;
        s_dy_xhat[i] += gd * (g.position(xr, p) - mu[i]) * is[i];
      }
    }
    void end(int64_t i, const ChannelGroup& g) {
      g.store(sum_dy, s_dy[i]);
      g.store(sum_dy_xhat, s_dy_xhat[i]);
    }
  } body{x, dy, relu_y, mean, invstd, sum_dy, sum_dy_xhat, {}, {}, {}, {}};
  for_each_sample(d, c0, c1, body);
}

void channel_input_grad(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                        int64_t c0, int64_t c1, const float* mean, const float* invstd,
                        const float* gamma, const double* sum_dy, const double* sum_dy_xhat,
                        float* dx) {
  struct {
    const float *x, *dy, *relu_y;
    const float *mean, *invstd, *gamma;
    const double *sum_dy, *sum_dy_xhat;
    float* dx;
    Doubles m, mu[kBlockGroups], is[kBlockGroups], k[kBlockGroups], s_dy[kBlockGroups],
        s_dy_xhat[kBlockGroups];
    void begin(int64_t i, const ChannelGroup& g) {
      mu[i] = g.load(mean);
      is[i] = g.load(invstd);
      k[i] = g.load(gamma) * is[i] / m;
      s_dy[i] = g.load(sum_dy);
      s_dy_xhat[i] = g.load(sum_dy_xhat);
    }
    void sample(int64_t i, const ChannelGroup& g, int64_t at) {
      const Rows gr = grad_rows(g, dy, relu_y, at), xr = g.rows(x + at);
      Doubles out[kMaxPositions];
      for (int64_t p = 0; p < g.hw; ++p) {
        const Doubles xhat = (g.position(xr, p) - mu[i]) * is[i];
        out[p] = k[i] * (m * g.position(gr, p) - s_dy[i] - xhat * s_dy_xhat[i]);
      }
      g.store(dx + at, g.unpositions(out));
    }
    void end(int64_t, const ChannelGroup&) {}
  } body{x, dy, relu_y, mean, invstd, gamma, sum_dy, sum_dy_xhat, dx,
         every_lane(double(d.n * d.hw)), {}, {}, {}, {}, {}};
  for_each_sample(d, c0, c1, body);
}

#else  // builds without AVX-512 run the element-wise loops (norm_lanes_take)

bool norm_lanes_take(const NchwDims&) { return false; }

namespace {
[[noreturn]] void not_built() {
  throw Error("batch norm in lanes is not in builds without AVX-512");
}
}  // namespace

void channel_sum(const float*, const NchwDims&, int64_t, int64_t, double*) { not_built(); }
void channel_sum_sq_dev(const float*, const NchwDims&, int64_t, int64_t, const double*,
                        double*) {
  not_built();
}
void channel_scale_shift(const float*, const float*, float*, const NchwDims&, int64_t, int64_t,
                         const double*, const double*, bool) {
  not_built();
}
void channel_grad_sums(const float*, const float*, const float*, const NchwDims&, int64_t,
                       int64_t, const float*, const float*, double*, double*) {
  not_built();
}
void channel_input_grad(const float*, const float*, const float*, const NchwDims&, int64_t,
                        int64_t, const float*, const float*, const float*, const double*,
                        const double*, float*) {
  not_built();
}

#endif

}  // namespace replica::cpu
