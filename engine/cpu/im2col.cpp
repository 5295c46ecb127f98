#include "engine/cpu/im2col.h"

#include <algorithm>
#include <cstring>

#include "engine/error.h"

namespace replica::cpu {

namespace {

// Outputs below this many pixels read through the tap table (r*r*pq entries: 2.3 KB for a 3x3
// kernel, small enough to stay in L1 while every channel reuses it). ResNet-101 at 28x28 spent
// 10% of its step in the element loops below, most of it on 7x7 to 1x1 outputs, where a row is
// too short for runs and the loop's bounds checks cost more than the copies.
constexpr int64_t kTapsPq = 64;

// Stride 1: the output columns [lo, hi) of kernel column j whose source column ox - pad + j lies
// inside the input; the others read padding.
struct ColumnRange {
  int64_t lo, hi;
};
ColumnRange valid_columns(const ConvGeometry& g, int64_t j) {
  const int64_t lo = std::min(g.q, std::max<int64_t>(0, g.pad - j));
  const int64_t hi = std::min(g.q, g.w + g.pad - j);
  return {lo, std::max(lo, hi)};
}

// Stride-1 rows of at least 8 output columns: each row a zero fill, a contiguous run and a zero
// fill, the run's bounds worked out once per kernel column. The CNN's convolutions (rows of 24
// and 8 columns) spent 40% of its step in the element loops before. Strided rows keep the
// element loops: their runs compile to gathers, which made ResNet-18's stride-2 stem 15% slower.
// Not inlined into im2col: inlined, it made the element loops of ResNet-18's convolutions 10%
// slower.
__attribute__((noinline)) void im2col_runs(const float* x, const ConvGeometry& g, float* cols,
                                           int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        float* out = cols + ((c * g.r + i) * g.r + j) * ld;
        const float* plane = x + c * g.h * g.w;
        const ColumnRange v = valid_columns(g, j);
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          float* __restrict row = out + oy * g.q;
          if (iy < 0 || iy >= g.h) {
            std::fill(row, row + g.q, 0.f);
            continue;
          }
          const float* __restrict src = plane + iy * g.w + v.lo - g.pad + j;
          for (int64_t ox = 0; ox < v.lo; ++ox) row[ox] = 0.f;
          for (int64_t k = 0; k < v.hi - v.lo; ++k) row[v.lo + k] = src[k];
          for (int64_t ox = v.hi; ox < g.q; ++ox) row[ox] = 0.f;
        }
      }
}

// col2im for the rows im2col_runs takes; dx is zeroed by the caller.
__attribute__((noinline)) void col2im_runs(const float* cols, const ConvGeometry& g, float* dx,
                                           int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        const float* in = cols + ((c * g.r + i) * g.r + j) * ld;
        float* plane = dx + c * g.h * g.w;
        const ColumnRange v = valid_columns(g, j);
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          if (iy < 0 || iy >= g.h) continue;
          float* __restrict dst = plane + iy * g.w + v.lo - g.pad + j;
          const float* __restrict src = in + oy * g.q + v.lo;
          for (int64_t k = 0; k < v.hi - v.lo; ++k) dst[k] += src[k];
        }
      }
}

void im2col_elements(const float* x, const ConvGeometry& g, float* cols, int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        float* out = cols + ((c * g.r + i) * g.r + j) * ld;
        const float* plane = x + c * g.h * g.w;
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          float* orow = out + oy * g.q;
          if (iy < 0 || iy >= g.h) {
            std::fill(orow, orow + g.q, 0.f);
            continue;
          }
          const float* irow = plane + iy * g.w;
          for (int64_t ox = 0; ox < g.q; ++ox) {
            const int64_t ix = ox * g.stride - g.pad + j;
            orow[ox] = (ix >= 0 && ix < g.w) ? irow[ix] : 0.f;
          }
        }
      }
}

// dx is zeroed by the caller.
void col2im_elements(const float* cols, const ConvGeometry& g, float* dx, int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        const float* in = cols + ((c * g.r + i) * g.r + j) * ld;
        float* plane = dx + c * g.h * g.w;
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          if (iy < 0 || iy >= g.h) continue;
          float* drow = plane + iy * g.w;
          const float* irow = in + oy * g.q;
          for (int64_t ox = 0; ox < g.q; ++ox) {
            const int64_t ix = ox * g.stride - g.pad + j;
            if (ix >= 0 && ix < g.w) drow[ix] += irow[ox];
          }
        }
      }
}

}  // namespace

ColumnLayout::ColumnLayout(const ConvGeometry& g) : g_(g) {
  if (g.pointwise())
    way_ = Way::Copy;
  else if (g.q >= 8 && g.stride == 1)
    way_ = Way::Runs;
  else if (g.pq() < kTapsPq)
    way_ = Way::Taps;
  else
    way_ = Way::Elements;
  if (way_ != Way::Taps) return;
  taps_.resize(g.r * g.r * g.pq());
  int32_t* t = taps_.data();
  for (int64_t i = 0; i < g.r; ++i)
    for (int64_t j = 0; j < g.r; ++j)
      for (int64_t oy = 0; oy < g.p; ++oy)
        for (int64_t ox = 0; ox < g.q; ++ox) {
          const int64_t iy = oy * g.stride - g.pad + i, ix = ox * g.stride - g.pad + j;
          *t++ = (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) ? int32_t(iy * g.w + ix) : -1;
        }
}

void ColumnLayout::im2col(const float* x, float* cols, int64_t ld) const {
  const int64_t plane = g_.h * g_.w, pq = g_.pq(), rr = g_.r * g_.r;
  switch (way_) {
    case Way::Copy:
      for (int64_t c = 0; c < g_.c; ++c)
        std::memcpy(cols + c * ld, x + c * plane, pq * sizeof(float));
      return;
    case Way::Runs: return im2col_runs(x, g_, cols, ld);
    case Way::Elements: return im2col_elements(x, g_, cols, ld);
    case Way::Taps:
      for (int64_t c = 0; c < g_.c; ++c) {
        const float* src = x + c * plane;
        for (int64_t tap = 0; tap < rr; ++tap) {
          const int32_t* from = taps_.data() + tap * pq;
          float* out = cols + (c * rr + tap) * ld;
          for (int64_t o = 0; o < pq; ++o) out[o] = from[o] >= 0 ? src[from[o]] : 0.f;
        }
      }
      return;
  }
}

void ColumnLayout::col2im(const float* cols, float* dx, int64_t ld) const {
  const int64_t plane = g_.h * g_.w, pq = g_.pq(), rr = g_.r * g_.r;
  if (way_ == Way::Copy) {
    // 0 + v, as the sum into a zeroed pixel gives it (a -0 column entry lands as +0).
    for (int64_t c = 0; c < g_.c; ++c) {
      const float* in = cols + c * ld;
      float* out = dx + c * plane;
      for (int64_t o = 0; o < pq; ++o) out[o] = 0.f + in[o];
    }
    return;
  }
  std::fill(dx, dx + g_.c * plane, 0.f);
  switch (way_) {
    case Way::Copy: return;
    case Way::Runs: return col2im_runs(cols, g_, dx, ld);
    case Way::Elements: return col2im_elements(cols, g_, dx, ld);
    case Way::Taps:
      // Channel, tap, pixel: the element loops' order, so each pixel sums in the same order.
      for (int64_t c = 0; c < g_.c; ++c) {
        float* dst = dx + c * plane;
        for (int64_t tap = 0; tap < rr; ++tap) {
          const int32_t* to = taps_.data() + tap * pq;
          const float* in = cols + (c * rr + tap) * ld;
          for (int64_t o = 0; o < pq; ++o)
            if (to[o] >= 0) dst[to[o]] += in[o];
        }
      }
      return;
  }
}

}  // namespace replica::cpu
