// The CPU convolution tests' layers: a layer's shape, its geometry as the convolution works it
// out, and the check that forward, input and weight gradients equal a convolution summed in
// double, with the same bits for 1, 2 and 3 threads (tests/test_conv_cpu.cpp and
// tests/test_direct_conv_cpu.cpp).
#pragma once
#include <doctest/doctest.h>

#include <limits>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/conv_geometry.h"
#include "engine/ops.h"

namespace test {

using replica::ContextOptions;
using replica::Conv2dParams;
using replica::ConvGeometry;
using replica::Device;
using replica::DeviceType;
using replica::InputGrad;
using replica::shape_numel;
using replica::window_out;

struct Layer {
  int64_t n, c, k, h, w;
  int r, stride, pad;
};

// Forward, input and weight gradients against a convolution summed in double. The caching
// allocator's blocks the column buffers will get are filled with NaN first: a column left
// unwritten shows.
inline void check_against_double_sum(const Layer& l) {
  CAPTURE(l.n);
  CAPTURE(l.h);
  CAPTURE(l.w);
  CAPTURE(l.r);
  CAPTURE(l.stride);
  CAPTURE(l.pad);
  const int64_t n = l.n, c = l.c, k = l.k, h = l.h, w = l.w;
  const int64_t p = window_out(h, l.r, l.stride, l.pad);
  const int64_t q = window_out(w, l.r, l.stride, l.pad);
  const Shape xs = {n, c, h, w}, ws = {k, c, l.r, l.r}, ys = {n, k, p, q};
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  {
    std::vector<Tensor> dirty;
    for (int t = 0; t < 4; ++t) dirty.push_back(ctx.alloc({n * c * l.r * l.r * p * q}));
    for (Tensor& t : dirty) ctx.ops().fill(ctx, t, std::numeric_limits<float>::quiet_NaN());
  }
  Tensor x = make(ctx, xs, 7), wt = make(ctx, ws, 8), b = make(ctx, {k}, 9);
  Tensor y = ctx.alloc(ys), dy = make(ctx, ys, 10), dx = ctx.alloc(xs);
  Tensor dw = make(ctx, ws, 11), db = ctx.alloc({k});  // dw += onto what is there
  ctx.ops().fill(ctx, db, 0.f);
  const Conv2dParams prm{l.stride, l.pad};
  std::vector<double> rdw(dw.f32(), dw.f32() + dw.numel());
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
            for (int64_t i = 0; i < l.r; ++i)
              for (int64_t j = 0; j < l.r; ++j) {
                const int64_t iy = oy * l.stride - l.pad + i;
                const int64_t ix = ox * l.stride - l.pad + j;
                if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                const size_t wi = size_t(((k_ * c + c_) * l.r + i) * l.r + j);
                const float wv = wt.f32()[wi];
                sum += double(wv) * x.f32()[at_x(b_, c_, iy, ix)];
                rdx[at_x(b_, c_, iy, ix)] += double(wv) * dy.f32()[yi];
                rdw[wi] += double(dy.f32()[yi]) * x.f32()[at_x(b_, c_, iy, ix)];
              }
          ry[yi] = sum;
        }
  for (size_t i = 0; i < ry.size(); ++i)
    REQUIRE(y.f32()[i] == doctest::Approx(ry[i]).epsilon(1e-4));
  for (size_t i = 0; i < rdx.size(); ++i)
    REQUIRE(dx.f32()[i] == doctest::Approx(rdx[i]).epsilon(1e-4));
  for (size_t i = 0; i < rdw.size(); ++i)
    REQUIRE(dw.f32()[i] == doctest::Approx(rdw[i]).epsilon(1e-4));
}

// The layer's geometry, as the convolution works it out.
inline ConvGeometry geometry_of(const Layer& l) {
  DeviceContext probe(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  return replica::conv_geometry(probe.alloc({l.n, l.c, l.h, l.w}),
                                probe.alloc({l.k, l.c, l.r, l.r}), Conv2dParams{l.stride, l.pad});
}

// check_against_double_sum, then forward and backward with the same bits for 1, 2 and 3 threads.
inline void check_layer(const Layer& l) {
  check_against_double_sum(l);
  const ConvGeometry g = geometry_of(l);
  const Shape xs = {l.n, l.c, l.h, l.w}, ws = {l.k, l.c, l.r, l.r}, ys = {l.n, l.k, g.p, g.q};
  same_for_all_thread_counts([&](DeviceContext& ctx) {
    Tensor x = make(ctx, xs, 1), w = make(ctx, ws, 2), b = make(ctx, {l.k}, 3);
    Tensor y = ctx.alloc(ys), dy = make(ctx, ys, 4), dx = ctx.alloc(xs);
    Tensor dw = make(ctx, ws, 5), db = make(ctx, {l.k}, 6);
    const Conv2dParams prm{l.stride, l.pad};
    ctx.ops().conv2d_forward(ctx, x, w, b, y, prm);
    ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, prm, InputGrad::Overwrite);
    std::vector<float> r;
    for (const Tensor* t : {&y, &dx, &dw, &db}) append(r, *t);
    return r;
  });
}

}  // namespace test
