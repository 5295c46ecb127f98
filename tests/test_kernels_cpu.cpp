// Direct checks of the CPU Backend's layer ops that the layer tests do not cover: linear layers,
// BatchNorm (with its fused residual and ReLU) and the optimizers give the same bits for 1, 2
// and 3 threads, the fused ops the bits of the ops they fuse, and an empty batch works.
// (Convolutions: test_conv_cpu.cpp; pooling: test_pooling_cpu.cpp; loss and metrics:
// test_loss_metrics_cpu.cpp; contexts and the op profile: test_cpu_context.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "layers/optimizer.h"

using namespace replica;
using namespace test;

TEST_CASE("linear forward/backward are bit-identical for 1, 2 and 3 threads") {
  const int64_t n = 100, in = 37, out = 19;
  std::vector<float> r = same_for_all_thread_counts([&](DeviceContext& ctx) {
    Tensor x = make(ctx, {n, in}, 1), w = make(ctx, {out, in}, 2), b = make(ctx, {out}, 3);
    Tensor y = ctx.alloc({n, out}), dy = make(ctx, {n, out}, 4), dx = ctx.alloc({n, in});
    Tensor dw = make(ctx, {out, in}, 5), db = make(ctx, {out}, 6);
    ctx.ops().linear_forward(ctx, x, w, b, y);
    ctx.ops().linear_backward(ctx, x, w, dy, dx, dw, db);
    std::vector<float> v;
    for (const Tensor* t : {&y, &dx, &dw, &db}) append(v, *t);
    return v;
  });
  // db accumulated onto its initial values
  const std::vector<float> dy = random_values(n * out, 4), db0 = random_values(out, 6);
  for (int64_t o = 0; o < out; ++o) {
    double s = db0[size_t(o)];
    for (int64_t i = 0; i < n; ++i) s += dy[size_t(i * out + o)];
    CHECK(r[size_t(n * out + n * in + out * in + o)] == doctest::Approx(s).epsilon(1e-5));
  }
}


TEST_CASE("linear backward skips the gradients it is not given (frozen input or weight)") {
  const int64_t n = 9, in = 6, out = 4;
  std::vector<float> r = same_for_all_thread_counts([&](DeviceContext& ctx) {
    Tensor x = make(ctx, {n, in}, 1), w = make(ctx, {out, in}, 2), dy = make(ctx, {n, out}, 4);
    Tensor dx = ctx.alloc({n, in}), dw = make(ctx, {out, in}, 5);
    Tensor db_all = make(ctx, {out}, 6), db_only = make(ctx, {out}, 6), none;
    ctx.ops().linear_backward(ctx, x, w, dy, dx, dw, db_all);
    ctx.ops().linear_backward(ctx, x, w, dy, none, none, db_only);  // the bias alone
    Tensor dw_only = make(ctx, {out, in}, 5);
    ctx.ops().linear_backward(ctx, x, w, dy, none, dw_only, none);  // the weight alone
    std::vector<float> v;
    for (const Tensor* t : {&db_all, &db_only, &dw, &dw_only}) append(v, *t);
    return v;
  });
  for (int64_t o = 0; o < out; ++o) CHECK(r[size_t(o)] == r[size_t(out + o)]);
  for (int64_t i = 0; i < out * in; ++i)
    CHECK(r[size_t(2 * out + i)] == r[size_t(2 * out + out * in + i)]);
}


TEST_CASE("batchnorm train forward and backward are bit-identical for 1, 2 and 3 threads") {
  const Shape xs = {13, 5, 6, 6};
  std::vector<float> r = same_for_all_thread_counts([&](DeviceContext& ctx) {
    Tensor x = make(ctx, xs, 1), gamma = make(ctx, {5}, 2), beta = make(ctx, {5}, 3);
    Tensor rm = make(ctx, {5}, 4), rv = make(ctx, {5}, std::vector<float>(5, 1.f));
    Tensor y = ctx.alloc(xs), mean = ctx.alloc({5}), invstd = ctx.alloc({5});
    Tensor dy = make(ctx, xs, 5), dx = ctx.alloc(xs);
    Tensor dg = make(ctx, {5}, 6), dbeta = make(ctx, {5}, 7);
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd,
                                      Tensor(), false);
    ctx.ops().batchnorm_backward(ctx, x, gamma, mean, invstd, dy, Tensor(), dx, dg, dbeta);
    Tensor ye = ctx.alloc(xs);
    ctx.ops().batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, ye, Tensor(), false);
    // And with a fused ReLU.
    Tensor yr = ctx.alloc(xs), dxr = ctx.alloc(xs), yer = ctx.alloc(xs);
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, yr, mean, invstd,
                                      Tensor(), true);
    ctx.ops().batchnorm_backward(ctx, x, gamma, mean, invstd, dy, yr, dxr, dg, dbeta);
    ctx.ops().batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, yer, Tensor(), true);
    // And with a residual summed before the ReLU.
    Tensor res = make(ctx, xs, 8), ys = ctx.alloc(xs);
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, ys, mean, invstd,
                                      res, true);
    std::vector<float> v;
    for (const Tensor* t :
         {&y, &mean, &invstd, &rm, &rv, &dx, &dg, &dbeta, &ye, &yr, &dxr, &yer, &ys})
      append(v, *t);
    return v;
  });
  // y is normalised: per channel, (y - beta) / gamma has mean 0 and variance ~1.
  const std::vector<float> gamma = random_values(5, 2), beta = random_values(5, 3);
  for (int64_t c = 0; c < 5; ++c) {
    double s = 0, s2 = 0;
    for (int64_t n = 0; n < 13; ++n)
      for (int64_t i = 0; i < 36; ++i) {
        double z = (r[size_t((n * 5 + c) * 36 + i)] - beta[size_t(c)]) / gamma[size_t(c)];
        s += z;
        s2 += z * z;
      }
    CHECK(std::fabs(s / 468) < 1e-4);
    CHECK(s2 / 468 == doctest::Approx(1.0).epsilon(1e-3));
  }
}


// A residual block's last BatchNorm, its sum and its ReLU in one pass (`residual`): the numbers
// of batchnorm, add and relu_forward in turn, to the bit, in training and evaluation, with and
// without the ReLU; a residual of another size is an error.
TEST_CASE("batchnorm with a residual is batchnorm, add, then relu, bit for bit") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  auto& ops = ctx.ops();
  const Shape xs{6, 4, 9, 7};
  const int64_t C = xs[1];
  Tensor x = make(ctx, xs, 21), r = make(ctx, xs, 22);
  Tensor gamma = make(ctx, {C}, 23), beta = make(ctx, {C}, 24);
  for (const bool relu : {false, true}) {
    CAPTURE(relu);
    std::vector<float> runs[2][2];  // [fused][train y, eval y]
    for (const bool fused : {false, true}) {
      Tensor rm = make(ctx, {C}, 25), rv = make(ctx, {C}, std::vector<float>(size_t(C), 1.f));
      Tensor mean = ctx.alloc({C}), invstd = ctx.alloc({C});
      Tensor y = ctx.alloc(xs), ye = ctx.alloc(xs);
      if (fused) {
        ops.batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd, r,
                                    relu);
        ops.batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, ye, r, relu);
      } else {  // the three ops in turn
        ops.batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd,
                                    Tensor(), false);
        ops.batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, ye, Tensor(), false);
        for (Tensor* t : {&y, &ye}) {
          ops.add(ctx, *t, r, 1.f);
          if (relu) ops.relu_forward(ctx, *t, *t);
        }
      }
      runs[fused][0] = values(y);
      runs[fused][1] = values(ye);
    }
    CHECK(runs[1][0] == runs[0][0]);
    CHECK(runs[1][1] == runs[0][1]);
    if (relu)  // the ReLU cut something off
      CHECK(std::count(runs[1][0].begin(), runs[1][0].end(), 0.f) > 0);
  }
  Tensor rm = ctx.alloc({C}), rv = ctx.alloc({C}), mean = ctx.alloc({C}), invstd = ctx.alloc({C});
  Tensor y = ctx.alloc(xs), wrong = ctx.alloc({5});
  CHECK_THROWS_AS(ops.batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean,
                                              invstd, wrong, true),
                  Error);
  CHECK_THROWS_AS(ops.batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, y, wrong, true),
                  Error);
}


// ResNet's BatchNorm + ReLU pairs run as one op with `relu`: the numbers must be those of the
// two ops in turn, to the bit (forward in training and evaluation, and backward, where the
// ReLU's gradient mask is read from the fused output).
TEST_CASE("batchnorm with a fused ReLU is batchnorm then relu, bit for bit") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  auto& ops = ctx.ops();
  for (const Shape& xs : {Shape{7, 3, 5, 4}, Shape{9, 6}}) {
    CAPTURE(shape_str(xs));
    const int64_t C = xs[1];
    Tensor x = make(ctx, xs, 11), gamma = make(ctx, {C}, 12), beta = make(ctx, {C}, 13);
    Tensor dy = make(ctx, xs, 14);
    std::vector<float> runs[2][3];  // [fused][y, dx and gradients, eval y]
    for (const bool fused : {false, true}) {
      Tensor rm = make(ctx, {C}, 15), rv = make(ctx, {C}, std::vector<float>(size_t(C), 1.f));
      Tensor mean = ctx.alloc({C}), invstd = ctx.alloc({C}), y = ctx.alloc(xs);
      Tensor dx = ctx.alloc(xs), dg = make(ctx, {C}, 16), db = make(ctx, {C}, 17);
      Tensor ye = ctx.alloc(xs);
      ops.batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd,
                                  Tensor(), fused);
      Tensor out = y, g = dy;
      if (!fused) {  // the two layers: ReLU after BatchNorm, its backward before
        out = ctx.alloc(xs);
        ops.relu_forward(ctx, y, out);
        g = ctx.alloc(xs);
        ops.relu_backward(ctx, out, dy, g);
      }
      ops.batchnorm_backward(ctx, x, gamma, mean, invstd, g, fused ? out : Tensor(), dx, dg, db);
      ops.batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, ye, Tensor(), fused);
      if (!fused) ops.relu_forward(ctx, ye, ye);
      runs[fused][0] = values(out);
      runs[fused][1] = values(dx);
      for (const Tensor* t : {&dg, &db, &rm, &rv}) append(runs[fused][1], *t);
      runs[fused][2] = values(ye);
    }
    int zeros = 0;
    for (float v : runs[1][0]) zeros += v == 0.f;
    CHECK(zeros > 0);  // the ReLU cut something off
    CHECK(zeros < int(runs[1][0].size()));
    for (int k = 0; k < 3; ++k) {
      CAPTURE(k);
      REQUIRE(runs[0][k].size() == runs[1][k].size());
      CHECK(std::memcmp(runs[0][k].data(), runs[1][k].data(), runs[0][k].size() * 4) == 0);
    }
  }
}


// A NaN reaching a ReLU stays NaN, as PyTorch's ReLU keeps it (negatives and -0 become +0), in
// relu_forward and in the ReLU fused into batch norm, on planes the lanes take (2x2) and planes
// the loops take (3x3): a NaN made 0 hid a diverged run, its loss finite while its weights were
// NaN. The channel holding a NaN is NaN whole after the normalisation.
TEST_CASE("a ReLU keeps NaN, alone and fused into batch norm") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = make(ctx, {5}, std::vector<float>{nan, -1.f, -0.f, 2.f, 0.f}), y = ctx.alloc({5});
  ctx.ops().relu_forward(ctx, x, y);
  const std::vector<float> yv = values(y);
  CHECK(std::isnan(yv[0]));
  CHECK(yv[1] == 0.f);
  CHECK_FALSE(std::signbit(yv[2]));
  CHECK(yv[3] == 2.f);
  for (const Shape& xs : {Shape{3, 9, 2, 2}, Shape{3, 9, 3, 3}}) {
    CAPTURE(shape_str(xs));
    std::vector<float> xv = random_values(shape_numel(xs), 21);
    xv[size_t(xs[2] * xs[3]) * 4 + 1] = nan;  // sample 0, channel 4
    Tensor xb = make(ctx, xs, xv), gamma = make(ctx, {9}, 22), beta = make(ctx, {9}, 23);
    Tensor rm = make(ctx, {9}, 24), rv = make(ctx, {9}, std::vector<float>(9, 1.f));
    Tensor yb = ctx.alloc(xs), mean = ctx.alloc({9}), invstd = ctx.alloc({9});
    ctx.ops().batchnorm_forward_train(ctx, xb, gamma, beta, rm, rv, 0.1f, 1e-5f, yb, mean,
                                      invstd, Tensor(), true);
    const std::vector<float> out = values(yb);
    const int64_t hw = xs[2] * xs[3];
    int nans = 0, zeros = 0;
    for (int64_t n = 0; n < xs[0]; ++n)
      for (int64_t c = 0; c < 9; ++c)
        for (int64_t i = 0; i < hw; ++i) {
          const float v = out[size_t((n * 9 + c) * hw + i)];
          if (c == 4) {
            nans += std::isnan(v);
          } else {
            zeros += v == 0.f;
            CHECK_FALSE(std::isnan(v));
          }
        }
    CHECK(nans == xs[0] * hw);
    CHECK(zeros > 0);  // elsewhere the ReLU still cuts negatives off
  }
}

TEST_CASE("adam_step and sgd_step are bit-identical for 1, 2 and 3 threads") {
  const int64_t n = 100003;  // several grains of 16384, the last one partial
  same_for_all_thread_counts([&](DeviceContext& ctx) {
    Tensor p = make(ctx, {n}, 1), m = ctx.alloc({n}), v = ctx.alloc({n});
    ctx.ops().fill(ctx, m, 0.f);
    ctx.ops().fill(ctx, v, 0.f);
    Tensor q = make(ctx, {n}, 1), buf = ctx.alloc({n});
    const AdamConfig adam{0.01f, 0.9f, 0.999f, 1e-8f, 0.01f};
    const SgdConfig sgd{0.1f, 0.9f, 0.f, 1e-4f, true};
    Tensor scalars = ctx.alloc({2});
    for (int step = 1; step <= 3; ++step) {
      Tensor g = make(ctx, {n}, uint32_t(10 + step));
      write_step_scalars(ctx, scalars, adam_step_scalars(adam, step));
      ctx.ops().adam_step(ctx, p, g, m, v, adam, scalars);
      write_step_scalars(ctx, scalars, sgd_step_scalars(sgd, step == 1));
      ctx.ops().sgd_step(ctx, q, g, buf, sgd, scalars);
    }
    std::vector<float> out;
    for (const Tensor* t : {&p, &m, &v, &q, &buf}) append(out, *t);
    return out;
  });
}


TEST_CASE("an empty batch (N = 0) works for linear, conv2d, relu, pooling and the loss") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  Backend& ops = ctx.ops();
  Tensor w = make(ctx, {3, 5}, 1), b = make(ctx, {3}, 2);
  Tensor dw = make(ctx, {3, 5}, 3), db = make(ctx, {3}, 4);
  const std::vector<float> dw0 = values(dw), db0 = values(db);
  Tensor x = ctx.alloc({0, 5}), y = ctx.alloc({0, 3});
  Tensor dy = ctx.alloc({0, 3}), dx = ctx.alloc({0, 5});
  ops.linear_forward(ctx, x, w, b, y);
  ops.linear_backward(ctx, x, w, dy, dx, dw, db);
  CHECK(values(dw) == dw0);  // += nothing
  CHECK(values(db) == db0);

  Tensor cw = make(ctx, {4, 2, 3, 3}, 5), cb = make(ctx, {4}, 6);
  Tensor cdw = make(ctx, {4, 2, 3, 3}, 7), cdb = make(ctx, {4}, 8);
  const std::vector<float> cdw0 = values(cdw), cdb0 = values(cdb);
  Tensor cx = ctx.alloc({0, 2, 7, 5}), cy = ctx.alloc({0, 4, 4, 3});
  Tensor cdy = ctx.alloc({0, 4, 4, 3}), cdx = ctx.alloc({0, 2, 7, 5});
  ops.conv2d_forward(ctx, cx, cw, cb, cy, Conv2dParams{2, 1});
  ops.conv2d_backward(ctx, cx, cw, cdy, cdx, cdw, cdb, Conv2dParams{2, 1}, InputGrad::Overwrite);
  CHECK(values(cdw) == cdw0);
  CHECK(values(cdb) == cdb0);

  ops.relu_forward(ctx, cx, cdx);
  ops.relu_backward(ctx, cx, cdx, cdx);
  Tensor py = ctx.alloc({0, 2, 4, 3});
  ops.maxpool2d_forward(ctx, cx, py, Pool2dParams{3, 2, 1});
  ops.maxpool2d_backward(ctx, cx, py, py, cdx, Pool2dParams{3, 2, 1});
  Tensor ay = ctx.alloc({0, 2, 1, 1});
  ops.adaptive_avgpool2d_forward(ctx, cx, ay);

  Tensor logits = ctx.alloc({0, 10}), probs = ctx.alloc({0, 10}), loss = ctx.alloc({1});
  Tensor labels = ctx.alloc({0}, DType::I32), correct = ctx.alloc({1}, DType::I32);
  ops.cross_entropy_forward(ctx, logits, labels, probs, loss);
  CHECK(loss.f32()[0] == 0.f);  // defined, not NaN
  correct.i32()[0] = 2;
  ops.count_correct(ctx, logits, labels, correct);
  CHECK(correct.i32()[0] == 2);

  // Batch statistics of nothing are an error, not a crash.
  Tensor g = make(ctx, {2}, 9), be = make(ctx, {2}, 10), rm = ctx.alloc({2}), rv = ctx.alloc({2});
  Tensor m = ctx.alloc({2}), is = ctx.alloc({2});
  CHECK_THROWS_AS(
      ops.batchnorm_forward_train(ctx, cx, g, be, rm, rv, 0.1f, 1e-5f, cdx, m, is, Tensor(), false),
      Error);
}


TEST_CASE("batchnorm takes [N, C, L] as the op list says, as [N, C, L, 1]") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  const Tensor x3 = make(ctx, {4, 3, 5}, 7);
  Tensor x4 = x3.reshape({4, 3, 5, 1});
  std::vector<float> out[2];
  for (int k = 0; k < 2; ++k) {
    const Tensor& x = k == 0 ? x3 : x4;
    Tensor gamma = make(ctx, {3}, 8), beta = make(ctx, {3}, 9);
    Tensor rm = ctx.alloc({3}), rv = ctx.alloc({3});
    ctx.ops().fill(ctx, rm, 0.f);
    ctx.ops().fill(ctx, rv, 1.f);
    Tensor y = ctx.alloc(x.shape()), mean = ctx.alloc({3}), invstd = ctx.alloc({3});
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd,
                                      Tensor(), /*relu=*/true);
    for (const Tensor* t : {&y, &rm, &rv, &mean, &invstd}) append(out[k], *t);
  }
  REQUIRE(out[0].size() == out[1].size());
  CHECK(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)) == 0);
}
