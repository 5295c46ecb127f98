// Finite-difference gradient checks for every layer. Each layer has a naive double-precision
// reference forward written here; the engine's float32 forward must match it, and the engine's
// analytic backward must match central differences of the reference (in double) of
// L = sum(forward(x) * R). Odd shapes on purpose: batch 3, 7x5 images, stride 2, padding 1.
// Whole models are checked against float32 differences of the engine's own loss.
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

using namespace replica;

namespace {

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

}  // namespace

// ---- leaf layers ----------------------------------------------------------------------------

TEST_CASE("gradcheck: Linear with and without bias") {
  check_module(std::make_unique<Linear>(7, 4), {3, 7},
               [](const DT& x, const Params& p) { return ref_linear(x, p[0], &p[1]); });
  check_module(std::make_unique<Linear>(7, 4, false), {3, 7},
               [](const DT& x, const Params& p) { return ref_linear(x, p[0], nullptr); });
}

TEST_CASE("gradcheck: Conv2d over strides, paddings, kernels and the pointwise path") {
  struct Case { int k, s, pad; bool bias; };
  for (Case c : {Case{3, 2, 1, true}, Case{3, 1, 0, false}, Case{3, 1, 1, true},
                 Case{1, 1, 0, true}, Case{1, 2, 0, false}, Case{5, 2, 2, true}}) {
    INFO("kernel ", c.k, " stride ", c.s, " padding ", c.pad, " bias ", c.bias);
    check_module(std::make_unique<Conv2d>(2, 3, c.k, c.s, c.pad, c.bias), kImage,
                 [c](const DT& x, const Params& p) {
                   return ref_conv2d(x, p[0], c.bias ? &p[1] : nullptr, c.s, c.pad);
                 });
  }
}

TEST_CASE("gradcheck: BatchNorm2d in training mode, 4-d and 2-d input") {
  check_module(std::make_unique<BatchNorm2d>(2), kImage,
               [](const DT& x, const Params& p) { return ref_batchnorm(x, p[0], p[1]); });
  check_module(std::make_unique<BatchNorm2d>(4), {3, 4},
               [](const DT& x, const Params& p) { return ref_batchnorm(x, p[0], p[1]); });
}

TEST_CASE("gradcheck: ReLU, Flatten") {
  check_module(std::make_unique<ReLU>(), kImage,
               [](const DT& x, const Params&) { return ref_relu(x); });
  check_module(std::make_unique<Flatten>(), kImage,
               [](const DT& x, const Params&) { return ref_reshape(x, {3, 70}); });
}

TEST_CASE("gradcheck: MaxPool2d with padding and with dropped edges") {
  check_module(std::make_unique<MaxPool2d>(3, 2, 1), kImage,
               [](const DT& x, const Params&) { return ref_maxpool(x, 3, 2, 1); });
  check_module(std::make_unique<MaxPool2d>(2, 2), kImage,
               [](const DT& x, const Params&) { return ref_maxpool(x, 2, 2, 0); });
}

TEST_CASE("MaxPool2d: ties send the gradient to the first maximum of the window") {
  on_cpu([&](DeviceContext& ctx) {
    auto m = wrap(ctx, std::make_unique<MaxPool2d>(2, 2), 1);
    Tensor x = ctx.alloc({1, 1, 2, 4});
    // window 0: all 5; window 1: 2 at (0,3), (1,2) and (1,3)
    const float v[8] = {5, 5, 1, 2, 5, 5, 2, 2};
    std::copy(v, v + 8, x.f32());
    Tensor y = m->forward(ctx, x);
    CHECK(y.f32()[0] == 5.f);
    CHECK(y.f32()[1] == 2.f);
    Tensor dy = ctx.alloc({1, 1, 1, 2});
    dy.f32()[0] = 1.f;
    dy.f32()[1] = 10.f;
    std::vector<float> dx = host_copy(m->backward(ctx, dy));
    CHECK(dx == std::vector<float>{1, 0, 0, 10, 0, 0, 0, 0});
  });
}

TEST_CASE("gradcheck: AdaptiveAvgPool2d with overlapping, global and upsampling windows") {
  for (auto [oh, ow] : {std::pair<int64_t, int64_t>{3, 2}, {1, 1}, {4, 3}, {9, 6}}) {
    INFO("output ", oh, "x", ow);
    check_module(std::make_unique<AdaptiveAvgPool2d>(oh, ow), kImage,
                 [oh = oh, ow = ow](const DT& x, const Params&) {
                   return ref_adaptive_avgpool(x, oh, ow);
                 });
  }
}

TEST_CASE("gradcheck: Dropout with its mask fixed") {
  on_cpu([&](DeviceContext& ctx) {
    auto drop = std::make_unique<Dropout>(0.4f, 99);
    Dropout* d = drop.get();
    auto m = wrap(ctx, std::move(drop), 1);
    // The mask is what the first forward multiplies a tensor of ones by; replay that first call.
    Tensor ones = ctx.alloc(kImage);
    ctx.ops().fill(ctx, ones, 1.f);
    DT mask(kImage);
    Tensor mk = m->forward(ctx, ones);
    int zeros = 0;
    for (int64_t i = 0; i < mk.numel(); ++i) {
      mask.v[size_t(i)] = mk.f32()[i];
      zeros += mk.f32()[i] == 0.f;
      CHECK((mk.f32()[i] == 0.f || mk.f32()[i] == doctest::Approx(1.0 / 0.6).epsilon(1e-6)));
    }
    CHECK(zeros > 40);   // ~84 of 210 expected
    CHECK(zeros < 130);
    d->set_seed(99, 0);
    gradcheck(ctx, *m, kImage, [&](const DT& x, const Params&) {
      DT y = x;
      for (size_t i = 0; i < y.v.size(); ++i) y.v[i] *= mask.v[i];
      return y;
    }, CheckOptions{1, false});
  });
}

TEST_CASE("gradcheck: softmax cross-entropy mean, and the denominator for partial batches") {
  on_cpu([&](DeviceContext& ctx) {
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<float> u(-3.f, 3.f);
    Tensor logits = ctx.alloc({3, 5});
    DT ld({3, 5});
    for (int64_t i = 0; i < 15; ++i) ld.v[size_t(i)] = logits.f32()[i] = u(rng);
    Tensor labels = ctx.alloc({3}, DType::I32);
    const std::vector<int32_t> lab = {4, 0, 2};
    std::copy(lab.begin(), lab.end(), labels.i32());
    CrossEntropyLoss ce;
    Tensor loss = ce.forward(ctx, logits, labels);
    CHECK(loss.f32()[0] == doctest::Approx(ref_cross_entropy(ld, lab)).epsilon(1e-6));
    std::vector<float> g = host_copy(ce.backward(ctx));
    Mismatches bad;
    for (size_t i = 0; i < 15; ++i) {
      DT p = ld, q = ld;
      p.v[i] += 1e-6;
      q.v[i] -= 1e-6;
      bad.compare("dlogits", g[i], (ref_cross_entropy(p, lab) - ref_cross_entropy(q, lab)) / 2e-6,
                  1e-4, 1e-6);
    }
    INFO(bad.first);
    CHECK(bad.count == 0);
    // A part of a global batch of 12: the gradient of sum/12.
    ce.forward(ctx, logits, labels);
    std::vector<float> g12 = host_copy(ce.backward(ctx, 12));
    for (size_t i = 0; i < 15; ++i)
      CHECK(g12[i] == doctest::Approx(g[i] * 3.0 / 12.0).epsilon(1e-6));
  });
}

// ---- composite modules ------------------------------------------------------------------------

TEST_CASE("gradcheck: Sequential conv-bn-relu-maxpool-flatten-linear-relu-linear") {
  auto net = std::make_unique<Sequential>();
  net->add("conv", std::make_unique<Conv2d>(2, 3, 3, 2, 1));
  net->add("bn", std::make_unique<BatchNorm2d>(3));
  net->add("relu", std::make_unique<ReLU>());
  net->add("pool", std::make_unique<MaxPool2d>(3, 2, 1));
  net->add("flatten", std::make_unique<Flatten>());
  net->add("fc1", std::make_unique<Linear>(12, 5));
  net->add("relu2", std::make_unique<ReLU>());
  net->add("fc2", std::make_unique<Linear>(5, 4));
  check_module(std::move(net), kImage, [](const DT& x, const Params& p) {
    DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], &p[1], 2, 1), p[2], p[3]));
    h = ref_maxpool(h, 3, 2, 1);
    h = ref_reshape(h, {3, 12});
    h = ref_relu(ref_linear(h, p[4], &p[5]));
    return ref_linear(h, p[6], &p[7]);
  });
}

TEST_CASE("gradcheck: BasicBlock, identity shortcut and stride-2 downsample") {
  // params: conv1.weight, bn1.{weight,bias}, conv2.weight, bn2.{weight,bias}[, downsample]
  auto body = [](const DT& x, const Params& p, int stride) {
    DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], nullptr, stride, 1), p[1], p[2]));
    return ref_batchnorm(ref_conv2d(h, p[3], nullptr, 1, 1), p[4], p[5]);
  };
  check_module(std::make_unique<BasicBlock>(3, 3, 1), {3, 3, 7, 5},
               [&](const DT& x, const Params& p) { return ref_relu(ref_add(body(x, p, 1), x)); });
  check_module(std::make_unique<BasicBlock>(2, 3, 2), kImage, [&](const DT& x, const Params& p) {
    DT sc = ref_batchnorm(ref_conv2d(x, p[6], nullptr, 2, 0), p[7], p[8]);
    return ref_relu(ref_add(body(x, p, 2), sc));
  });
}

TEST_CASE("gradcheck: Bottleneck with stride 2 and downsample") {
  check_module(std::make_unique<Bottleneck>(4, 2, 2), {3, 4, 7, 5},
               [](const DT& x, const Params& p) {
                 DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], nullptr, 1, 0), p[1], p[2]));
                 h = ref_relu(ref_batchnorm(ref_conv2d(h, p[3], nullptr, 2, 1), p[4], p[5]));
                 h = ref_batchnorm(ref_conv2d(h, p[6], nullptr, 1, 0), p[7], p[8]);
                 DT sc = ref_batchnorm(ref_conv2d(x, p[9], nullptr, 2, 0), p[10], p[11]);
                 return ref_relu(ref_add(h, sc));
               });
}

// ---- whole models -----------------------------------------------------------------------------

namespace {

// Mean cross-entropy of the model's logits, accumulated in double.
double model_loss(DeviceContext& ctx, Model& m, const Tensor& x, const std::vector<int32_t>& lab) {
  Tensor logits = m.forward(ctx, x);
  DT ld(logits.shape());
  for (int64_t i = 0; i < logits.numel(); ++i) ld.v[size_t(i)] = logits.f32()[i];
  return ref_cross_entropy(ld, lab);
}

// Analytic gradients of 30 parameters (from 30 random parameter tensors, in each the element
// with the largest gradient among 16 random ones, so the signal stands above float32 noise)
// against float32 central differences of the model's mean loss, accumulated in double.
// The loss of a small ResNet in training mode is steep in places (BatchNorm over a handful of
// values), has kinks (ReLU, max-pool) and float32 limits how small a step can be, so no single
// step suits every parameter: each quotient is taken at a ladder of steps, the closest kept.
// Nearly all must agree to 2%, and none may be off by more than 20%.
void check_model(const std::string& name, const Shape& in, int64_t classes, int64_t batch) {
  on_cpu([&](DeviceContext& ctx) {
    auto m = make_model(name, in, classes);
    m->materialize(ctx, 17);
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    Shape xs = in;
    xs.insert(xs.begin(), batch);
    Tensor x = ctx.alloc(xs);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(rng);
    Tensor labels = ctx.alloc({batch}, DType::I32);
    std::vector<int32_t> lab;
    for (int64_t i = 0; i < batch; ++i)
      lab.push_back(labels.i32()[i] = int32_t((i * 7 + 3) % classes));

    CrossEntropyLoss ce;
    ce.forward(ctx, m->forward(ctx, x), labels);
    m->backward(ctx, ce.backward(ctx));
    const std::vector<float> g = host_copy(m->flat_grads());

    std::vector<const Param*> chosen(m->params().begin(), m->params().end());
    std::shuffle(chosen.begin(), chosen.end(), rng);
    for (size_t k = 0; chosen.size() < 30; ++k) chosen.push_back(chosen[k]);
    chosen.resize(30);

    Mismatches close, gross;
    double gmax = 0;
    for (const Param* p : chosen) {
      int64_t i = p->offset;
      for (int c = 0; c < 16; ++c) {
        int64_t j = p->offset + int64_t(rng() % uint64_t(p->value.numel()));
        if (std::fabs(g[size_t(j)]) > std::fabs(g[size_t(i)])) i = j;
      }
      const double analytic = g[size_t(i)];
      gmax = std::max(gmax, std::fabs(analytic));
      float* w = m->flat_params().f32() + i;
      const float keep = *w;
      double best = 0, best_err = std::numeric_limits<double>::infinity();
      for (float h : {1e-2f, 3e-3f, 1e-3f, 3e-4f, 1e-4f, 3e-5f, 1e-5f}) {
        const float up = keep + h, down = keep - h;
        *w = up;
        const double lp = model_loss(ctx, *m, x, lab);
        *w = down;
        const double lm = model_loss(ctx, *m, x, lab);
        *w = keep;
        const double fd = (lp - lm) / (double(up) - double(down));
        const double err = std::fabs(fd - analytic) / (std::fabs(fd) + 1e-3);
        if (err < best_err) best_err = err, best = fd;
        if (std::fabs(fd - analytic) <= 2e-2 * std::fabs(fd) + 1e-3) break;  // close enough
      }
      const std::string what = p->name + "[" + std::to_string(i - p->offset) + "]";
      close.compare(what, analytic, best, 2e-2, 1e-3);
      gross.compare(what, analytic, best, 0.2, 5e-3);
    }
    INFO(name, ": ", close.count, " of ", close.checked, " differ by more than 2%:\n", close.first);
    CHECK(close.count <= 3);
    CHECK(gross.count == 0);
    CHECK(gmax > 1e-2);
  });
}

}  // namespace

TEST_CASE("gradcheck: whole cnn model against finite differences of its loss") {
  check_model("cnn", {1, 12, 12}, 4, 3);
}

TEST_CASE("gradcheck: whole resnet18 (MNIST variant) against finite differences of its loss") {
  check_model("resnet18", {1, 28, 28}, 10, 4);
}

// ---- the grad hook ------------------------------------------------------------------------------

namespace {

struct HookLog {
  std::vector<std::vector<std::string>> groups;
  std::map<const Param*, int> times;
  std::map<const Param*, std::vector<float>> at_report;  // the gradient when it was reported
};

void install(Model& m, HookLog& log) {
  m.set_grad_hook([&log](const std::vector<Param*>& ps) {
    std::vector<std::string> names;
    for (Param* p : ps) {
      names.push_back(p->name);
      ++log.times[p];
      log.at_report[p] = host_copy(p->grad);
    }
    log.groups.push_back(names);
  });
}

}  // namespace

TEST_CASE("grad hook: BasicBlock reports each parameter once, in reverse, after its backward") {
  on_cpu([&](DeviceContext& ctx) {
    auto m = wrap(ctx, std::make_unique<BasicBlock>(2, 3, 2), 4);
    HookLog log;
    install(*m, log);
    Tensor x = ctx.alloc(kImage);
    std::mt19937_64 rng(8);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = u(rng);
    Tensor y = m->forward(ctx, x);
    Tensor dy = ctx.alloc(y.shape());
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = u(rng);
    CHECK(log.groups.empty());  // forward reports nothing
    m->backward(ctx, dy);
    const std::vector<std::vector<std::string>> expected = {
        {"downsample.1.weight", "downsample.1.bias"}, {"downsample.0.weight"},
        {"bn2.weight", "bn2.bias"}, {"conv2.weight"}, {"bn1.weight", "bn1.bias"}, {"conv1.weight"}};
    CHECK(log.groups == expected);
    for (const Param* p : m->params()) {
      CAPTURE(p->name);
      CHECK(log.times[p] == 1);
      CHECK(log.at_report[p] == host_copy(p->grad));  // final when reported
    }
  });
}

TEST_CASE("grad hook: resnet18 reports all 62 parameters once per backward, fc first, conv1 last") {
  on_cpu([&](DeviceContext& ctx) {
    auto m = make_model("resnet18", {1, 28, 28}, 10);
    m->materialize(ctx, 2);
    HookLog log;
    install(*m, log);
    Tensor x = ctx.alloc({2, 1, 28, 28});
    std::mt19937_64 rng(9);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(rng);
    for (int round = 1; round <= 2; ++round) {
      CAPTURE(round);
      log.groups.clear();
      Tensor y = m->forward(ctx, x);
      Tensor dy = ctx.alloc(y.shape());
      for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(rng);
      m->backward(ctx, dy);
      REQUIRE(m->params().size() == 62);
      CHECK(log.times.size() == 62);
      for (const Param* p : m->params()) {
        CAPTURE(p->name);
        CHECK(log.times[p] == round);
        CHECK(log.at_report[p] == host_copy(p->grad));
      }
      REQUIRE(!log.groups.empty());
      CHECK(log.groups.front() == std::vector<std::string>{"fc.weight", "fc.bias"});
      CHECK(log.groups.back() == std::vector<std::string>{"conv1.weight"});
      CHECK(log.groups[log.groups.size() - 2] ==
            std::vector<std::string>{"bn1.weight", "bn1.bias"});
    }
  });
}
