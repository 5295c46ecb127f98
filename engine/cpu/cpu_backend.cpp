// CPU backend: memory, elementwise, activation, dropout, loss and optimiser kernels.
#include "engine/cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/context.h"
#include "engine/error.h"

namespace replica {

std::unique_ptr<Backend> make_cpu_backend() {
  cpu::pin_blas_to_one_thread();
  return std::make_unique<CpuBackend>();
}

namespace {

void expect_host(const Tensor& t, const char* what) {
  REPLICA_CHECK(t.on_host(), "CPU backend: {} is in GPU memory", what);
}

void expect_same_numel(const Tensor& a, const Tensor& b, const char* op) {
  REPLICA_CHECK(a.numel() == b.numel(), "{}: {} vs {} elements", op, shape_str(a.shape()),
                shape_str(b.shape()));
}

}  // namespace

void CpuBackend::fill(DeviceContext&, Tensor& t, float value) {
  expect_host(t, "fill target");
  if (t.dtype() == DType::I32) {
    int32_t* p = t.i32();
    std::fill(p, p + t.numel(), static_cast<int32_t>(value));
    return;
  }
  float* p = t.f32();
  cpu::parallel_range(t.numel(), cpu::kGrain,
                      [&](int64_t b, int64_t e) { std::fill(p + b, p + e, value); });
}

void CpuBackend::copy(DeviceContext&, Tensor& dst, const Tensor& src) {
  expect_host(dst, "copy destination");
  expect_host(src, "copy source");
  expect_same_numel(dst, src, "copy");
  REPLICA_CHECK(dst.dtype() == src.dtype(), "copy: dtype mismatch");
  if (dst.raw() == src.raw()) return;
  auto* d = static_cast<char*>(dst.raw());
  auto* s = static_cast<const char*>(src.raw());
  cpu::parallel_range(static_cast<int64_t>(dst.bytes()), 1 << 20, [&](int64_t b, int64_t e) {
    std::memcpy(d + b, s + b, e - b);
  });
}

void CpuBackend::add(DeviceContext&, Tensor& dst, const Tensor& src, float alpha) {
  expect_same_numel(dst, src, "add");
  float* d = dst.f32();
  const float* s = src.f32();
  cpu::parallel_range(dst.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] += alpha * s[i];
  });
}

void CpuBackend::scale(DeviceContext&, Tensor& t, float alpha) {
  float* d = t.f32();
  cpu::parallel_range(t.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] *= alpha;
  });
}

void CpuBackend::relu_forward(DeviceContext&, const Tensor& x, Tensor& y) {
  expect_same_numel(x, y, "relu");
  const float* a = x.f32();
  float* o = y.f32();
  cpu::parallel_range(x.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) o[i] = a[i] > 0.f ? a[i] : 0.f;
  });
}

void CpuBackend::relu_backward(DeviceContext&, const Tensor& y, const Tensor& dy, Tensor& dx) {
  expect_same_numel(y, dy, "relu_backward");
  const float* out = y.f32();
  const float* g = dy.f32();
  float* d = dx.f32();
  cpu::parallel_range(y.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] = out[i] > 0.f ? g[i] : 0.f;
  });
}

void CpuBackend::dropout_forward(DeviceContext&, const Tensor& x, Tensor& y, Tensor& mask,
                                 float p, uint64_t seed) {
  expect_same_numel(x, y, "dropout");
  const float keep_scale = p < 1.f ? 1.f / (1.f - p) : 0.f;
  const float* a = x.f32();
  float* o = y.f32();
  float* m = mask.f32();
  cpu::parallel_range(x.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      m[i] = dropout_uniform(seed, static_cast<uint64_t>(i)) >= p ? keep_scale : 0.f;
      o[i] = a[i] * m[i];
    }
  });
}

void CpuBackend::mul(DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out) {
  expect_same_numel(a, b, "mul");
  const float* x = a.f32();
  const float* z = b.f32();
  float* o = out.f32();
  cpu::parallel_range(a.numel(), cpu::kGrain, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) o[i] = x[i] * z[i];
  });
}

void CpuBackend::cross_entropy_forward(DeviceContext&, const Tensor& logits,
                                       const Tensor& labels, Tensor& probs, Tensor& loss) {
  const int64_t n = logits.dim(0), c = logits.dim(1);
  REPLICA_CHECK(labels.numel() == n, "cross_entropy: {} labels for {} rows", labels.numel(), n);
  const float* x = logits.f32();
  const int32_t* y = labels.i32();
  float* pr = probs.f32();
  double total = 0.0;  // rows summed in order: deterministic
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * c;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < c; ++j) mx = std::max(mx, row[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < c; ++j) sum += std::exp(double(row[j]) - mx);
    double lse = mx + std::log(sum);
    for (int64_t j = 0; j < c; ++j) pr[i * c + j] = float(std::exp(double(row[j]) - lse));
    int32_t label = y[i];
    total += (label >= 0 && label < c) ? lse - row[label] : std::nan("");
  }
  loss.f32()[0] = n > 0 ? float(total / n) : 0.f;
}

void CpuBackend::cross_entropy_backward(DeviceContext&, const Tensor& probs, const Tensor& labels,
                                        float scale, Tensor& dlogits) {
  const int64_t n = probs.dim(0), c = probs.dim(1);
  const float* pr = probs.f32();
  const int32_t* y = labels.i32();
  float* d = dlogits.f32();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j)
      d[i * c + j] = (pr[i * c + j] - (j == y[i] ? 1.f : 0.f)) * scale;
}

void CpuBackend::count_correct(DeviceContext&, const Tensor& logits, const Tensor& labels,
                               Tensor& correct) {
  const int64_t n = logits.dim(0), c = logits.dim(1);
  const float* x = logits.f32();
  const int32_t* y = labels.i32();
  int32_t hits = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < c; ++j)
      if (x[i * c + j] > x[i * c + best]) best = j;
    hits += best == y[i];
  }
  correct.i32()[0] += hits;
}

void CpuBackend::sgd_step(DeviceContext&, Tensor& params, const Tensor& grads, Tensor& momentum,
                          const SgdConfig& c, bool first_step) {
  expect_same_numel(params, grads, "sgd_step");
  float* p = params.f32();
  const float* g = grads.f32();
  float* buf = c.momentum != 0.f ? momentum.f32() : nullptr;
  cpu::parallel_range(params.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float d = g[i] + c.weight_decay * p[i];
      if (buf) {
        buf[i] = first_step ? d : c.momentum * buf[i] + (1.f - c.dampening) * d;
        d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
      }
      p[i] -= c.lr * d;
    }
  });
}

void CpuBackend::adam_step(DeviceContext&, Tensor& params, const Tensor& grads, Tensor& m,
                           Tensor& v, const AdamConfig& c, int64_t step) {
  expect_same_numel(params, grads, "adam_step");
  const float bc1 = float(1.0 - std::pow(double(c.beta1), double(step)));
  const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(double(c.beta2), double(step))));
  const float step_size = c.lr / bc1;
  float* p = params.f32();
  const float* g = grads.f32();
  float* mm = m.f32();
  float* vv = v.f32();
  cpu::parallel_range(params.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float grad = g[i] + c.weight_decay * p[i];
      mm[i] = c.beta1 * mm[i] + (1.f - c.beta1) * grad;
      vv[i] = c.beta2 * vv[i] + (1.f - c.beta2) * grad * grad;
      float denom = std::sqrt(vv[i]) / bc2_sqrt + c.eps;
      p[i] -= step_size * mm[i] / denom;
    }
  });
}

}  // namespace replica
