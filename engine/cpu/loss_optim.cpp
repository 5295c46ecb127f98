// CPU loss and optimizer kernels: softmax cross-entropy (forward, backward, hits) and the fused
// SGD and Adam updates. The loss sums run in a fixed order.
#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

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
  REPLICA_CHECK(labels.numel() == n, "count_correct: {} labels for {} rows", labels.numel(), n);
  REPLICA_CHECK(correct.dtype() == DType::I32 && correct.numel() >= 1,
                "count_correct: counts must be I32 [K >= 1], got {} {}",
                dtype_name(correct.dtype()), shape_str(correct.shape()));
  const int64_t k = correct.numel();
  const float* x = logits.f32();
  const int32_t* y = labels.i32();
  int32_t* counts = correct.i32();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t place = label_place(x + i * c, c, y[i]);
    for (int64_t j = place; j < k; ++j) ++counts[j];  // among the top j+1 for every j >= place
  }
}

namespace {

// The optimizer loops take their settings by value and their buffers as restrict pointers: a
// store through a float* could otherwise change a setting or another buffer (they are captured
// by reference), and the loop is neither vectorised nor freed of its invariant tests. Adam's is
// vectorised only because the engine is built with -fno-math-errno (engine/CMakeLists.txt): a
// sqrt that may set errno is a branch in the loop. Results are the same either way (sqrt is
// correctly rounded).
void sgd_range(float* __restrict p, const float* __restrict g, float* __restrict buf,
               const SgdConfig c, bool first_step, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    float d = g[i] + c.weight_decay * p[i];
    if (buf) {
      const float v = first_step ? d : c.momentum * buf[i] + (1.f - c.dampening) * d;
      buf[i] = v;
      d = c.nesterov ? d + c.momentum * v : v;
    }
    p[i] -= c.lr * d;
  }
}

void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                float* __restrict v, const AdamConfig c, float step_size, float bc2_sqrt,
                int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const float grad = g[i] + c.weight_decay * p[i];
    const float mi = c.beta1 * m[i] + (1.f - c.beta1) * grad;
    const float vi = c.beta2 * v[i] + (1.f - c.beta2) * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + c.eps;
    p[i] -= step_size * mi / denom;
  }
}

// The step's scalars (backend_ops.inc): [lr, first] for SGD, [step size, sqrt(bc2)] for Adam.
StepScalars read_scalars(const Tensor& scalars, const char* op) {
  REPLICA_CHECK(scalars.defined() && scalars.dtype() == DType::F32 && scalars.numel() == 2,
                "{}: scalars must be F32 [2]", op);
  return {scalars.f32()[0], scalars.f32()[1]};
}

}  // namespace

void CpuBackend::sgd_step(DeviceContext&, Tensor& params, const Tensor& grads, Tensor& momentum,
                          const SgdConfig& config, const Tensor& scalars) {
  cpu::expect_same_numel(params, grads, "sgd_step");
  const StepScalars s = read_scalars(scalars, "sgd_step");
  SgdConfig c = config;
  c.lr = s[0];
  const bool first_step = s[1] != 0.f;
  float* p = params.f32();
  const float* g = grads.f32();
  float* buf = c.momentum != 0.f ? momentum.f32() : nullptr;
  cpu::parallel_range(params.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    sgd_range(p, g, buf, c, first_step, b, e);
  });
}

void CpuBackend::adam_step(DeviceContext&, Tensor& params, const Tensor& grads, Tensor& m,
                           Tensor& v, const AdamConfig& c, const Tensor& scalars) {
  cpu::expect_same_numel(params, grads, "adam_step");
  const auto [step_size, bc2_sqrt] = read_scalars(scalars, "adam_step");
  float* p = params.f32();
  const float* g = grads.f32();
  float* mm = m.f32();
  float* vv = v.f32();
  cpu::parallel_range(params.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    adam_range(p, g, mm, vv, c, step_size, bc2_sqrt, b, e);
  });
}

}  // namespace replica
