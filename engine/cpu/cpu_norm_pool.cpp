// CPU batch normalisation and pooling. Parallel over channels or planes; every sum runs in a
// fixed order, in double, so results are reproducible and close to a double reference.
#include <cmath>
#include <limits>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

namespace {

struct NchwDims {
  int64_t n, c, hw;
};

NchwDims nchw(const Tensor& x) {
  REPLICA_CHECK(x.ndim() == 4 || x.ndim() == 2, "expected NCHW or NC input, got {}",
                shape_str(x.shape()));
  return {x.dim(0), x.dim(1), x.ndim() == 4 ? x.dim(2) * x.dim(3) : 1};
}

}  // namespace

void CpuBackend::batchnorm_forward_train(DeviceContext&, const Tensor& x, const Tensor& gamma,
                                         const Tensor& beta, Tensor& running_mean,
                                         Tensor& running_var, float momentum, float eps,
                                         Tensor& y, Tensor& save_mean, Tensor& save_invstd) {
  const NchwDims d = nchw(x);
  const int64_t m = d.n * d.hw;
  REPLICA_CHECK(m > 1, "BatchNorm in training mode needs more than one value per channel "
                       "(got input {}); use a larger batch", shape_str(x.shape()));
  const float* xp = x.f32();
  float* yp = y.f32();
  cpu::parallel_range(d.c, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double sum = 0.0;
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) sum += p[i];
      }
      const double mean = sum / m;
      double sq = 0.0;
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) sq += (p[i] - mean) * (p[i] - mean);
      }
      const double var = sq / m;
      const double invstd = 1.0 / std::sqrt(var + eps);
      const float scale = float(gamma.f32()[c] * invstd);
      const float shift = float(beta.f32()[c] - mean * gamma.f32()[c] * invstd);
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        float* o = yp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) o[i] = p[i] * scale + shift;
      }
      save_mean.f32()[c] = float(mean);
      save_invstd.f32()[c] = float(invstd);
      float& rm = running_mean.f32()[c];
      float& rv = running_var.f32()[c];
      rm = float((1.0 - momentum) * rm + momentum * mean);
      rv = float((1.0 - momentum) * rv + momentum * var * m / (m - 1));
    }
  });
}

void CpuBackend::batchnorm_forward_eval(DeviceContext&, const Tensor& x, const Tensor& gamma,
                                        const Tensor& beta, const Tensor& running_mean,
                                        const Tensor& running_var, float eps, Tensor& y) {
  const NchwDims d = nchw(x);
  const float* xp = x.f32();
  float* yp = y.f32();
  cpu::parallel_range(d.c, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const double invstd = 1.0 / std::sqrt(double(running_var.f32()[c]) + eps);
      const float scale = float(gamma.f32()[c] * invstd);
      const float shift = float(beta.f32()[c] - running_mean.f32()[c] * gamma.f32()[c] * invstd);
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        float* o = yp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) o[i] = p[i] * scale + shift;
      }
    }
  });
}

void CpuBackend::batchnorm_backward(DeviceContext&, const Tensor& x, const Tensor& gamma,
                                    const Tensor& save_mean, const Tensor& save_invstd,
                                    const Tensor& dy, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const NchwDims d = nchw(x);
  const int64_t m = d.n * d.hw;
  const float* xp = x.f32();
  const float* gp = dy.f32();
  float* dxp = dx.defined() ? dx.f32() : nullptr;
  cpu::parallel_range(d.c, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const double mean = save_mean.f32()[c], invstd = save_invstd.f32()[c];
      double sum_dy = 0.0, sum_dy_xhat = 0.0;
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        const float* g = gp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) {
          sum_dy += g[i];
          sum_dy_xhat += g[i] * (p[i] - mean) * invstd;
        }
      }
      dgamma.f32()[c] += float(sum_dy_xhat);
      dbeta.f32()[c] += float(sum_dy);
      if (!dxp) continue;
      // dx = gamma*invstd/m * (m*dy - sum(dy) - xhat*sum(dy*xhat))
      const double k = gamma.f32()[c] * invstd / m;
      for (int64_t n = 0; n < d.n; ++n) {
        const float* p = xp + (n * d.c + c) * d.hw;
        const float* g = gp + (n * d.c + c) * d.hw;
        float* o = dxp + (n * d.c + c) * d.hw;
        for (int64_t i = 0; i < d.hw; ++i) {
          const double xhat = (p[i] - mean) * invstd;
          o[i] = float(k * (m * double(g[i]) - sum_dy - xhat * sum_dy_xhat));
        }
      }
    }
  });
}

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
