#include "engine/cpu/plane_matrix.h"

#include <algorithm>
#include <vector>

#include "engine/cpu/cpu_backend.h"

namespace replica::cpu {

namespace {

// tap[t * hw + u]: plane_tap for every output pixel t and input pixel u, built once a call.
std::vector<int32_t> tap_table(const ConvGeometry& g) {
  std::vector<int32_t> tap(size_t(g.pq() * g.hw()));
  for (int64_t t = 0; t < g.pq(); ++t)
    for (int64_t u = 0; u < g.hw(); ++u) tap[size_t(t * g.hw() + u)] = plane_tap(g, t, u);
  return tap;
}

// Rows of M (or of its gradient) a task takes: about kGrain floats.
int64_t row_grain(const ConvGeometry& g) { return std::max<int64_t>(1, kGrain / (g.c * g.hw())); }

// m[k*pq, c*hw] = the plane matrix of the weights w[k, c, r, r].
void build(const float* w, const std::vector<int32_t>& tap, const ConvGeometry& g, float* m) {
  const int64_t hw = g.hw(), rr = g.r * g.r, cols = g.c * hw;
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
  const int64_t hw = g.hw(), rr = g.r * g.r, cols = g.c * hw;
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

void plane_matrix_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                          float* y, const ConvGeometry& g) {
  const int64_t in = g.c * g.hw(), out = g.k * g.pq();
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
  const int64_t in = g.c * g.hw(), out = g.k * g.pq();
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
