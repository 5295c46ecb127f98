// CPU max pooling against a direct reference: padding as -inf, overlapping windows whose
// gradients add up in window order, windows that tile the plane with rows left over, ties and
// NaN (the first maximum wins, a NaN is the maximum); and relu_backward at NaN.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "env_guard.h"
#include "engine/context.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

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


// 2x2 tiles run 16 windows to a vector where the build has AVX-512: rows of 1, 3, 4 and 8
// windows (one part-filled vector, 8 filling its first half), 16 and 32 (whole vectors only), 17
// and 21 (one whole, then a part), and none (a plane 1 wide or 1 high). Both ways
// (REPLICA_MAX_POOL_2X2), so the element-wise path that builds without AVX-512 take is checked
// on every machine.
TEST_CASE("maxpool2d windows that tile the plane (k = s, no padding), some rows and columns left") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  struct Case { int64_t h, w; int k; };
  for (const char* vectors : {"1", "0"})
  for (Case cs : {Case{6, 8, 2}, Case{5, 7, 2}, Case{4, 32, 2}, Case{5, 43, 2}, Case{2, 64, 2},
                  Case{2, 3, 2}, Case{3, 16, 2}, Case{2, 35, 2}, Case{4, 1, 2}, Case{1, 6, 2},
                  Case{7, 8, 3}}) {
    ScopedEnv way("REPLICA_MAX_POOL_2X2", vectors);
    CAPTURE(vectors);
    CAPTURE(cs.k);
    CAPTURE(cs.h);
    CAPTURE(cs.w);
    const int64_t planes = 3, p = cs.h / cs.k, q = cs.w / cs.k, hw = cs.h * cs.w;
    std::vector<float> xv(size_t(planes * hw));
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = float((i * 7) % 5);  // many ties
    xv[5] = std::numeric_limits<float>::quiet_NaN();
    const int64_t last_rows = std::min<int64_t>(2, cs.h) * cs.w;  // a NaN in the last 2 rows
    xv[xv.size() - size_t(last_rows) + size_t(std::min<int64_t>(3, cs.w - 1))] =
        std::numeric_limits<float>::quiet_NaN();
    std::vector<float> dyv(size_t(planes * p * q)), want_y(dyv.size()), want_dx(xv.size(), 0.f);
    for (size_t i = 0; i < dyv.size(); ++i) dyv[i] = float(i + 1);
    if (!dyv.empty()) dyv.back() = -0.f;  // added into a zeroed plane: the winner gets +0
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
    for (int64_t i = 0; i < dx.numel(); ++i) CHECK(!std::signbit(dx.f32()[i]));
  }
}


// The bits of a pool's output and input gradient, [0] by the vector path, [1] element-wise as
// builds without AVX-512 take it (vector_switch off). Both start from garbage: every element
// must be written.
struct BothWays {
  std::vector<uint32_t> y[2], dx[2];
};
BothWays pool_both_ways(DeviceContext& ctx, const char* vector_switch, const Tensor& x,
                        const Tensor& dy, const Pool2dParams& prm) {
  BothWays bits;
  for (int way = 0; way < 2; ++way) {
    ScopedEnv vectors(vector_switch, way == 0 ? "1" : "0");
    Tensor y = make(ctx, dy.shape(), 5), dx = make(ctx, x.shape(), 9);
    ctx.ops().maxpool2d_forward(ctx, x, y, prm);
    ctx.ops().maxpool2d_backward(ctx, x, y, dy, dx, prm);
    append_bits(bits.y[way], y);
    append_bits(bits.dx[way], dx);
  }
  return bits;
}

// The CNN's pool (16 samples of 20 planes of 20x20) both ways, on values with many ties, zeros
// of both signs and NaNs: the same bits forward and backward.
TEST_CASE("maxpool2d 2x2: the vector path gives the element-wise path's bits") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const int64_t n = 16 * 20, h = 20, w = 20;
  std::vector<float> xv(size_t(n * h * w)), dyv(size_t(n * h * w / 4));
  std::mt19937 gen(7);
  const float choices[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, std::numeric_limits<float>::quiet_NaN()};
  for (float& v : xv) v = gen() % 50 == 0 ? choices[gen() % 6] : float(int(gen() % 9) - 4);
  for (float& v : dyv) v = gen() % 10 == 0 ? -0.f : float(int(gen() % 19) - 9) / 4.f;
  const Tensor x = make(ctx, {16, 20, h, w}, xv), dy = make(ctx, {16, 20, h / 2, w / 2}, dyv);
  const BothWays bits = pool_both_ways(ctx, "REPLICA_MAX_POOL_2X2", x, dy, Pool2dParams{2, 2, 0});
  CHECK(bits.y[0] == bits.y[1]);
  CHECK(bits.dx[0] == bits.dx[1]);
}

// ResNet's pool (3x3, stride 2, padding 1) both ways on planes whose rows hold 1 to 34 windows
// (a part-filled vector, whole ones, whole ones and a part), odd and even sizes (the right
// column in the padding or not), planes 1 and 2 high: values with many ties, zeros of both
// signs, -inf and NaNs, and a plane all -inf (the first element of each window wins). The same
// bits forward and backward.
TEST_CASE("maxpool2d 3x3 stride 2: the vector path gives the element-wise path's bits") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const Pool2dParams prm{3, 2, 1};
  const float inf = std::numeric_limits<float>::infinity();
  const float choices[] = {-1.f, -0.f, 0.f, 1.f, -inf, std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 gen(11);
  for (int64_t h : {1, 2, 5, 14})
    for (int64_t w : {1, 2, 3, 14, 15, 31, 32, 33, 34, 66, 67}) {
      CAPTURE(h);
      CAPTURE(w);
      const int64_t planes = 4, hw = h * w;
      const int64_t p = window_out(h, 3, 2, 1), q = window_out(w, 3, 2, 1);
      std::vector<float> xv(size_t(planes * hw)), dyv(size_t(planes * p * q));
      for (float& v : xv) v = gen() % 8 == 0 ? choices[gen() % 6] : float(int(gen() % 5) - 2);
      std::fill(xv.begin(), xv.begin() + hw, -inf);
      for (float& v : dyv) v = gen() % 10 == 0 ? -0.f : float(int(gen() % 19) - 9) / 4.f;
      dyv[0] = 1.5f;
      const Tensor x = make(ctx, {planes, 1, h, w}, xv), dy = make(ctx, {planes, 1, p, q}, dyv);
      const BothWays bits = pool_both_ways(ctx, "REPLICA_MAX_POOL_3X3", x, dy, prm);
      CHECK(bits.y[0] == bits.y[1]);
      CHECK(bits.dx[0] == bits.dx[1]);
      // The all -inf plane: each window's winner is its first element in the plane, so the
      // plane's first element has window (0, 0)'s gradient alone.
      CHECK(bits.dx[0][0] == 0x3FC00000u);  // 1.5f
    }
}


// Overlapping and padded windows on planes wide enough for windows inside the plane, cut by its
// left and right edges, and by its top and bottom: against a direct reference, ties and a NaN
// included; gradients of overlapping windows add up, in window order.
// k3 s2 p1 both ways (REPLICA_MAX_POOL_3X3): in vectors where the build has AVX-512, and
// element-wise as builds without it take.
TEST_CASE("maxpool2d overlapping windows (k3 s2 p1, k3 s1 p1, k2 s1, k4 s3 p2) match a reference") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const Pool2dParams cases[] = {{3, 2, 1}, {3, 2, 1}, {3, 1, 1}, {2, 1, 0}, {4, 3, 2}};
  for (const Pool2dParams& prm : cases) {
    ScopedEnv vectors("REPLICA_MAX_POOL_3X3", &prm == &cases[0] ? "1" : "0");
    CAPTURE(&prm - cases);
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

  // The gradient passes where the output is not <= 0: not at 0, and at NaN (PyTorch's
  // threshold_backward).
  Tensor out = make(ctx, {6}, std::vector<float>{2, 0, -1, 0.5f, nan, 3});
  Tensor g = make(ctx, {6}, std::vector<float>{-4, 5, 6, 7, 8, -9}), d = make(ctx, {6}, 1);
  ctx.ops().relu_backward(ctx, out, g, d);
  CHECK(values(d) == std::vector<float>{-4, 0, 0, 7, 8, -9});
}
