// Support for the gradient checks (test_gradcheck*.cpp): naive double-precision references of
// every layer, and the checks that compare the engine's forward and backward against them.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/ops.h"
#include "layers/layers.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "layers/resnet.h"

namespace gradref {

using namespace replica;

// ---- double-precision reference ------------------------------------------------------------

struct DT {  // a double tensor, row-major
  Shape shape;
  std::vector<double> v;
  DT() = default;
  explicit DT(Shape s) : shape(std::move(s)), v(size_t(shape_numel(shape)), 0.0) {}
};

DT ref_conv2d(const DT& x, const DT& w, const DT* b, int s, int pad) {
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  const int64_t K = w.shape[0], R = w.shape[2];
  const int64_t P = (H + 2 * pad - R) / s + 1, Q = (W + 2 * pad - R) / s + 1;
  DT y({N, K, P, Q});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          double acc = b ? b->v[k] : 0.0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < R; ++i)
              for (int64_t j = 0; j < R; ++j) {
                int64_t iy = p * s - pad + i, ix = q * s - pad + j;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                acc += w.v[((k * C + c) * R + i) * R + j] * x.v[((n * C + c) * H + iy) * W + ix];
              }
          y.v[((n * K + k) * P + p) * Q + q] = acc;
        }
  return y;
}

DT ref_linear(const DT& x, const DT& w, const DT* b) {
  const int64_t N = x.shape[0], in = x.shape[1], out = w.shape[0];
  DT y({N, out});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? b->v[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x.v[n * in + i] * w.v[o * in + i];
      y.v[n * out + o] = acc;
    }
  return y;
}

// Training mode: batch statistics, biased variance.
DT ref_batchnorm(const DT& x, const DT& g, const DT& b, double eps = 1e-5) {
  const int64_t N = x.shape[0], C = x.shape[1], HW = shape_numel(x.shape) / (N * C);
  DT y(x.shape);
  for (int64_t c = 0; c < C; ++c) {
    double mean = 0, var = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) mean += x.v[(n * C + c) * HW + i];
    mean /= double(N * HW);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        double d = x.v[(n * C + c) * HW + i] - mean;
        var += d * d;
      }
    var /= double(N * HW);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        int64_t at = (n * C + c) * HW + i;
        y.v[at] = g.v[c] * (x.v[at] - mean) / std::sqrt(var + eps) + b.v[c];
      }
  }
  return y;
}

DT ref_relu(const DT& x) {
  DT y = x;
  for (auto& e : y.v) e = e > 0 ? e : 0.0;
  return y;
}

DT ref_add(const DT& a, const DT& b) {
  DT y = a;
  for (size_t i = 0; i < y.v.size(); ++i) y.v[i] += b.v[i];
  return y;
}

DT ref_reshape(const DT& x, Shape s) {
  DT y = x;
  y.shape = std::move(s);
  return y;
}

// Padding is -inf; ties go to the first maximum in row-major window order.
DT ref_maxpool(const DT& x, int k, int s, int pad) {
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  const int64_t P = (H + 2 * pad - k) / s + 1, Q = (W + 2 * pad - k) / s + 1;
  DT y({N, C, P, Q});
  for (int64_t pl = 0; pl < N * C; ++pl)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        double best = -std::numeric_limits<double>::infinity();
        for (int i = 0; i < k; ++i)
          for (int j = 0; j < k; ++j) {
            int64_t iy = p * s - pad + i, ix = q * s - pad + j;
            if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
            best = std::max(best, x.v[(pl * H + iy) * W + ix]);
          }
        y.v[(pl * P + p) * Q + q] = best;
      }
  return y;
}

DT ref_adaptive_avgpool(const DT& x, int64_t OH, int64_t OW) {
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  DT y({N, C, OH, OW});
  for (int64_t pl = 0; pl < N * C; ++pl)
    for (int64_t p = 0; p < OH; ++p)
      for (int64_t q = 0; q < OW; ++q) {
        int64_t y0 = int64_t(std::floor(double(p * H) / OH));
        int64_t y1 = int64_t(std::ceil(double((p + 1) * H) / OH));
        int64_t x0 = int64_t(std::floor(double(q * W) / OW));
        int64_t x1 = int64_t(std::ceil(double((q + 1) * W) / OW));
        double s = 0;
        for (int64_t iy = y0; iy < y1; ++iy)
          for (int64_t ix = x0; ix < x1; ++ix) s += x.v[(pl * H + iy) * W + ix];
        y.v[(pl * OH + p) * OW + q] = s / double((y1 - y0) * (x1 - x0));
      }
  return y;
}

double ref_cross_entropy(const DT& logits, const std::vector<int32_t>& labels) {
  const int64_t N = logits.shape[0], C = logits.shape[1];
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    double mx = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, logits.v[n * C + c]);
    for (int64_t c = 0; c < C; ++c) s += std::exp(logits.v[n * C + c] - mx);
    total += mx + std::log(s) - logits.v[n * C + labels[n]];
  }
  return total / double(N);
}

// ---- the checker -----------------------------------------------------------------------------

using Params = std::vector<DT>;
using RefFn = std::function<DT(const DT& x, const Params& p)>;

struct CheckOptions {
  uint64_t seed = 1;
  bool twice = true;  // run forward/backward again: param grads double, dx does not
};

// Every check runs inside the arena of a CPU device with one worker thread, so it is exact and
// repeatable: how kernels behave across thread counts is test_kernels_cpu.cpp's subject.
template <class F>
void on_cpu(F&& body) {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  ctx.run([&] { body(ctx); });
}

std::unique_ptr<Model> wrap(DeviceContext& ctx, std::unique_ptr<Module> m, uint64_t seed) {
  auto model = std::make_unique<Model>(ModelSpec{"t", {}, 10}, std::move(m));
  model->materialize(ctx, seed);
  model->root().set_needs_input_grad(true);  // Model turns it off for a network's first layer
  return model;
}

std::vector<float> host_copy(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

std::vector<int64_t> pick(int64_t n, size_t max_count, std::mt19937_64& rng) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = i;
  if (idx.size() <= max_count) return idx;
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(max_count);
  return idx;
}

struct Mismatches {
  int count = 0, checked = 0;
  std::string first;
  void compare(const std::string& what, double analytic, double numeric, double rtol,
               double atol) {
    ++checked;
    if (std::fabs(analytic - numeric) <= atol + rtol * std::fabs(numeric)) return;
    if (count++ < 5)
      first += what + ": analytic " + std::to_string(analytic) + " numeric " +
               std::to_string(numeric) + "\n";
  }
};

// Randomises x, R and the parameters (U(-1, 1), exactly representable in float), then checks the
// forward, the input and parameter gradients, and gradient accumulation.
void gradcheck(DeviceContext& ctx, Model& m, const Shape& x_shape, const RefFn& ref,
               CheckOptions o = {}) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Params pd;
  for (Param* p : m.params()) {
    DT d(p->shape);
    for (int64_t i = 0; i < p->value.numel(); ++i) d.v[size_t(i)] = p->value.f32()[i] = u(rng);
    pd.push_back(d);
  }
  Tensor x = ctx.alloc(x_shape);
  DT xd(x_shape);
  for (int64_t i = 0; i < x.numel(); ++i) xd.v[size_t(i)] = x.f32()[i] = u(rng);

  // (a) forward
  Tensor y = m.forward(ctx, x);
  const DT yr = ref(xd, pd);
  REQUIRE(y.shape() == yr.shape);
  double worst = 0;
  for (int64_t i = 0; i < y.numel(); ++i)
    worst = std::max(worst, std::fabs(y.f32()[i] - yr.v[size_t(i)]) /
                                (1.0 + std::fabs(yr.v[size_t(i)])));
  INFO("forward output ", shape_str(y.shape()));
  CHECK(worst < 1e-5);

  // (b) backward against central differences of L = sum(ref(x) * R)
  Tensor dy = ctx.alloc(y.shape());
  std::vector<double> r(size_t(y.numel()));
  for (int64_t i = 0; i < y.numel(); ++i) r[size_t(i)] = dy.f32()[i] = u(rng);
  m.zero_grad(ctx);
  const std::vector<float> dx1 = host_copy(m.backward(ctx, dy));
  const std::vector<float> g1 = host_copy(m.flat_grads());
  REQUIRE(int64_t(dx1.size()) == x.numel());

  auto loss = [&](const DT& xx, const Params& pp) {
    DT out = ref(xx, pp);
    double s = 0;
    for (size_t i = 0; i < out.v.size(); ++i) s += out.v[i] * r[i];
    return s;
  };
  DT xp = xd;
  Params pp = pd;
  auto numeric = [&](DT& t, int64_t i) {  // central difference, eps 1e-6, in double
    const double keep = t.v[size_t(i)];
    t.v[size_t(i)] = keep + 1e-6;
    const double lp = loss(xp, pp);
    t.v[size_t(i)] = keep - 1e-6;
    const double lm = loss(xp, pp);
    t.v[size_t(i)] = keep;
    return (lp - lm) / 2e-6;
  };
  Mismatches bad;
  for (int64_t i : pick(x.numel(), 256, rng))
    bad.compare("dx[" + std::to_string(i) + "]", dx1[size_t(i)], numeric(xp, i), 1e-3, 1e-4);
  for (size_t k = 0; k < pp.size(); ++k) {
    const Param& p = *m.params()[k];
    for (int64_t i : pick(p.value.numel(), 50, rng))
      bad.compare(p.name + "[" + std::to_string(i) + "]", g1[size_t(p.offset + i)],
                  numeric(pp[k], i), 1e-3, 1e-4);
  }
  INFO("gradient mismatches (", bad.count, " of ", bad.checked, "):\n", bad.first);
  CHECK(bad.count == 0);
  CHECK(bad.checked > 0);

  if (!o.twice) return;
  // Parameter gradients accumulate; the input gradient is overwritten.
  m.forward(ctx, x);
  const std::vector<float> dx2 = host_copy(m.backward(ctx, dy));
  const std::vector<float> g2 = host_copy(m.flat_grads());
  int acc_bad = 0, nonzero = 0;
  for (size_t i = 0; i < g1.size(); ++i) {
    nonzero += g1[i] != 0.f;
    acc_bad += std::fabs(g2[i] - 2.0 * g1[i]) > 1e-6 * (1.0 + std::fabs(g1[i]));
  }
  CHECK(acc_bad == 0);
  if (!g1.empty()) CHECK(nonzero > 0);
  int dx_bad = 0;
  for (size_t i = 0; i < dx1.size(); ++i) dx_bad += std::fabs(dx2[i] - dx1[i]) > 1e-6;
  CHECK(dx_bad == 0);
}

void check_module(std::unique_ptr<Module> mod, const Shape& x_shape, const RefFn& ref,
                  CheckOptions o = {}) {
  on_cpu([&](DeviceContext& ctx) {
    auto m = wrap(ctx, std::move(mod), o.seed);
    gradcheck(ctx, *m, x_shape, ref, o);
  });
}

const Shape kImage = {3, 2, 7, 5};  // batch 3, 2 channels, 7x5

}  // namespace gradref
