// CPU batch normalisation. Parallel over channels; every sum runs in a fixed order, in double,
// so results are reproducible and close to a double reference.
#include <cmath>

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

}  // namespace replica
