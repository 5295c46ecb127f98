// CPU batch norm against a long-double reference, on planes whose rows are summed in one running
// sum (up to 31 positions) and in running sums folded together (32 and more: engine/cpu/norm.cpp's
// row_sums), with rows of whole lane passes and of a tail: the statistics, the normalised output,
// the running statistics and every gradient (with and without the fused ReLU's mask), to within
// what rounding the results to float allows. A row whose tail or lanes were dropped, or folded
// twice, moves a channel's mean by a whole element's share.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

namespace {

using Real = long double;

// One channel's values in the order n, then position, as the reference reads them.
std::vector<Real> channel(const std::vector<float>& v, const Shape& xs, int64_t c) {
  const int64_t hw = xs[2] * xs[3];
  std::vector<Real> out;
  for (int64_t n = 0; n < xs[0]; ++n)
    for (int64_t i = 0; i < hw; ++i) out.push_back(v[size_t((n * xs[1] + c) * hw + i)]);
  return out;
}

// |got - want| within `rel` of the larger of |want| and `scale`.
void check_near(double got, Real want, double rel, Real scale) {
  CHECK(std::fabs(got - double(want)) <= rel * double(std::max(std::fabs(want), scale)));
}

void check_against_reference(const Shape& xs, bool masked) {
  CAPTURE(shape_str(xs));
  CAPTURE(masked);
  const int64_t c_count = xs[1], m = xs[0] * xs[2] * xs[3];
  const float eps = 1e-5f, momentum = 0.1f;
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  std::vector<float> xv = random_values(shape_numel(xs), 1);
  for (float& v : xv) v = 2.f * v + 0.5f;  // a mean away from 0
  const std::vector<float> dyv = random_values(xv.size(), 2), ryv = random_values(xv.size(), 3);
  const std::vector<float> gv = random_values(size_t(c_count), 4);
  const std::vector<float> bv = random_values(size_t(c_count), 5);
  const std::vector<float> rmv = random_values(size_t(c_count), 6);
  Tensor x = make(ctx, xs, xv), gamma = make(ctx, {c_count}, gv), beta = make(ctx, {c_count}, bv);
  Tensor rm = make(ctx, {c_count}, rmv);
  Tensor rv = make(ctx, {c_count}, std::vector<float>(size_t(c_count), 1.f));
  Tensor y = ctx.alloc(xs), mean = ctx.alloc({c_count}), invstd = ctx.alloc({c_count});
  Tensor dy = make(ctx, xs, dyv), relu_y = make(ctx, xs, ryv), dx = ctx.alloc(xs);
  Tensor dg = make(ctx, {c_count}, std::vector<float>(size_t(c_count), 0.f));
  Tensor db = make(ctx, {c_count}, std::vector<float>(size_t(c_count), 0.f));
  ctx.run([&] {
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, momentum, eps, y, mean,
                                      invstd, Tensor(), false);
    ctx.ops().batchnorm_backward(ctx, x, gamma, mean, invstd, dy, masked ? relu_y : Tensor(), dx,
                                 dg, db);
  });
  const std::vector<float> yv = values(y), dxv = values(dx);
  for (int64_t c = 0; c < c_count; ++c) {
    CAPTURE(c);
    const std::vector<Real> xc = channel(xv, xs, c), dyc = channel(dyv, xs, c);
    const std::vector<Real> ryc = channel(ryv, xs, c), yc = channel(yv, xs, c);
    const std::vector<Real> dxc = channel(dxv, xs, c);
    Real sum = 0, sq = 0;
    for (Real v : xc) sum += v;
    const Real mu = sum / m;
    for (Real v : xc) sq += (v - mu) * (v - mu);
    const Real var = sq / m, inv = 1 / std::sqrt(var + eps);
    check_near(mean.f32()[c], mu, 1e-6, 1);
    check_near(invstd.f32()[c], inv, 1e-6, 0);
    check_near(rm.f32()[c], (1 - momentum) * Real(rmv[size_t(c)]) + momentum * mu, 1e-6, 1);
    check_near(rv.f32()[c], (1 - momentum) + momentum * var * m / (m - 1), 1e-6, 0);
    // dy as the backward takes it (masked by the ReLU's output), and its sums.
    std::vector<Real> g(static_cast<size_t>(m));
    Real s_dy = 0, s_dy_xhat = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = !masked || ryc[i] > 0 ? dyc[i] : 0;
      s_dy += g[i];
      s_dy_xhat += g[i] * (xc[i] - mu) * inv;
    }
    check_near(db.f32()[c], s_dy, 1e-6, std::sqrt(Real(m)) * 1e-3L);
    check_near(dg.f32()[c], s_dy_xhat, 1e-6, std::sqrt(Real(m)) * 1e-3L);
    const Real gam = gv[size_t(c)];
    for (size_t i = 0; i < g.size(); ++i) {
      const Real xhat = (xc[i] - mu) * inv;
      check_near(yc[i], xhat * gam + bv[size_t(c)], 1e-5, 1);
      check_near(dxc[i], gam * inv / m * (m * g[i] - s_dy - xhat * s_dy_xhat), 1e-5,
                 std::fabs(gam * inv));
    }
  }
}

}  // namespace

TEST_CASE("batchnorm matches a long-double reference on rows of one running sum and of lanes") {
  // Rows of 5 and 16 positions (one running sum), of 32 (two whole lane passes), 33 and 47 (a
  // tail of 1 and of 15), 7x7 and 56x56 (a ResNet's planes); 3 samples, so a channel adds rows.
  for (const Shape& xs : {Shape{3, 4, 5, 1}, Shape{3, 4, 4, 4}, Shape{3, 4, 4, 8},
                          Shape{3, 4, 3, 11}, Shape{3, 4, 1, 47}, Shape{3, 6, 7, 7},
                          Shape{2, 3, 56, 56}})
    for (bool masked : {false, true}) check_against_reference(xs, masked);
}
