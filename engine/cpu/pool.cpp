// CPU pooling: max pooling (the first maximum of a window wins) and adaptive average pooling.
// Parallel over planes. 2x2 windows that tile the plane (the CNN's) and 3x3 windows at stride 2
// with padding 1 (a ResNet's) go 16 at a time in vectors in builds for AVX-512
// (engine/cpu/max_pool_rows.h).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/max_pool_rows.h"
#include "engine/env_switch.h"
#include "engine/error.h"

namespace replica {

namespace {

struct PoolGeometry {
  int64_t planes, h, w, p, q;
};

PoolGeometry pool_geometry(const Tensor& x, const Tensor& y) {
  REPLICA_CHECK(x.ndim() == 4 && y.ndim() == 4, "pooling expects NCHW tensors");
  REPLICA_CHECK(x.dim(2) * x.dim(3) <= INT32_MAX, "pooling: a {}x{} plane is too large",
                x.dim(2), x.dim(3));
  return {x.dim(0) * x.dim(1), x.dim(2), x.dim(3), y.dim(2), y.dim(3)};
}

// An element's index within its plane (pool_geometry checks that it fits).
using PlaneIndex = int32_t;

using cpu::takes_over;

// Keeps (v, at) if it wins. As a select, not a branch: which element wins is data-dependent, and
// a mispredicted branch per element cost more than the compare. Where windows lie side by side
// (tiling rows) the compiler turns this into vector blends.
inline void keep_max(float v, int64_t at, float& best_v, PlaneIndex& best) {
  const bool take = takes_over(v, best_v);
  best_v = take ? v : best_v;
  best = take ? PlaneIndex(at) : best;
}

// The same, the select spelled out in bit masks, for overlapping windows and windows taken one
// by one: there the compiler made keep_max's select a branch or a slower blend. Alternated with
// the select on the 2-core machine: ResNet-18 3x224x224's max pool 8.9-9.9 -> 6.1-7.9 ms forward,
// 5-10% at 28x28 and 32x32; tiling rows keep keep_max, no faster with masks.
inline void keep_max_masked(float v, int64_t at, float& best_v, PlaneIndex& best) {
  const uint32_t mask = 0u - uint32_t(takes_over(v, best_v));
  uint32_t vb, bb;
  std::memcpy(&vb, &v, 4);
  std::memcpy(&bb, &best_v, 4);
  bb = (vb & mask) | (bb & ~mask);
  std::memcpy(&best_v, &bb, 4);
  best = PlaneIndex((uint32_t(at) & mask) | (uint32_t(best) & ~mask));
}

// Index (within the plane) of the first maximum of window (oy, ox); -1 if it is all padding.
// The window is clamped to the plane once, so the loops test no bounds.
PlaneIndex window_argmax(const float* plane, const PoolGeometry& g, const Pool2dParams& prm,
                         int64_t oy, int64_t ox, float& best_v) {
  const int64_t ty = oy * prm.stride - prm.padding, tx = ox * prm.stride - prm.padding;
  const int64_t y0 = std::max<int64_t>(ty, 0), y1 = std::min<int64_t>(ty + prm.kernel, g.h);
  const int64_t x0 = std::max<int64_t>(tx, 0), x1 = std::min<int64_t>(tx + prm.kernel, g.w);
  best_v = -std::numeric_limits<float>::infinity();
  if (y0 >= y1 || x0 >= x1) return -1;
  PlaneIndex best = PlaneIndex(y0 * g.w + x0);
  best_v = plane[best];
  for (int64_t iy = y0; iy < y1; ++iy)
    for (int64_t i = iy * g.w + x0; i < iy * g.w + x1; ++i)
      keep_max_masked(plane[i], i, best_v, best);
  return best;
}

// Windows that tile the plane (stride = kernel, no padding), larger than 2x2 or in builds
// without the vector kernel, are taken a row of windows at a time, element (i, j) of every
// window in turn, loops the compiler vectorises.
void tiled_row_winners(const float* plane, const PoolGeometry& g, int k, int64_t oy, float* best,
                       PlaneIndex* at) {
  const int64_t top = oy * k * g.w;
  for (int64_t ox = 0; ox < g.q; ++ox) {
    best[ox] = plane[top + ox * k];
    at[ox] = PlaneIndex(top + ox * k);
  }
  for (int e = 1; e < k * k; ++e) {
    const int64_t first = top + (e / k) * g.w + e % k;
    for (int64_t ox = 0; ox < g.q; ++ox) {
      const int64_t i = first + ox * k;
      keep_max(plane[i], i, best[ox], at[ox]);
    }
  }
}

bool tiles(const Pool2dParams& prm) { return prm.stride == prm.kernel && prm.padding == 0; }

// 2x2 tiles go a row of windows at a time in vectors, where the build has them (unless
// REPLICA_MAX_POOL_2X2=0).
bool tiles_2x2(const Pool2dParams& prm) {
  return tiles(prm) && prm.kernel == 2 && cpu::max_pool_rows_built() &&
         switches::kMaxPool2x2.on();
}

// ResNet's windows (3x3, stride 2, padding 1) go a row of windows at a time in vectors, where
// the build has them (unless REPLICA_MAX_POOL_3X3=0).
bool windows_3x3_s2(const Pool2dParams& prm) {
  return prm.kernel == 3 && prm.stride == 2 && prm.padding == 1 && cpu::max_pool_rows_built() &&
         switches::kMaxPool3x3.on();
}

// Overlapping or padded windows (ResNet's 3x3, stride 2, padding 1), a row at a time: windows
// whose columns lie inside the plane take their elements in the window's row-major order, each
// element for every such window in turn (independent compares, where one window's nine compares
// form a chain: the CPU's max-pool was 8% of a ResNet-18 step); windows cut by the left or right
// edge go one by one. The window's rows are clamped once for the whole row.
void overlapping_row_winners(const float* plane, const PoolGeometry& g, const Pool2dParams& prm,
                             int64_t oy, float* best, PlaneIndex* at) {
  const int k = prm.kernel, s = prm.stride;
  // Interior columns: ox*s - padding >= 0 and ox*s - padding + k <= w.
  const int64_t lo = std::min<int64_t>((prm.padding + s - 1) / s, g.q);
  const int64_t hi = g.w + prm.padding >= k
                         ? std::max(lo, std::min<int64_t>(g.q, (g.w + prm.padding - k) / s + 1))
                         : lo;
  for (int64_t ox = 0; ox < g.q; ++ox)
    if (ox < lo || ox >= hi) at[ox] = window_argmax(plane, g, prm, oy, ox, best[ox]);
  const int64_t ty = oy * s - prm.padding;
  const int64_t y0 = std::max<int64_t>(ty, 0), y1 = std::min<int64_t>(ty + k, g.h);
  if (lo >= hi) return;
  if (y0 >= y1) {  // every window of the row is padding (window_argmax's -1)
    std::fill(best + lo, best + hi, -std::numeric_limits<float>::infinity());
    std::fill(at + lo, at + hi, PlaneIndex(-1));
    return;
  }
  const int64_t left = -int64_t(prm.padding);  // column of window 0's first element
  for (int64_t ox = lo; ox < hi; ++ox) {
    const int64_t i = y0 * g.w + left + ox * s;
    best[ox] = plane[i];
    at[ox] = PlaneIndex(i);
  }
  for (int64_t iy = y0; iy < y1; ++iy)
    for (int j = iy == y0 ? 1 : 0; j < k; ++j) {
      const int64_t first = iy * g.w + left + j;
      for (int64_t ox = lo; ox < hi; ++ox) {
        const int64_t i = first + ox * s;
        keep_max_masked(plane[i], i, best[ox], at[ox]);
      }
    }
}

// The winners of every window of output row oy: best[ox] its value (-inf when all padding) and
// at[ox] its index in the plane (-1 then). vector_3x3: windows_3x3_s2(prm), asked once a call.
void row_winners(const float* plane, const PoolGeometry& g, const Pool2dParams& prm,
                 bool vector_3x3, int64_t oy, float* best, PlaneIndex* at) {
  if (vector_3x3) {
    cpu::max_pool_3x3_s2_row(plane, g.h, g.w, oy, g.q, best, at);
  } else if (tiles(prm)) {
    tiled_row_winners(plane, g, prm.kernel, oy, best, at);
  } else {
    overlapping_row_winners(plane, g, prm, oy, best, at);
  }
}

// Planes per parallel task: about cpu::kGrain input elements each, as the elementwise loops take.
// Small planes made thousands of tiny tasks: ResNet-18 at 3x32x32, batch 64, ends in 32,768
// planes of 1x1 for the average pool, whose two passes went from 0.25 to 0.18 ms (the max pool's
// 16x16 planes timed the same either way: there the time is in the windows' loops).
int64_t planes_per_task(const PoolGeometry& g) {
  return std::max<int64_t>(1, cpu::kGrain / std::max<int64_t>(g.h * g.w, 1));
}

// Runs body(plane index) for the planes of g, in parallel.
template <class Body>
void for_each_plane(const PoolGeometry& g, Body&& body) {
  cpu::parallel_range(g.planes, planes_per_task(g), [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) body(pl);
  });
}

// The same with a scratch row per plane, body(plane index, best, at), for row_winners. The scratch,
// a row per plane, is one block from the device's caching allocator per call: no allocation per
// task.
template <class Body>
void for_each_plane(DeviceContext& ctx, const PoolGeometry& g, Body&& body) {
  const int64_t n = std::max<int64_t>(g.planes * g.q, 1);
  Tensor best = ctx.alloc({n});
  Tensor at = ctx.alloc({n}, DType::I32);
  for_each_plane(g, [&](int64_t pl) { body(pl, best.f32() + pl * g.q, at.i32() + pl * g.q); });
}

}  // namespace

void CpuBackend::maxpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y,
                                   const Pool2dParams& prm) {
  const PoolGeometry g = pool_geometry(x, y);
  const float* xp = x.f32();
  float* yp = y.f32();
  if (tiles_2x2(prm)) {
    for_each_plane(g, [&](int64_t pl) {
      for (int64_t oy = 0; oy < g.p; ++oy) {
        const float* top = xp + pl * g.h * g.w + 2 * oy * g.w;
        cpu::max_pool_2x2_row(top, top + g.w, g.q, yp + (pl * g.p + oy) * g.q);
      }
    });
    return;
  }
  const bool vector_3x3 = windows_3x3_s2(prm);
  for_each_plane(ctx, g, [&](int64_t pl, float* best, PlaneIndex* at) {
    for (int64_t oy = 0; oy < g.p; ++oy) {
      row_winners(xp + pl * g.h * g.w, g, prm, vector_3x3, oy, best, at);
      std::copy(best, best + g.q, yp + (pl * g.p + oy) * g.q);
    }
  });
}

// Each window's gradient is added at its winner, into a plane zeroed first (overlapping windows
// add more than one gradient into an element).
void CpuBackend::maxpool2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& y,
                                    const Tensor& dy, Tensor& dx, const Pool2dParams& prm) {
  const PoolGeometry g = pool_geometry(x, y);
  if (tiles_2x2(prm)) {
    for_each_plane(g, [&](int64_t pl) {
      const float* plane = x.f32() + pl * g.h * g.w;
      float* dplane = dx.f32() + pl * g.h * g.w;
      for (int64_t oy = 0; oy < g.p; ++oy) {
        const int64_t top = 2 * oy * g.w;
        cpu::max_pool_2x2_row_grad(plane + top, plane + top + g.w,
                                   dy.f32() + (pl * g.p + oy) * g.q, g.q, dplane + top,
                                   dplane + top + g.w);
        std::fill(dplane + top + 2 * g.q, dplane + top + g.w, 0.f);  // columns no window covers
        std::fill(dplane + top + g.w + 2 * g.q, dplane + top + 2 * g.w, 0.f);
      }
      std::fill(dplane + 2 * g.p * g.w, dplane + g.h * g.w, 0.f);  // a row no window covers
    });
    return;
  }
  const bool tiled = tiles(prm), vector_3x3 = windows_3x3_s2(prm);
  const int k = prm.kernel;
  for_each_plane(ctx, g, [&](int64_t pl, float* best, PlaneIndex* at) {
    const float* plane = x.f32() + pl * g.h * g.w;
    float* dplane = dx.f32() + pl * g.h * g.w;
    const float* grad = dy.f32() + pl * g.p * g.q;
    // Tiling windows zero the rows under a row of windows just before adding into them, while they
    // are in cache; what no window covers is zeroed up front.
    const int64_t rows_owned = tiled ? g.p * k : 0;
    std::fill(dplane + rows_owned * g.w, dplane + g.h * g.w, 0.f);
    for (int64_t oy = 0; oy < g.p; ++oy, grad += g.q) {
      row_winners(plane, g, prm, vector_3x3, oy, best, at);
      if (tiled) std::fill(dplane + oy * k * g.w, dplane + (oy + 1) * k * g.w, 0.f);
      for (int64_t ox = 0; ox < g.q; ++ox)
        if (at[ox] >= 0) dplane[at[ox]] += grad[ox];
    }
  });
}

void CpuBackend::adaptive_avgpool2d_forward(DeviceContext&, const Tensor& x, Tensor& y) {
  const PoolGeometry g = pool_geometry(x, y);
  const float* xp = x.f32();
  float* yp = y.f32();
  for_each_plane(g, [&](int64_t pl) {
    const float* plane = xp + pl * g.h * g.w;
    for (int64_t oy = 0; oy < g.p; ++oy) {
      int64_t y0 = oy * g.h / g.p, y1 = ((oy + 1) * g.h + g.p - 1) / g.p;
      for (int64_t ox = 0; ox < g.q; ++ox) {
        int64_t x0 = ox * g.w / g.q, x1 = ((ox + 1) * g.w + g.q - 1) / g.q;
        float s = 0.f;
        for (int64_t iy = y0; iy < y1; ++iy)
          for (int64_t ix = x0; ix < x1; ++ix) s += plane[iy * g.w + ix];
        yp[(pl * g.p + oy) * g.q + ox] = s / float((y1 - y0) * (x1 - x0));
      }
    }
  });
}

void CpuBackend::adaptive_avgpool2d_backward(DeviceContext&, const Tensor& dy, Tensor& dx) {
  const PoolGeometry g = pool_geometry(dx, dy);
  const float* gp = dy.f32();
  float* dxp = dx.f32();
  for_each_plane(g, [&](int64_t pl) {
    float* dplane = dxp + pl * g.h * g.w;
    std::fill(dplane, dplane + g.h * g.w, 0.f);
    for (int64_t oy = 0; oy < g.p; ++oy) {
      int64_t y0 = oy * g.h / g.p, y1 = ((oy + 1) * g.h + g.p - 1) / g.p;
      for (int64_t ox = 0; ox < g.q; ++ox) {
        int64_t x0 = ox * g.w / g.q, x1 = ((ox + 1) * g.w + g.q - 1) / g.q;
        float share = gp[(pl * g.p + oy) * g.q + ox] / float((y1 - y0) * (x1 - x0));
        for (int64_t iy = y0; iy < y1; ++iy)
          for (int64_t ix = x0; ix < x1; ++ix) dplane[iy * g.w + ix] += share;
      }
    }
  });
}

}  // namespace replica
