#include "engine/cpu/channel_sums.h"

#include <algorithm>

#include "engine/error.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace replica::cpu {

#if defined(__AVX512F__)

bool channel_sums_built() { return true; }

namespace {
constexpr int kChannelLanes = 8;
constexpr int64_t kMaxPositions = 4;
}  // namespace

// Planes of up to 4 positions: 8 channels' rows are at most 32 floats, two vectors, from which
// one permute picks a position of every channel. On larger planes the rows outgrow the two
// vectors, and gathers (measured: 8 floats from 8 planes a gather) ran no faster than the
// element-wise loops.
bool channel_sums_take(const NchwDims& d) { return d.hw >= 1 && d.hw <= kMaxPositions; }

namespace {

typedef double Doubles __attribute__((vector_size(kChannelLanes * sizeof(double))));

// 8 channels' rows of one sample: their 8 * hw floats, in two vectors.
struct Rows {
  __m512 lo, hi;
};

// Up to 8 consecutive channels (lanes past `count` read nothing, hold 0 and are not stored).
struct ChannelGroup {
  int64_t first, hw;
  __mmask8 lanes;
  __mmask16 lo, hi;
  __m512i pick[kMaxPositions];  // position p of every channel: p, p + hw, p + 2 hw, ...
  ChannelGroup(int64_t c, int64_t count, int64_t hw_) : first(c), hw(hw_) {
    lanes = __mmask8((1u << count) - 1);
    const int64_t floats = count * hw;
    lo = __mmask16((1u << std::min<int64_t>(floats, 16)) - 1);
    hi = __mmask16((1u << std::max<int64_t>(floats - 16, 0)) - 1);
    const __m512i channel = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i row_start = _mm512_mullo_epi32(channel, _mm512_set1_epi32(int(hw)));
    for (int64_t p = 0; p < hw; ++p)
      pick[p] = _mm512_add_epi32(row_start, _mm512_set1_epi32(int(p)));
  }
  Rows rows(const float* at) const {
    return {_mm512_maskz_loadu_ps(lo, at), _mm512_maskz_loadu_ps(hi, at + 16)};
  }
  // Position p of the 8 channels, widened to double. (The zero-masked forms of the extract and
  // the conversion, with every lane kept: GCC 12's plain forms warn of an undefined operand.)
  Doubles position(const Rows& r, int64_t p) const {
    const __m512 picked = _mm512_permutex2var_ps(r.lo, pick[p], r.hi);
    const __m256 low = __m256(_mm512_maskz_extractf64x4_pd(0xF, __m512d(picked), 0));
    return Doubles(_mm512_maskz_cvtps_pd(0xFF, low));
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

// body.begin(group), body.sample(group, at) for every sample in order, body.end(group), for the
// groups of channels [c0, c1); `at` is the offset of the group's first row in the sample.
template <class Body>
void for_each_sample(const NchwDims& d, int64_t c0, int64_t c1, Body&& body) {
  for (int64_t c = c0; c < c1; c += kChannelLanes) {
    const ChannelGroup group(c, std::min<int64_t>(kChannelLanes, c1 - c), d.hw);
    body.begin(group);
    for (int64_t n = 0; n < d.n; ++n) body.sample(group, (n * d.c + c) * d.hw);
    body.end(group);
  }
}

}  // namespace

void channel_sum(const float* x, const NchwDims& d, int64_t c0, int64_t c1, double* sum) {
  struct {
    const float* x;
    double* sum;
    Doubles s;
    void begin(const ChannelGroup&) { s = Doubles{}; }
    void sample(const ChannelGroup& g, int64_t at) {
      const Rows r = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) s += g.position(r, p);
    }
    void end(const ChannelGroup& g) { g.store(sum, s); }
  } body{x, sum, {}};
  for_each_sample(d, c0, c1, body);
}

void channel_sum_sq_dev(const float* x, const NchwDims& d, int64_t c0, int64_t c1,
                        const double* mean, double* sq) {
  struct {
    const float* x;
    const double* mean;
    double* sq;
    Doubles mu, s;
    void begin(const ChannelGroup& g) {
      mu = g.load(mean);
      s = Doubles{};
    }
    void sample(const ChannelGroup& g, int64_t at) {
      const Rows r = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) {
        const Doubles dev = g.position(r, p) - mu;
        s += dev * dev;
      }
    }
    void end(const ChannelGroup& g) { g.store(sq, s); }
  } body{x, mean, sq, {}, {}};
  for_each_sample(d, c0, c1, body);
}

void channel_grad_sums(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                       int64_t c0, int64_t c1, const float* mean, const float* invstd,
                       double* sum_dy, double* sum_dy_xhat) {
  struct {
    const float *x, *dy, *relu_y;
    const float *mean, *invstd;
    double *sum_dy, *sum_dy_xhat;
    Doubles mu, is, s_dy, s_dy_xhat;
    void begin(const ChannelGroup& g) {
      mu = g.load(mean);
      is = g.load(invstd);
      s_dy = s_dy_xhat = Doubles{};
    }
    void sample(const ChannelGroup& g, int64_t at) {
      Rows gr = g.rows(dy + at);
      if (relu_y) {  // dy where relu_y > 0, +0 elsewhere (NaN too)
        const Rows ry = g.rows(relu_y + at);
        const __m512 zero = _mm512_setzero_ps();
        gr.lo = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ry.lo, zero, _CMP_GT_OQ), gr.lo);
        gr.hi = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ry.hi, zero, _CMP_GT_OQ), gr.hi);
      }
      const Rows xr = g.rows(x + at);
      for (int64_t p = 0; p < g.hw; ++p) {
        const Doubles gd = g.position(gr, p);
        s_dy += gd;
        s_dy_xhat += gd * (g.position(xr, p) - mu) * is;
      }
    }
    void end(const ChannelGroup& g) {
      g.store(sum_dy, s_dy);
      g.store(sum_dy_xhat, s_dy_xhat);
    }
  } body{x, dy, relu_y, mean, invstd, sum_dy, sum_dy_xhat, {}, {}, {}, {}};
  for_each_sample(d, c0, c1, body);
}

#else  // builds without AVX-512 sum element by element (engine/cpu/norm.cpp)

bool channel_sums_built() { return false; }
bool channel_sums_take(const NchwDims&) { return false; }

void channel_sum(const float*, const NchwDims&, int64_t, int64_t, double*) {
  REPLICA_CHECK(false, "batch norm's sums in lanes are not in builds without AVX-512");
}
void channel_sum_sq_dev(const float*, const NchwDims&, int64_t, int64_t, const double*,
                        double*) {
  REPLICA_CHECK(false, "batch norm's sums in lanes are not in builds without AVX-512");
}
void channel_grad_sums(const float*, const float*, const float*, const NchwDims&, int64_t,
                       int64_t, const float*, const float*, double*, double*) {
  REPLICA_CHECK(false, "batch norm's sums in lanes are not in builds without AVX-512");
}

#endif

}  // namespace replica::cpu
