// --precision bf16 on CPU devices: convolutions and linear layers as PyTorch's autocast computes
// them (engine/context.h, Precision::Bf16). What must hold:
//  - bf16_round rounds to nearest, ties to even, keeps NaN, infinity and the sign;
//  - operands are rounded before the product: inputs of 1 + 3/1024 (not a bf16 number) multiply
//    as 1, so the results are exact counts where fp32 gives 0.6% more;
//  - results are rounded: a sum of 257 ones comes out as 256, each step's weight gradient is
//    rounded before it joins the accumulated one, biases and their gradients stay fp32;
//  - on random data every result is within one bf16 rounding of the exact product of the rounded
//    operands, on every path of the CPU convolution (per sample, whole batch, 1x1);
//  - training follows fp32 closely and the flag reaches a run's config.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "dp_reference.h"
#include "env_guard.h"
#include "engine/context.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "parallel/engines/train_engine.h"
#include "seeded_values.h"

using namespace replica;

namespace {

const Device kCpu{DeviceType::CPU, 0, 0};
constexpr float kNotBf16 = 1.f + 3.f / 1024;  // rounds to 1 in bf16 (3/8 of its spacing there)

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

Tensor filled(DeviceContext& ctx, const Shape& shape, float v) {
  Tensor t = ctx.alloc(shape);
  std::fill(t.f32(), t.f32() + t.numel(), v);
  return t;
}

Tensor random(DeviceContext& ctx, const Shape& shape, uint32_t seed) {
  const std::vector<float> v = test::random_values(shape_numel(shape), seed);
  Tensor t = ctx.alloc(shape);
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

DeviceContext bf16_cpu() { return DeviceContext(kCpu, ContextOptions{1, false, Precision::Bf16}); }

// Every value a bf16 number (its low 16 bits zero).
bool all_bf16(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (bits_of(t.f32()[i]) & 0xffffu) return false;
  return true;
}

// The exact (double) convolution of bf16-rounded x and w, NCHW, square kernel.
std::vector<double> conv_reference(const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3), K = w.dim(0), R = w.dim(2);
  const int64_t P = window_out(H, int(R), p.stride, p.padding);
  const int64_t Q = window_out(W, int(R), p.stride, p.padding);
  std::vector<double> y(size_t(N * K * P * Q), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t oy = 0; oy < P; ++oy)
        for (int64_t ox = 0; ox < Q; ++ox) {
          double s = 0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < R; ++i)
              for (int64_t j = 0; j < R; ++j) {
                const int64_t iy = oy * p.stride - p.padding + i, ix = ox * p.stride - p.padding + j;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                s += double(bf16_round(x.f32()[((n * C + c) * H + iy) * W + ix])) *
                     double(bf16_round(w.f32()[((k * C + c) * R + i) * R + j]));
              }
          y[size_t(((n * K + k) * P + oy) * Q + ox)] = s;
        }
  return y;
}

// |got - exact| within one bf16 rounding of exact (half a spacing, plus fp32 summation slack).
void expect_one_rounding(const Tensor& got, const std::vector<double>& exact, const char* what) {
  REQUIRE(size_t(got.numel()) == exact.size());
  int64_t bad = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double tol = std::fabs(exact[i]) * (1.0 / 256) + 1e-5;
    if (std::fabs(got.f32()[i] - exact[i]) > tol) ++bad;
  }
  CAPTURE(what);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("bf16_round: nearest, ties to even; NaN, infinity, zero and sign kept") {
  CHECK(bf16_round(1.f) == 1.f);
  CHECK(bf16_round(kNotBf16) == 1.f);
  CHECK(bf16_round(1.f + 1.f / 256) == 1.f);                    // tie: to the even 1
  CHECK(bf16_round(1.f + 3.f / 256) == 1.f + 4.f / 256);        // tie: to the even 1 + 2^-6
  CHECK(bf16_round(1.f + 1.f / 256 + 1.f / 4096) == 1.f + 1.f / 128);  // past the tie: up
  CHECK(bf16_round(-kNotBf16) == -1.f);
  CHECK(bf16_round(3.0e38f) == 3.0040553e38f);  // below bf16's largest finite (about 3.39e38)
  CHECK(bf16_round(std::numeric_limits<float>::max()) == std::numeric_limits<float>::infinity());
  CHECK(bf16_round(-std::numeric_limits<float>::infinity()) ==
        -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(bf16_round(std::numeric_limits<float>::quiet_NaN())));
  CHECK(bits_of(bf16_round(-0.f)) == 0x80000000u);
  CHECK(bf16_bits(1.f) == 0x3f80);
  CHECK(bf16_value(0x3f80) == 1.f);
}

TEST_CASE("--precision bf16 is accepted for CPU devices; tf32 still is not; auto stays fp32") {
  CHECK(resolve_precision("bf16", {kCpu}) == Precision::Bf16);
  CHECK(resolve_precision("auto", {kCpu}) == Precision::Fp32);
  CHECK_THROWS_AS(resolve_precision("tf32", {kCpu}), UsageError);
  CHECK_THROWS_AS(resolve_precision("fp16", {kCpu}), UsageError);
  CHECK(std::string(precision_name(Precision::Bf16)) == "bf16");
  CHECK_NOTHROW(DeviceContext(kCpu, ContextOptions{1, false, Precision::Bf16}));
}

TEST_CASE("REPLICA_CUDNN_API names cuDNN's interface for convolutions: auto, legacy or graph") {
  CHECK(parse_conv_api("auto") == ConvApi::Auto);
  CHECK(parse_conv_api("legacy") == ConvApi::Legacy);
  CHECK(parse_conv_api("graph") == ConvApi::Graph);
  for (const ConvApi a : {ConvApi::Auto, ConvApi::Legacy, ConvApi::Graph})
    CHECK(parse_conv_api(conv_api_name(a)) == a);
  for (const char* bad : {"", "Graph", "v8", "backend"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse_conv_api(bad), doctest::Contains("(auto, legacy, graph)"),
                         UsageError);
  }
  CHECK(ContextOptions{}.conv_api == ConvApi::Auto);
  // Read from the environment: unset or empty is auto.
  test::EnvGuard guard({"REPLICA_CUDNN_API"});
  ::setenv("REPLICA_CUDNN_API", "", 1);
  CHECK(conv_api_from_environment() == ConvApi::Auto);
  ::setenv("REPLICA_CUDNN_API", "graph", 1);
  CHECK(conv_api_from_environment() == ConvApi::Graph);
  ::setenv("REPLICA_CUDNN_API", "v8", 1);
  CHECK_THROWS_AS(conv_api_from_environment(), UsageError);
  ::unsetenv("REPLICA_CUDNN_API");
  CHECK(conv_api_from_environment() == ConvApi::Auto);
}

TEST_CASE("--memory-format: auto is channels_last for bf16 on GPUs only; CPUs refuse it") {
  for (const Precision p : {Precision::Fp32, Precision::Bf16}) {
    CHECK_FALSE(resolve_channels_last("auto", p, {kCpu}));
    CHECK_FALSE(resolve_channels_last("nchw", p, {kCpu}));
    CHECK_THROWS_AS(resolve_channels_last("channels_last", p, {kCpu}), UsageError);
  }
  CHECK_THROWS_AS(resolve_channels_last("nhwc", Precision::Fp32, {kCpu}), UsageError);
  // A CUDA device is judged by its type alone: no GPU needs to be present to resolve the flag.
  const Device gpu{DeviceType::CUDA, 0, 0};
  CHECK(resolve_channels_last("auto", Precision::Bf16, {gpu}));
  CHECK_FALSE(resolve_channels_last("auto", Precision::Tf32, {gpu}));
  CHECK(resolve_channels_last("channels_last", Precision::Fp32, {gpu}));
  CHECK_FALSE(resolve_channels_last("auto", Precision::Bf16, {gpu, kCpu}));
  ContextOptions nhwc{1, false, Precision::Fp32};
  nhwc.channels_last = true;
  CHECK_THROWS_WITH_AS(DeviceContext(kCpu, nhwc), doctest::Contains("needs a CUDA device"),
                       UsageError);
}

TEST_CASE("bf16 linear: operands rounded before the product, results after; biases in fp32") {
  DeviceContext fp32(kCpu, ContextOptions{1});
  DeviceContext bf16 = bf16_cpu();
  const int64_t N = 4, in = 257, out = 3;
  for (DeviceContext* ctx : {&fp32, &bf16}) {
    const bool b16 = ctx == &bf16;
    CAPTURE(b16);
    Tensor x = filled(*ctx, {N, in}, 1.f), w = filled(*ctx, {out, in}, kNotBf16);
    Tensor b = filled(*ctx, {out}, 0.25f), y = ctx->alloc({N, out});
    ctx->ops().linear_forward(*ctx, x, w, b, y);
    // bf16: 257 products of 1 sum to 257, stored as 256 (a tie, to even); then + 0.25 in fp32.
    const float expect_y = b16 ? 256.25f : 257.f * kNotBf16 + 0.25f;
    for (int64_t i = 0; i < y.numel(); ++i) CHECK(y.f32()[i] == doctest::Approx(expect_y).epsilon(1e-6));

    Tensor dy = filled(*ctx, {N, out}, kNotBf16), dx = ctx->alloc({N, in});
    Tensor dw = filled(*ctx, {out, in}, 0.5f), db = filled(*ctx, {out}, 0.f);
    ctx->ops().linear_backward(*ctx, x, w, dy, dx, dw, db);
    // dx = sum over 3 outputs of w*dy: 3 exactly in bf16; dw += N*dy, rounded (4), then added.
    const float expect_dx = b16 ? 3.f : 3.f * kNotBf16 * kNotBf16;
    const float expect_dw = b16 ? 4.5f : 0.5f + 4.f * kNotBf16;
    for (int64_t i = 0; i < dx.numel(); ++i) CHECK(dx.f32()[i] == doctest::Approx(expect_dx).epsilon(1e-6));
    for (int64_t i = 0; i < dw.numel(); ++i) CHECK(dw.f32()[i] == doctest::Approx(expect_dw).epsilon(1e-6));
    // The bias gradient sums the fp32 gradient in both modes.
    for (int64_t i = 0; i < db.numel(); ++i) CHECK(db.f32()[i] == doctest::Approx(4.f * kNotBf16).epsilon(1e-6));
  }
}

TEST_CASE("bf16 convolution: exact counts from rounded operands, bias added in fp32") {
  DeviceContext ctx = bf16_cpu();
  const Conv2dParams p{1, 1};
  Tensor x = filled(ctx, {2, 2, 5, 5}, kNotBf16), w = filled(ctx, {3, 2, 3, 3}, kNotBf16);
  Tensor b = filled(ctx, {3}, 0.125f), y = ctx.alloc({2, 3, 5, 5});
  ctx.ops().conv2d_forward(ctx, x, w, b, y, p);
  // Interior pixels see 2 channels x 9 taps = 18 products of 1; edges 12; corners 8.
  for (int64_t nk = 0; nk < 6; ++nk) {
    const float* plane = y.f32() + nk * 25;
    CHECK(plane[12] == 18.125f);
    CHECK(plane[2] == 12.125f);
    CHECK(plane[0] == 8.125f);
  }
}

TEST_CASE("bf16 convolution, every CPU path: each result one rounding from the exact product") {
  DeviceContext ctx = bf16_cpu();
  struct Case {
    Shape x, w;
    Conv2dParams p;
    const char* path;
  };
  const Case cases[] = {
      {{3, 4, 12, 12}, {5, 4, 3, 3}, {1, 1}, "per sample (144 output pixels)"},
      {{3, 4, 6, 6}, {5, 4, 3, 3}, {2, 1}, "whole batch (9 output pixels)"},
      {{3, 8, 9, 9}, {6, 8, 1, 1}, {1, 0}, "1x1, per sample"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.path);
    Tensor x = random(ctx, c.x, 1), w = random(ctx, c.w, 2);
    const int64_t P = window_out(c.x[2], int(c.w[2]), c.p.stride, c.p.padding);
    const Shape ys{c.x[0], c.w[0], P, P};
    Tensor y = ctx.alloc(ys);
    ctx.ops().conv2d_forward(ctx, x, w, Tensor(), y, c.p);
    CHECK(all_bf16(y));
    expect_one_rounding(y, conv_reference(x, w, c.p), "y");

    // dw = conv of x with dy; dx = the transposed conv: checked against the definition through
    // the identity <dy, conv(x, w)> = <dx, x> = <dw, w> on the rounded operands.
    Tensor dy = random(ctx, ys, 3), dx = ctx.alloc(c.x), dw = filled(ctx, c.w, 0.f);
    Tensor no_db;
    ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, no_db, c.p, InputGrad::Overwrite);
    CHECK(all_bf16(dx));
    CHECK(all_bf16(dw));  // one call's weight gradient added to zero
    // Each side's error is at most one bf16 rounding (2^-9) of each term: 1/256 leaves 2x room.
    const std::vector<double> yx = conv_reference(x, w, c.p);
    auto dot = [](const float* a, const float* b, int64_t n, bool round_a, double* mag) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double t = double(round_a ? bf16_round(a[i]) : a[i]) * bf16_round(b[i]);
        s += t;
        *mag += std::fabs(t);
      }
      return s;
    };
    double mag_y = 0, mag_x = 0, mag_w = 0, lhs = 0;
    for (size_t i = 0; i < yx.size(); ++i) {
      lhs += double(bf16_round(dy.f32()[i])) * yx[i];
      mag_y += std::fabs(double(bf16_round(dy.f32()[i])) * yx[i]);
    }
    const double dx_x = dot(dx.f32(), x.f32(), x.numel(), false, &mag_x);
    const double dw_w = dot(dw.f32(), w.f32(), w.numel(), false, &mag_w);
    CHECK(std::fabs(dx_x - lhs) <= (mag_x + mag_y) / 256);
    CHECK(std::fabs(dw_w - lhs) <= (mag_w + mag_y) / 256);
  }
}

TEST_CASE("bf16 training follows fp32 (CNN, 4 SGD steps) and differs from it") {
  const double drift = test::precision_update_drift(kCpu, Precision::Bf16, 4, 16, 2e-2);
  CHECK(drift < 0.1);  // measured 0.033: bf16 moves each gradient by ~2^-9 of its terms
  CHECK(drift > 1e-4);  // the products really went through bf16
}
