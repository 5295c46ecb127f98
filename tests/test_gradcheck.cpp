// Finite-difference gradient checks for every leaf layer. Each layer has a naive double-precision
// reference forward (gradcheck_support.h); the engine's float32 forward must match it, and the
// engine's analytic backward must match central differences of the reference (in double) of
// L = sum(forward(x) * R). Odd shapes on purpose: batch 3, 7x5 images, stride 2, padding 1.
#include "gradcheck_support.h"

using namespace replica;
using namespace gradref;

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
                 Case{1, 1, 0, true}, Case{1, 2, 0, false}, Case{5, 2, 2, true},
                 // stride 3; a 7x7 kernel wider than the 5-column input (whole rows padding)
                 Case{3, 3, 2, false}, Case{7, 2, 3, true}}) {
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
