// CPU pooling: max pooling (the first maximum of a window wins) and adaptive average pooling.
// Parallel over planes.
#include <cmath>
#include <limits>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

namespace {

struct PoolGeometry {
  int64_t planes, h, w, p, q;
};

PoolGeometry pool_geometry(const Tensor& x, const Tensor& y) {
  REPLICA_CHECK(x.ndim() == 4 && y.ndim() == 4, "pooling expects NCHW tensors");
  return {x.dim(0) * x.dim(1), x.dim(2), x.dim(3), y.dim(2), y.dim(3)};
}

// Index (within the plane) of the first maximum of window (oy, ox); -1 if it is all padding.
inline int64_t window_argmax(const float* plane, const PoolGeometry& g, const Pool2dParams& prm,
                             int64_t oy, int64_t ox) {
  int64_t best = -1;
  float best_v = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < prm.kernel; ++i) {
    int64_t iy = oy * prm.stride - prm.padding + i;
    if (iy < 0 || iy >= g.h) continue;
    for (int j = 0; j < prm.kernel; ++j) {
      int64_t ix = ox * prm.stride - prm.padding + j;
      if (ix < 0 || ix >= g.w) continue;
      float v = plane[iy * g.w + ix];
      if (best < 0 || v > best_v || std::isnan(v)) {
        best = iy * g.w + ix;
        best_v = v;
        if (std::isnan(v)) return best;
      }
    }
  }
  return best;
}

}  // namespace

void CpuBackend::maxpool2d_forward(DeviceContext&, const Tensor& x, Tensor& y,
                                   const Pool2dParams& prm) {
  const PoolGeometry g = pool_geometry(x, y);
  const float* xp = x.f32();
  float* yp = y.f32();
  cpu::parallel_range(g.planes, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) {
      const float* plane = xp + pl * g.h * g.w;
      for (int64_t oy = 0; oy < g.p; ++oy)
        for (int64_t ox = 0; ox < g.q; ++ox) {
          int64_t a = window_argmax(plane, g, prm, oy, ox);
          yp[(pl * g.p + oy) * g.q + ox] =
              a >= 0 ? plane[a] : -std::numeric_limits<float>::infinity();
        }
    }
  });
}

void CpuBackend::maxpool2d_backward(DeviceContext&, const Tensor& x, const Tensor& y,
                                    const Tensor& dy, Tensor& dx, const Pool2dParams& prm) {
  const PoolGeometry g = pool_geometry(x, y);
  const float* xp = x.f32();
  const float* gp = dy.f32();
  float* dxp = dx.f32();
  cpu::parallel_range(g.planes, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) {
      const float* plane = xp + pl * g.h * g.w;
      float* dplane = dxp + pl * g.h * g.w;
      std::fill(dplane, dplane + g.h * g.w, 0.f);
      for (int64_t oy = 0; oy < g.p; ++oy)
        for (int64_t ox = 0; ox < g.q; ++ox) {
          int64_t a = window_argmax(plane, g, prm, oy, ox);
          if (a >= 0) dplane[a] += gp[(pl * g.p + oy) * g.q + ox];
        }
    }
  });
}

void CpuBackend::adaptive_avgpool2d_forward(DeviceContext&, const Tensor& x, Tensor& y) {
  const PoolGeometry g = pool_geometry(x, y);
  const float* xp = x.f32();
  float* yp = y.f32();
  cpu::parallel_range(g.planes, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) {
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
    }
  });
}

void CpuBackend::adaptive_avgpool2d_backward(DeviceContext&, const Tensor& dy, Tensor& dx) {
  const PoolGeometry g = pool_geometry(dx, dy);
  const float* gp = dy.f32();
  float* dxp = dx.f32();
  cpu::parallel_range(g.planes, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t pl = p0; pl < p1; ++pl) {
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
    }
  });
}

}  // namespace replica
