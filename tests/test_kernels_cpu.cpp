// Direct checks of the CPU Backend that the layer tests do not cover: results independent of
// the thread count (bit for bit), loss and metric edge cases, padded max-pooling, empty batches,
// and the op profile that times each call.
#include <doctest/doctest.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "engine/ops.h"
#include "layers/optimizer.h"

using namespace replica;

namespace {

std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(size_t(n), 0.f);
  for (auto& x : v) x = u(rng);
  return v;
}

Tensor make(DeviceContext& ctx, const Shape& s, const std::vector<float>& v) {
  Tensor t = ctx.alloc(s);
  REQUIRE(int64_t(v.size()) == t.numel());
  if (!v.empty()) std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t;
}
Tensor make(DeviceContext& ctx, const Shape& s, uint32_t seed) {
  return make(ctx, s, random_values(shape_numel(s), seed));
}
std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// Runs `op` (which returns the tensors it produced, flattened) in contexts with 1, 2 and (on
// machines with the cores for it) 3 threads, inside each context's arena, and requires
// bit-identical results.
template <class Op>
std::vector<float> same_for_all_thread_counts(Op op) {
  std::vector<float> first;
  std::vector<int> counts = {1, 2};
  if (std::thread::hardware_concurrency() >= 3) counts.push_back(3);
  for (int threads : counts) {
    CAPTURE(threads);
    DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{threads});
    REQUIRE(ctx.threads() == threads);
    std::vector<float> out;
    ctx.run([&] { out = op(ctx); });
    if (threads == 1) {
      first = out;
      continue;
    }
    REQUIRE(out.size() == first.size());
    CHECK(std::memcmp(out.data(), first.data(), out.size() * sizeof(float)) == 0);
  }
  return first;
}

void append(std::vector<float>& out, const Tensor& t) {
  out.insert(out.end(), t.f32(), t.f32() + t.numel());
}

}  // namespace

TEST_CASE("conv2d forward/backward are bit-identical for 1, 2 and 3 threads (batch 13)") {
  struct Case { int64_t c, k; int r, stride, pad; };
  // 9x9 input: 81 output pixels go one sample per GEMM; stride 2 (25 pixels) goes through the
  // batched path, whose GEMMs split over output rows (k) and input rows (crr) in tasks of 32
  // rows, or an eighth of them from 256 rows up (the last case: 520 and 576 rows).
  for (Case cs : {Case{3, 4, 3, 1, 1}, Case{3, 5, 3, 2, 1}, Case{6, 4, 1, 1, 0},
                  Case{8, 70, 3, 2, 1}, Case{40, 66, 1, 2, 0}, Case{64, 520, 3, 2, 1}}) {
    CAPTURE(cs.r);
    CAPTURE(cs.stride);
    CAPTURE(cs.k);
    const Shape xs = {13, cs.c, 9, 9}, ws = {cs.k, cs.c, cs.r, cs.r};
    const Conv2dParams prm{cs.stride, cs.pad};
    const int64_t p = window_out(9, cs.r, cs.stride, cs.pad);
    const Shape ys = {13, cs.k, p, p};
    std::vector<float> out = same_for_all_thread_counts([&](DeviceContext& ctx) {
      Tensor x = make(ctx, xs, 1), w = make(ctx, ws, 2), b = make(ctx, {cs.k}, 3);
      Tensor y = ctx.alloc(ys), dy = make(ctx, ys, 4), dx = ctx.alloc(xs);
      Tensor dw = make(ctx, ws, 5), db = make(ctx, {cs.k}, 6);  // += onto what is there
      ctx.ops().conv2d_forward(ctx, x, w, b, y, prm);
      ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, prm, InputGrad::Overwrite);
      std::vector<float> r;
      for (const Tensor* t : {&y, &dx, &dw, &db}) append(r, *t);
      return r;
    });
    // And the results are right: db = initial + sum of dy, dw[0] against a direct sum.
    const std::vector<float> x = random_values(shape_numel(xs), 1);
    const std::vector<float> dy = random_values(shape_numel(ys), 4);
    const int64_t ny = shape_numel(ys), nx = shape_numel(xs), nw = shape_numel(ws);
    const float* db = out.data() + ny + nx + nw;
    const std::vector<float> db0 = random_values(cs.k, 6), dw0 = random_values(nw, 5);
    for (int64_t k = 0; k < cs.k; ++k) {
      double s = db0[size_t(k)];
      for (int64_t n = 0; n < 13; ++n)
        for (int64_t i = 0; i < p * p; ++i) s += dy[size_t((n * cs.k + k) * p * p + i)];
      CHECK(db[k] == doctest::Approx(s).epsilon(1e-4));
    }
    double dw00 = dw0[0];  // dw[k=0, c=0, 0, 0]
    for (int64_t n = 0; n < 13; ++n)
      for (int64_t oy = 0; oy < p; ++oy)
        for (int64_t ox = 0; ox < p; ++ox) {
          int64_t iy = oy * cs.stride - cs.pad, ix = ox * cs.stride - cs.pad;
          if (iy < 0 || ix < 0) continue;
          dw00 += double(dy[size_t((n * cs.k) * p * p + oy * p + ox)]) *
                  x[size_t((n * cs.c) * 81 + iy * 9 + ix)];
        }
    CHECK(out[size_t(ny + nx)] == doctest::Approx(dw00).epsilon(1e-4));
  }
}

TEST_CASE("conv2d on rows of 8+ output columns (copied as runs) equals a direct convolution") {
  // Stride-1 rows this wide go through im2col's and col2im's run loops: zero fill, contiguous
  // copy, zero fill, the bounds worked out per kernel column; the strided cases check the
  // element loops on the same shapes. Non-square input, so the column bounds come from the
  // width; padding up to and beyond the kernel's reach.
  struct Case { int r, stride, pad; };
  for (Case cs : {Case{3, 1, 1}, Case{5, 2, 2}, Case{3, 2, 0}, Case{1, 2, 0}, Case{7, 3, 3},
                  Case{4, 1, 4}, Case{5, 1, 0}}) {
    CAPTURE(cs.r);
    CAPTURE(cs.stride);
    CAPTURE(cs.pad);
    const int64_t n = 2, c = 2, k = 3, h = 22, w = 26;
    const int64_t p = window_out(h, cs.r, cs.stride, cs.pad);
    const int64_t q = window_out(w, cs.r, cs.stride, cs.pad);
    REQUIRE(q >= 8);
    const Shape xs = {n, c, h, w}, ws = {k, c, cs.r, cs.r}, ys = {n, k, p, q};
    DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
    {  // NaN in the blocks the kernels' column buffers (c*r*r x p*q per task) will get from the
       // caching allocator: a column left unwritten shows.
      std::vector<Tensor> dirty;
      for (int t = 0; t < 4; ++t) dirty.push_back(ctx.alloc({c * cs.r * cs.r * p * q}));
      for (Tensor& t : dirty) ctx.ops().fill(ctx, t, std::numeric_limits<float>::quiet_NaN());
    }
    Tensor x = make(ctx, xs, 7), wt = make(ctx, ws, 8), b = make(ctx, {k}, 9);
    Tensor y = ctx.alloc(ys), dy = make(ctx, ys, 10), dx = ctx.alloc(xs);
    Tensor dw = ctx.alloc(ws), db = ctx.alloc({k});
    ctx.ops().fill(ctx, dw, 0.f);
    ctx.ops().fill(ctx, db, 0.f);
    const Conv2dParams prm{cs.stride, cs.pad};
    ctx.run([&] {
      ctx.ops().conv2d_forward(ctx, x, wt, b, y, prm);
      ctx.ops().conv2d_backward(ctx, x, wt, dy, dx, dw, db, prm, InputGrad::Overwrite);
    });
    std::vector<double> ry(size_t(shape_numel(ys)), 0.0), rdx(size_t(shape_numel(xs)), 0.0);
    auto at_x = [&](int64_t b_, int64_t c_, int64_t iy, int64_t ix) {
      return size_t(((b_ * c + c_) * h + iy) * w + ix);
    };
    for (int64_t b_ = 0; b_ < n; ++b_)
      for (int64_t k_ = 0; k_ < k; ++k_)
        for (int64_t oy = 0; oy < p; ++oy)
          for (int64_t ox = 0; ox < q; ++ox) {
            const size_t yi = size_t(((b_ * k + k_) * p + oy) * q + ox);
            double sum = b.f32()[k_];
            for (int64_t c_ = 0; c_ < c; ++c_)
              for (int64_t i = 0; i < cs.r; ++i)
                for (int64_t j = 0; j < cs.r; ++j) {
                  const int64_t iy = oy * cs.stride - cs.pad + i;
                  const int64_t ix = ox * cs.stride - cs.pad + j;
                  if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                  const float wv = wt.f32()[((k_ * c + c_) * cs.r + i) * cs.r + j];
                  sum += double(wv) * x.f32()[at_x(b_, c_, iy, ix)];
                  rdx[at_x(b_, c_, iy, ix)] += double(wv) * dy.f32()[yi];
                }
            ry[yi] = sum;
          }
    for (size_t i = 0; i < ry.size(); ++i)
      REQUIRE(y.f32()[i] == doctest::Approx(ry[i]).epsilon(1e-4));
    for (size_t i = 0; i < rdx.size(); ++i)
      REQUIRE(dx.f32()[i] == doctest::Approx(rdx[i]).epsilon(1e-4));
  }
}

TEST_CASE("conv2d backward adding onto dx: the bits of a backward and an add, dw and db once") {
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (int stride : {1, 2}) {  // 9x9 stride 1: a GEMM per sample (81 pixels); 2: batched
      CAPTURE(int(precision));
      CAPTURE(stride);
      ContextOptions o;
      o.precision = precision;
      DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, o);
      const Shape xs = {5, 3, 9, 9}, ws = {4, 3, 3, 3};
      const Conv2dParams prm{stride, 1};
      const int64_t q = window_out(9, 3, stride, 1);
      const Shape ys = {5, 4, q, q};
      ctx.run([&] {
        Tensor x = make(ctx, xs, 1), w = make(ctx, ws, 2), dy = make(ctx, ys, 3);
        Tensor dx = ctx.alloc(xs), sum = make(ctx, xs, 4);
        Tensor dw1 = make(ctx, ws, 5), db1 = make(ctx, {4}, 6);
        Tensor dw2 = make(ctx, ws, 5), db2 = make(ctx, {4}, 6);
        ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw1, db1, prm, InputGrad::Overwrite);
        Tensor expected = make(ctx, xs, 4);
        ctx.ops().add(ctx, expected, dx, 1.f);
        ctx.ops().conv2d_backward(ctx, x, w, dy, sum, dw2, db2, prm, InputGrad::Accumulate);
        CHECK(values(sum) == values(expected));
        CHECK(values(dw2) == values(dw1));
        CHECK(values(db2) == values(db1));
        CHECK(values(sum) != values(dx));  // it added: the random start is not lost
      });
    }
  }
}

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

TEST_CASE("cross_entropy: labels out of range give a NaN loss, in range a finite one") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  Tensor logits = make(ctx, {2, 5}, 3), probs = ctx.alloc({2, 5}), loss = ctx.alloc({1});
  Tensor labels = ctx.alloc({2}, DType::I32);
  for (auto [a, b, nan] : {std::tuple<int, int, bool>{0, 4, false}, {0, 5, true}, {-1, 2, true},
                           {1000000, 1, true}}) {
    CAPTURE(a);
    CAPTURE(b);
    labels.i32()[0] = a;
    labels.i32()[1] = b;
    ctx.ops().cross_entropy_forward(ctx, logits, labels, probs, loss);
    CHECK(std::isnan(loss.f32()[0]) == nan);
    double row = 0;  // the softmax is still computed
    for (int j = 0; j < 5; ++j) row += probs.f32()[j];
    CHECK(row == doctest::Approx(1.0));
  }
}

TEST_CASE("count_correct accumulates, with ties going to the first maximum") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  // argmax per row: 1, 0 (tie 0/2 -> first), 2, 1 (tie 1/2 -> first)
  Tensor logits = make(ctx, {4, 3}, {0, 3, 1, 5, 1, 5, -2, -3, -1, 0, 7, 7});
  Tensor labels = ctx.alloc({4}, DType::I32);
  const int32_t lab[4] = {1, 2, 2, 1};  // correct: yes, no (tie picks 0), yes, yes
  std::copy(lab, lab + 4, labels.i32());
  Tensor correct = ctx.alloc({1}, DType::I32);
  correct.i32()[0] = 10;
  ctx.ops().count_correct(ctx, logits, labels, correct);
  CHECK(correct.i32()[0] == 13);
  ctx.ops().count_correct(ctx, logits, labels, correct);
  CHECK(correct.i32()[0] == 16);
}

// correct[k] counts the rows whose label is among the k+1 first of the row's classes ordered by
// logit (largest first, ties by index, NaN last); a NaN label logit or a label out of range is
// never counted. Checked against that order, with K past the number of classes.
TEST_CASE("count_correct with K counts top-1 ... top-K, as a stable sort of each row orders it") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const int64_t N = 400, C = 6, K = 8;
  std::mt19937 rng(11);
  std::vector<float> v(N * C);
  for (auto& e : v) e = float(int(rng() % 5)) - 2.f;  // five values: many ties
  for (int i = 0; i < 40; ++i) v[rng() % v.size()] = std::nanf("");
  Tensor logits = make(ctx, {N, C}, v);
  Tensor labels = ctx.alloc({N}, DType::I32);
  for (int64_t i = 0; i < N; ++i) labels.i32()[i] = int32_t(rng() % (C + 2)) - 1;  // -1 .. C
  Tensor correct = ctx.alloc({K}, DType::I32);
  for (int64_t k = 0; k < K; ++k) correct.i32()[k] = int32_t(k);  // counts are added
  ctx.ops().count_correct(ctx, logits, labels, correct);

  std::vector<int32_t> expect(K);
  for (int64_t k = 0; k < K; ++k) expect[k] = int32_t(k);
  for (int64_t i = 0; i < N; ++i) {
    const float* row = &v[i * C];
    const int32_t y = labels.i32()[i];
    if (y < 0 || y >= C || std::isnan(row[y])) continue;
    std::vector<int64_t> order(C);
    for (int64_t j = 0; j < C; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return row[a] > row[b] || (!std::isnan(row[a]) && std::isnan(row[b]));
    });
    const int64_t place = std::find(order.begin(), order.end(), y) - order.begin();
    for (int64_t k = place; k < K; ++k) ++expect[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    CAPTURE(k);
    CHECK(correct.i32()[k] == expect[k]);
  }
  // The cases are all there: hits at top-1, every countable row within the top C and none
  // after, and rows never counted.
  const auto hits = [&](int64_t k) { return expect[k] - k; };
  CHECK(hits(0) > 20);
  CHECK(hits(K - 1) == hits(C - 1));
  CHECK(hits(C - 2) < hits(C - 1));
  CHECK(hits(C - 1) < N * 4 / 5);
}

TEST_CASE("maxpool2d k3 s2 p1 on 7x7: padding is -inf, overlapping windows add gradients") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  std::vector<float> xv(49);
  for (int i = 0; i < 49; ++i) xv[size_t(i)] = -1.f + 0.01f * float((i * 17) % 49);  // negative
  xv[3 * 7 + 3] = 5.f;  // in the windows (1..2, 1..2)
  Tensor x = make(ctx, {1, 1, 7, 7}, xv), y = ctx.alloc({1, 1, 4, 4});
  const Pool2dParams prm{3, 2, 1};
  ctx.ops().maxpool2d_forward(ctx, x, y, prm);
  std::vector<float> dyv(16), want_dx(49, 0.f);
  for (int i = 0; i < 16; ++i) dyv[size_t(i)] = float(i + 1);
  for (int oy = 0; oy < 4; ++oy)
    for (int ox = 0; ox < 4; ++ox) {
      int best = -1;  // reference: first maximum over the valid part of the window
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) {
          int iy = oy * 2 - 1 + i, ix = ox * 2 - 1 + j;
          if (iy < 0 || iy >= 7 || ix < 0 || ix >= 7) continue;
          if (best < 0 || xv[size_t(iy * 7 + ix)] > xv[size_t(best)]) best = iy * 7 + ix;
        }
      CHECK(y.f32()[oy * 4 + ox] == xv[size_t(best)]);
      CHECK(y.f32()[oy * 4 + ox] < (best == 24 ? 6.f : 0.f));  // never the padding's 0
      want_dx[size_t(best)] += dyv[size_t(oy * 4 + ox)];
    }
  for (int oy = 1; oy <= 2; ++oy)
    for (int ox = 1; ox <= 2; ++ox) CHECK(y.f32()[oy * 4 + ox] == 5.f);
  Tensor dy = make(ctx, {1, 1, 4, 4}, dyv), dx = make(ctx, {1, 1, 7, 7}, 9);  // overwritten
  ctx.ops().maxpool2d_backward(ctx, x, y, dy, dx, prm);
  CHECK(values(dx) == want_dx);
  CHECK(dx.f32()[24] == 6.f + 7.f + 10.f + 11.f);
}

TEST_CASE("maxpool2d windows that tile the plane (k = s, no padding), some rows and columns left") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  struct Case { int64_t h, w; int k; };
  for (Case cs : {Case{6, 8, 2}, Case{5, 7, 2}, Case{7, 8, 3}}) {
    CAPTURE(cs.k);
    CAPTURE(cs.h);
    const int64_t planes = 3, p = cs.h / cs.k, q = cs.w / cs.k, hw = cs.h * cs.w;
    std::vector<float> xv(size_t(planes * hw));
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = float((i * 7) % 5);  // many ties
    xv[5] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> dyv(size_t(planes * p * q)), want_y(dyv.size()), want_dx(xv.size(), 0.f);
    for (size_t i = 0; i < dyv.size(); ++i) dyv[i] = float(i + 1);
    for (int64_t pl = 0; pl < planes; ++pl)
      for (int64_t oy = 0; oy < p; ++oy)
        for (int64_t ox = 0; ox < q; ++ox) {
          int64_t best = -1;  // reference: the first maximum, a NaN above every number
          for (int i = 0; i < cs.k; ++i)
            for (int j = 0; j < cs.k; ++j) {
              const int64_t at = pl * hw + (oy * cs.k + i) * cs.w + ox * cs.k + j;
              const float v = xv[size_t(at)], b = best < 0 ? 0.f : xv[size_t(best)];
              if (best < 0 || (!std::isnan(b) && (v > b || std::isnan(v)))) best = at;
            }
          const size_t o = size_t((pl * p + oy) * q + ox);
          want_y[o] = xv[size_t(best)];
          want_dx[size_t(best)] = dyv[o];
        }
    const Pool2dParams prm{cs.k, cs.k, 0};
    Tensor x = make(ctx, {planes, 1, cs.h, cs.w}, xv), y = ctx.alloc({planes, 1, p, q});
    ctx.ops().maxpool2d_forward(ctx, x, y, prm);
    for (size_t o = 0; o < want_y.size(); ++o)
      CHECK((y.f32()[o] == want_y[o] || (std::isnan(y.f32()[o]) && std::isnan(want_y[o]))));
    Tensor dy = make(ctx, {planes, 1, p, q}, dyv), dx = make(ctx, {planes, 1, cs.h, cs.w}, 9);
    ctx.ops().maxpool2d_backward(ctx, x, y, dy, dx, prm);
    CHECK(values(dx) == want_dx);  // every element written: the winner's gradient or 0
  }
}

// Overlapping and padded windows on planes wide enough for windows inside the plane, cut by its
// left and right edges, and by its top and bottom: against a direct reference, ties and a NaN
// included; gradients of overlapping windows add up, in window order.
TEST_CASE("maxpool2d overlapping windows (k3 s2 p1, k3 s1 p1, k2 s1, k4 s3 p2) match a reference") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const Pool2dParams cases[] = {{3, 2, 1}, {3, 1, 1}, {2, 1, 0}, {4, 3, 2}};
  for (const Pool2dParams& prm : cases) {
    CAPTURE(prm.kernel);
    CAPTURE(prm.stride);
    const int64_t planes = 2, h = 9, w = 23, hw = h * w;
    const int64_t p = window_out(h, prm.kernel, prm.stride, prm.padding);
    const int64_t q = window_out(w, prm.kernel, prm.stride, prm.padding);
    std::vector<float> xv(size_t(planes * hw));
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = float((i * 7) % 11);  // many ties
    xv[40] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> dyv(size_t(planes * p * q)), want_y(dyv.size()), want_dx(xv.size(), 0.f);
    for (size_t i = 0; i < dyv.size(); ++i) dyv[i] = float(i % 13) - 6.f;
    for (int64_t pl = 0; pl < planes; ++pl)
      for (int64_t oy = 0; oy < p; ++oy)
        for (int64_t ox = 0; ox < q; ++ox) {
          int64_t best = -1;  // the first maximum of the window's part inside the plane
          for (int i = 0; i < prm.kernel; ++i)
            for (int j = 0; j < prm.kernel; ++j) {
              const int64_t iy = oy * prm.stride - prm.padding + i;
              const int64_t ix = ox * prm.stride - prm.padding + j;
              if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
              const int64_t at = pl * hw + iy * w + ix;
              const float v = xv[size_t(at)], b = best < 0 ? 0.f : xv[size_t(best)];
              if (best < 0 || (!std::isnan(b) && (v > b || std::isnan(v)))) best = at;
            }
          REQUIRE(best >= 0);
          const size_t o = size_t((pl * p + oy) * q + ox);
          want_y[o] = xv[size_t(best)];
          want_dx[size_t(best)] += dyv[o];
        }
    Tensor x = make(ctx, {planes, 1, h, w}, xv), y = ctx.alloc({planes, 1, p, q});
    ctx.ops().maxpool2d_forward(ctx, x, y, prm);
    for (size_t o = 0; o < want_y.size(); ++o)
      CHECK((y.f32()[o] == want_y[o] || (std::isnan(y.f32()[o]) && std::isnan(want_y[o]))));
    Tensor dy = make(ctx, {planes, 1, p, q}, dyv), dx = make(ctx, {planes, 1, h, w}, 9);
    ctx.ops().maxpool2d_backward(ctx, x, y, dy, dx, prm);
    CHECK(values(dx) == want_dx);
  }
}

TEST_CASE("maxpool2d ties and NaN: the first maximum wins, a NaN is the maximum; relu_backward") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Windows (k2 s2): {1, 3 | 3, 0} -> the first 3 (index 1); {NaN, 2 | 5, NaN} -> the first NaN.
  Tensor x = make(ctx, {1, 1, 2, 4}, std::vector<float>{1, 3, nan, 2, 3, 0, 5, nan});
  Tensor y = ctx.alloc({1, 1, 1, 2});
  ctx.ops().maxpool2d_forward(ctx, x, y, Pool2dParams{2, 2, 0});
  CHECK(y.f32()[0] == 3.f);
  CHECK(std::isnan(y.f32()[1]));
  Tensor dy = make(ctx, {1, 1, 1, 2}, std::vector<float>{10, 20}), dx = ctx.alloc({1, 1, 2, 4});
  ctx.ops().maxpool2d_backward(ctx, x, y, dy, dx, Pool2dParams{2, 2, 0});
  CHECK(values(dx) == std::vector<float>{0, 10, 20, 0, 0, 0, 0, 0});

  // The gradient passes where the output is positive only (not at 0, not at NaN).
  Tensor out = make(ctx, {6}, std::vector<float>{2, 0, -1, 0.5f, nan, 3});
  Tensor g = make(ctx, {6}, std::vector<float>{-4, 5, 6, 7, 8, -9}), d = make(ctx, {6}, 1);
  ctx.ops().relu_backward(ctx, out, g, d);
  CHECK(values(d) == std::vector<float>{-4, 0, 0, 7, 0, -9});
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

TEST_CASE("an op profile counts and times every call while set, and none after") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  Tensor a = ctx.alloc({1 << 16}), b = ctx.alloc({1 << 16});
  OpProfile profile;
  ctx.set_op_profile(&profile);
  ctx.ops().fill(ctx, a, 1.f);
  ctx.ops().fill(ctx, b, 2.f);
  ctx.ops().add(ctx, a, b, 0.5f);
  // A gather reads only the rows it names: its destination twice (read, written), the indices.
  Tensor table = ctx.alloc({64, 1024}), dst = ctx.alloc({3, 1024});
  Tensor rows = ctx.alloc({3}, DType::I32);
  for (int i = 0; i < 3; ++i) rows.i32()[i] = 5 * i;
  ctx.ops().gather_rows(ctx, dst, table, rows);
  ctx.set_op_profile(nullptr);
  ctx.ops().add(ctx, a, b, 0.5f);
  CHECK(a.f32()[7] == 3.f);  // the profiled calls did their work
  const auto ops = profile.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops.at("fill").calls == 2);
  CHECK(ops.at("add").calls == 1);
  CHECK(ops.at("fill").seconds > 0);
  // Each call's tensor arguments, each once: fill one tensor twice, add two tensors once.
  CHECK(ops.at("fill").tensor_bytes == 2.0 * (1 << 16) * 4);
  CHECK(ops.at("add").tensor_bytes == 2.0 * (1 << 16) * 4);
  CHECK(ops.at("gather_rows").tensor_bytes == 2.0 * 3 * 1024 * 4 + 3 * 4);
}

TEST_CASE("an op's parts are timed under its key (the bf16 layer's copies); none outside one") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1, false, Precision::Bf16});
  // relu_backward has no BF16 kernel on the CPU: the storage layer runs it on F32 copies.
  Tensor y = ctx.alloc({4096}, DType::BF16), dy = ctx.alloc({4096}, DType::BF16);
  Tensor dx = ctx.alloc({4096}, DType::BF16), a = ctx.alloc({4096}), b = ctx.alloc({4096});
  ctx.ops().fill(ctx, y, 1.f);
  ctx.ops().fill(ctx, dy, 2.f);
  OpProfile profile;
  ctx.set_op_profile(&profile);
  ctx.ops().relu_backward(ctx, y, dy, dx);
  ctx.ops().add(ctx, a, b, 1.f);  // F32: no copies, no parts
  ctx.set_op_profile(nullptr);
  const auto parts = profile.parts();
  REQUIRE(parts.count("relu_backward") == 1);
  CHECK(parts.count("add") == 0);
  const OpStats copies = parts.at("relu_backward").at("F32 copies of BF16 tensors");
  CHECK(copies.calls == 2);  // the widening before the op, the rounding back after it
  CHECK(copies.seconds > 0);
  CHECK(copies.seconds <= profile.ops().at("relu_backward").seconds);
  // Outside a profiled op a part only runs its work, and hands back what it returns.
  int ran = 0;
  op_part(ctx, "alone", [&] { ++ran; });
  CHECK(ran == 1);
  CHECK(op_part(ctx, "alone", [] { return 7; }) == 7);
  CHECK(profile.parts().size() == 1);
}

TEST_CASE("a context gets every thread it asks for, more than the cores included") {
  // Two contexts of cores + 2 threads each: TBB's default limit (the cores) would lend each
  // arena fewer threads than it holds. Every one of a context's threads must join one loop at
  // once: each iteration waits until all have arrived (or gives up after 10 s), so no thread
  // can take a second iteration before every iteration has a thread of its own.
  const int threads = int(std::thread::hardware_concurrency()) + 2;
  DeviceContext a(Device{DeviceType::CPU, 0, 0}, ContextOptions{threads});
  DeviceContext b(Device{DeviceType::CPU, 1, 0}, ContextOptions{threads});
  for (DeviceContext* ctx : {&a, &b}) {
    std::atomic<int> arrived{0};
    std::atomic<bool> gave_up{false};
    ctx->run([&] {
      tbb::parallel_for(0, threads, [&](int) {
        arrived.fetch_add(1);
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (arrived.load() < threads && std::chrono::steady_clock::now() < give_up)
          std::this_thread::yield();
        if (arrived.load() < threads) gave_up = true;
      }, tbb::simple_partitioner());
    });
    CHECK_FALSE(gave_up.load());
  }
}

TEST_CASE("a host block larger than the memory available is an error at once, not an OOM kill") {
  // MemAvailable + SwapFree + 512 MiB, below MemTotal: the kernel's overcommit would hand it out
  // (the pages are only committed when touched), and touching them would bring the OOM killer.
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t value = 0, total = 0, available = 0, swap = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemTotal:") total = value * 1024;
    if (key == "MemAvailable:") available = value * 1024;
    if (key == "SwapFree:") swap = value * 1024;
  }
  const size_t ask = available + swap + (size_t(512) << 20);
  if (available == 0 || ask >= total) {
    MESSAGE("skipped: /proc/meminfo leaves no room between MemAvailable and MemTotal");
    return;
  }
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  std::string what;
  try {
    ctx.allocator().allocate(ask);
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("out of host memory: a block of") != std::string::npos, what);
  CHECK(what.find("GiB is available") != std::string::npos);
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
