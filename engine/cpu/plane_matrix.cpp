#include "engine/cpu/plane_matrix.h"

#include <algorithm>
#include <vector>

#include "engine/cpu/cpu_backend.h"

namespace replica::cpu {

namespace {

// M's size cap (64 MB): a ResNet's largest, 512 channels on 2x2 planes, is 4M floats.
constexpr int64_t kMaxPlaneMatrixFloats = int64_t(1) << 24;

int64_t plane(const ConvGeometry& g) { return g.h * g.w; }

// tap[t * hw + u]: the kernel tap (i*r + j) joining output pixel t to input pixel u, or -1.
// Unique: a stride fixes i from iy and oy, and j from ix and ox.
std::vector<int32_t> tap_table(const ConvGeometry& g) {
  std::vector<int32_t> tap(size_t(g.pq() * plane(g)), -1);
  for (int64_t oy = 0; oy < g.p; ++oy)
    for (int64_t ox = 0; ox < g.q; ++ox)
      for (int64_t i = 0; i < g.r; ++i)
        for (int64_t j = 0; j < g.r; ++j) {
          const int64_t iy = oy * g.stride - g.pad + i, ix = ox * g.stride - g.pad + j;
          if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
          tap[size_t((oy * g.q + ox) * plane(g) + iy * g.w + ix)] = int32_t(i * g.r + j);
        }
  return tap;
}

// Rows of M (or of its gradient) a task takes: about kGrain floats.
int64_t row_grain(const ConvGeometry& g) { return std::max<int64_t>(1, kGrain / (g.c * plane(g))); }

// m[k*pq, c*hw] = the plane matrix of the weights w[k, c, r, r].
void build(const float* w, const std::vector<int32_t>& tap, const ConvGeometry& g, float* m) {
  const int64_t hw = plane(g), rr = g.r * g.r, cols = g.c * hw;
  parallel_range(g.k * g.pq(), row_grain(g), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t kk = row / g.pq(), t = row % g.pq();
      const int32_t* taps = tap.data() + t * hw;
      float* dst = m + row * cols;
      for (int64_t cc = 0; cc < g.c; ++cc) {
        const float* wk = w + (kk * g.c + cc) * rr;
        for (int64_t u = 0; u < hw; ++u) dst[cc * hw + u] = taps[u] >= 0 ? wk[taps[u]] : 0.f;
      }
    }
  });
}

// dw[k, c, r, r] += the gradient dm[k*pq, c*hw] of M, each tap's entries added in pixel order.
void fold(const float* dm, const std::vector<int32_t>& tap, const ConvGeometry& g, float* dw) {
  const int64_t hw = plane(g), rr = g.r * g.r, cols = g.c * hw;
  const int64_t grain = std::max<int64_t>(1, kGrain / (g.pq() * cols));
  parallel_range(g.k, grain, [&](int64_t k0, int64_t k1) {
    for (int64_t kk = k0; kk < k1; ++kk)
      for (int64_t t = 0; t < g.pq(); ++t) {
        const int32_t* taps = tap.data() + t * hw;
        const float* src = dm + (kk * g.pq() + t) * cols;
        for (int64_t cc = 0; cc < g.c; ++cc) {
          float* wk = dw + (kk * g.c + cc) * rr;
          for (int64_t u = 0; u < hw; ++u)
            if (taps[u] >= 0) wk[taps[u]] += src[cc * hw + u];
        }
      }
  });
}

}  // namespace

bool use_plane_matrix(const ConvGeometry& g) {
  const int64_t hw = plane(g), rr = g.r * g.r;
  // Per output channel, input channel and output pixel: hw multiply-adds a sample, plus one
  // write of M a call, against im2col's rr a sample.
  return hw * (g.n + 1) < rr * g.n && g.k * g.pq() * g.c * hw <= kMaxPlaneMatrixFloats;
}

void plane_matrix_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                          float* y, const ConvGeometry& g) {
  const int64_t in = g.c * plane(g), out = g.k * g.pq();
  Tensor m = ctx.alloc({out * in});
  build(w, tap_table(g), g, m.f32());
  if (b)
    parallel_range(g.n * g.k, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) std::fill(y + i * g.pq(), y + (i + 1) * g.pq(), b[i % g.k]);
    });
  // Y[n, k*pq] = X[n, c*hw] M^T
  parallel_sgemm(false, true, g.n, out, in, 1.f, x, in, m.f32(), in, b ? 1.f : 0.f, y, out);
}

void plane_matrix_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                           float* dx, float* dw, const ConvGeometry& g) {
  const int64_t in = g.c * plane(g), out = g.k * g.pq();
  const std::vector<int32_t> tap = tap_table(g);
  Tensor m = ctx.alloc({out * in});
  float* mp = m.f32();
  if (dx) {
    build(w, tap, g, mp);
    // dX[n, c*hw] = dY[n, k*pq] M
    parallel_sgemm(false, false, g.n, in, out, 1.f, dy, out, mp, in, 0.f, dx, in);
  }
  // dM[k*pq, c*hw] = dY^T X, into M's buffer once dX no longer needs it
  parallel_sgemm(true, false, out, in, g.n, 1.f, dy, out, x, in, 0.f, mp, in);
  fold(mp, tap, g, dw);
}

}  // namespace replica::cpu
