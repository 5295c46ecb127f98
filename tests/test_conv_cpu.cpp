// The CPU convolution: the same bits for 1, 2 and 3 threads, rows copied as runs, the tap
// table, the plane matrix and the direct convolution equal to a convolution summed in double,
// a backward adding onto dx the bits of a backward then an add, and which way each layer ran.
#include <doctest/doctest.h>

#include <limits>
#include <random>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "env_guard.h"
#include "engine/context.h"
#include "engine/conv_geometry.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/direct_conv.h"
#include "engine/op_profile.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

TEST_CASE("conv2d forward/backward are bit-identical for 1, 2 and 3 threads (batch 13)") {
  struct Case { int64_t c, k; int r, stride, pad; };
  // 9x9 input: 81 output pixels go one sample per GEMM; stride 2 (25 pixels) goes through the
  // batched path, whose GEMMs split their larger dimension in tasks of 32, or an eighth of it
  // from 256 up: over columns (13 x 25) for 70 output channels and the last case's weight
  // gradient (576 columns), over rows for its 520 output channels.
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


namespace {

struct Layer {
  int64_t n, c, k, h, w;
  int r, stride, pad;
};

// Forward, input and weight gradients against a direct convolution in double. The caching allocator's
// blocks the column buffers will get are filled with NaN first: a column left unwritten shows.
void check_against_direct(const Layer& l) {
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
ConvGeometry geometry_of(const Layer& l) {
  DeviceContext probe(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  return conv_geometry(probe.alloc({l.n, l.c, l.h, l.w}), probe.alloc({l.k, l.c, l.r, l.r}),
                       Conv2dParams{l.stride, l.pad});
}

// check_against_direct, then forward and backward with the same bits for 1, 2 and 3 threads.
void check_layer(const Layer& l) {
  check_against_direct(l);
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

}  // namespace

TEST_CASE("conv2d on rows of 8+ output columns (copied as runs) equals a direct convolution") {
  // Stride-1 rows this wide go through im2col's and col2im's run loops: zero fill, contiguous
  // copy, zero fill, the bounds worked out per kernel column; the strided cases check the
  // element loops on the same shapes. Non-square input, so the column bounds come from the
  // width; padding up to and beyond the kernel's reach. The direct convolution is off, so that
  // these layers stay im2col's whichever layers it takes.
  test::ScopedEnv no_direct("REPLICA_DIRECT_CONV", "0");
  struct Case { int r, stride, pad; };
  for (Case cs : {Case{3, 1, 1}, Case{5, 2, 2}, Case{3, 2, 0}, Case{1, 2, 0}, Case{7, 3, 3},
                  Case{4, 1, 4}, Case{5, 1, 0}}) {
    const Layer l{2, 2, 3, 22, 26, cs.r, cs.stride, cs.pad};
    REQUIRE(window_out(l.w, l.r, l.stride, l.pad) >= 8);
    check_against_direct(l);
  }
}

TEST_CASE("conv2d on small outputs (the tap table) and pointwise layers (copies) equals a direct "
          "convolution") {
  // Outputs under 64 pixels read through a table of each kernel tap's source pixel (-1 for
  // padding): a ResNet's late stages, 7x7 down to 1x1. Batches of 1 take the per-sample path,
  // larger ones the batched GEMMs, which the last two layers split in several blocks of rows and
  // of columns, each way round. Pointwise layers copy channel planes, small or large. The direct
  // convolution is off, so that these layers stay im2col's whichever layers it takes.
  test::ScopedEnv no_direct("REPLICA_DIRECT_CONV", "0");
  for (int64_t n : {1, 3}) {
    for (Layer l : {Layer{n, 3, 4, 2, 2, 3, 1, 1}, Layer{n, 3, 4, 1, 1, 3, 1, 1},
                    Layer{n, 2, 5, 7, 7, 3, 1, 1}, Layer{n, 2, 5, 4, 5, 3, 2, 1},
                    Layer{n, 2, 3, 3, 3, 2, 1, 2}, Layer{n, 2, 3, 8, 6, 5, 2, 3},
                    Layer{n, 4, 6, 2, 2, 1, 1, 0}, Layer{n, 4, 6, 7, 7, 1, 1, 0},
                    Layer{n, 4, 6, 12, 12, 1, 1, 0}, Layer{n, 4, 6, 7, 7, 1, 2, 0},
                    Layer{n, 8, 20, 4, 4, 3, 1, 1}, Layer{n, 8, 70, 4, 4, 3, 1, 1}})
      check_against_direct(l);
  }
}

TEST_CASE("conv2d on planes smaller than the kernel (the plane matrix) equals a direct "
          "convolution, with the same bits for 1, 2 and 3 threads") {
  // A ResNet at 28x28 input: 3x3 on 2x2 planes, the stride-2 step to 1x1, and 3x3 on 1x1; then
  // planes that are not square: 1x2; 2x3 at stride 2, where the second output's window starts
  // past column 0 and runs past the right edge; 4x1, where the first output row's window ends
  // above the last input rows (a pixel joined from beyond the kernel's reach would show); a 5x5
  // kernel on 3x3 planes with 70 output channels: M's 630 rows split in blocks, and its
  // gradient folds taps from several pixels into one weight; a batch of 1.
  for (Layer l : {Layer{5, 6, 4, 2, 2, 3, 1, 1}, Layer{5, 6, 4, 2, 2, 3, 2, 1},
                  Layer{5, 6, 4, 1, 1, 3, 1, 1}, Layer{3, 4, 5, 1, 2, 3, 1, 1},
                  Layer{4, 3, 5, 2, 3, 3, 2, 1}, Layer{3, 3, 5, 4, 1, 3, 1, 1},
                  Layer{4, 3, 70, 3, 3, 5, 1, 2}, Layer{1, 5, 4, 1, 1, 3, 1, 1}}) {
    REQUIRE(plane_matrix_pays(geometry_of(l)));
    check_layer(l);
  }
}

TEST_CASE("conv2d at stride 1 with few output channels (the direct convolution) equals a "
          "convolution summed in double, with the same bits for 1, 2 and 3 threads") {
  // The CNN's second layer (5x5, 20 channels in and out) and a 5x5 layer of 4 inputs; 3x3 with
  // padding on 10x10; 7 output channels (a block of 5 and two rows alone; weight gradients in a
  // block of 4 and three rows alone) and 45 taps (blocks of 4 and one alone); a 2x2 kernel on a
  // 9x11 plane, padded; padding past the kernel's reach (outputs that see only zeros); 32 output
  // channels, the most it takes; 4x4 and 7x7 kernels; a plane one output column wide (every
  // wide row but its first pixel dropped); batches of 1, 13 (the weight gradient's chunks of 2
  // samples and 1: a pass over a whole chunk) and 41 (chunks of 6 and 5: passes over 4
  // samples, then 2 or 1). Builds for CPUs without AVX-512 leave every layer to im2col.
  if (!cpu::direct_conv_built()) {
    MESSAGE("skipped: this build is not for AVX-512, and the direct convolution is off in it");
    CHECK_FALSE(cpu::direct_conv_pays(geometry_of(Layer{2, 20, 20, 24, 24, 5, 1, 0})));
    return;
  }
  for (Layer l : {Layer{3, 20, 20, 24, 24, 5, 1, 0}, Layer{2, 4, 20, 28, 28, 5, 1, 0},
                  Layer{3, 6, 5, 10, 10, 3, 1, 1}, Layer{2, 5, 7, 10, 12, 3, 1, 1},
                  Layer{2, 4, 4, 9, 11, 2, 1, 1}, Layer{2, 4, 3, 4, 5, 3, 1, 4},
                  Layer{1, 4, 32, 10, 10, 3, 1, 1}, Layer{2, 4, 5, 12, 13, 4, 1, 2},
                  Layer{2, 4, 5, 12, 12, 7, 1, 3}, Layer{2, 4, 6, 104, 3, 3, 1, 0},
                  Layer{13, 4, 6, 10, 11, 3, 1, 1}, Layer{41, 4, 6, 10, 11, 3, 1, 1}}) {
    const ConvGeometry g = geometry_of(l);
    REQUIRE(cpu::direct_conv_pays(g));
    REQUIRE_FALSE(plane_matrix_pays(g));
    check_layer(l);
  }
  // Without an input gradient (a network's first layer) the weight gradient keeps its bits.
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  ctx.run([&] {
    const Shape xs = {3, 20, 24, 24}, ws = {20, 20, 5, 5}, ys = {3, 20, 20, 20};
    Tensor x = make(ctx, xs, 1), w = make(ctx, ws, 2), dy = make(ctx, ys, 3);
    Tensor dx = ctx.alloc(xs), no_dx, db1 = make(ctx, {20}, 4), db2 = make(ctx, {20}, 4);
    Tensor dw1 = make(ctx, ws, 5), dw2 = make(ctx, ws, 5);
    ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw1, db1, Conv2dParams{1, 0},
                              InputGrad::Overwrite);
    ctx.ops().conv2d_backward(ctx, x, w, dy, no_dx, dw2, db2, Conv2dParams{1, 0},
                              InputGrad::Overwrite);
    CHECK(values(dw2) == values(dw1));
    CHECK(values(db2) == values(db1));
  });
  // It leaves to im2col strided layers, 1x1 kernels, more than 32 output channels, fewer than
  // 4 input channels (the CNN's first layer) and planes under 100 output pixels.
  auto takes = [](Layer l) { return cpu::direct_conv_pays(geometry_of(l)); };
  CHECK_FALSE(takes(Layer{2, 20, 20, 24, 24, 5, 2, 0}));
  CHECK_FALSE(takes(Layer{2, 20, 20, 24, 24, 1, 1, 0}));
  CHECK_FALSE(takes(Layer{2, 20, 33, 24, 24, 3, 1, 1}));
  CHECK_FALSE(takes(Layer{2, 1, 20, 28, 28, 5, 1, 0}));
  CHECK_FALSE(takes(Layer{2, 64, 32, 8, 8, 3, 1, 1}));
  CHECK(takes(Layer{2, 4, 32, 10, 10, 3, 1, 1}));
}

TEST_CASE("the plane matrix's entries and weight gradients as GPU threads compute them, against "
          "their definition through the kernel's taps") {
  // plane_matrix_entry and plane_matrix_weight_grad are the whole work of the CUDA kernels
  // (engine/cuda/conv_plane_matrix.cu); here they run on the host over random geometries,
  // whether or not the plane matrix would pay for them, against loops over kernel taps that
  // share no code with them. Sums are in the same order, so the bits must match.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  int checked = 0;
  for (int it = 0; it < 400; ++it) {
    ConvGeometry g{};
    g.n = 1, g.c = 1 + rng() % 4, g.k = 1 + rng() % 4, g.r = 1 + rng() % 6;
    g.stride = 1 + int(rng() % 3), g.pad = int(rng() % (g.r + 1));
    g.h = 1 + rng() % 5, g.w = 1 + rng() % 5;
    g.p = window_out(g.h, int(g.r), g.stride, g.pad);
    g.q = window_out(g.w, int(g.r), g.stride, g.pad);
    if (g.p <= 0 || g.q <= 0) continue;
    CAPTURE(g.h);
    CAPTURE(g.w);
    CAPTURE(g.r);
    CAPTURE(g.stride);
    CAPTURE(g.pad);
    const int64_t rr = g.r * g.r, cols = g.c * g.hw(), entries = g.k * g.pq() * cols;
    std::vector<float> w(static_cast<size_t>(g.k * g.c * rr));
    std::vector<float> dm(static_cast<size_t>(entries));
    for (float& v : w) v = uniform(rng);
    for (float& v : dm) v = uniform(rng);
    std::vector<float> m(static_cast<size_t>(entries), 0.f), dw(w.size(), 0.f);
    for (int64_t kk = 0; kk < g.k; ++kk)
      for (int64_t cc = 0; cc < g.c; ++cc)
        for (int64_t i = 0; i < g.r; ++i)
          for (int64_t j = 0; j < g.r; ++j)
            for (int64_t oy = 0; oy < g.p; ++oy)
              for (int64_t ox = 0; ox < g.q; ++ox) {
                const int64_t iy = oy * g.stride - g.pad + i, ix = ox * g.stride - g.pad + j;
                if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                const size_t at = size_t((kk * g.pq() + oy * g.q + ox) * cols + cc * g.hw() +
                                         iy * g.w + ix);
                const size_t wi = size_t((kk * g.c + cc) * rr + i * g.r + j);
                m[at] = w[wi];
                dw[wi] += dm[at];
              }
    for (int64_t e = 0; e < entries; ++e)
      REQUIRE(plane_matrix_entry(w.data(), g, e) == m[size_t(e)]);
    for (int64_t e = 0; e < int64_t(w.size()); ++e)
      REQUIRE(plane_matrix_weight_grad(dm.data(), g, e) == dw[size_t(e)]);
    ++checked;
  }
  CHECK(checked > 300);
}

TEST_CASE("conv2d on small planes with no input channels or no samples: the bias, no crash") {
  // Shapes the plane matrix would divide by (no channels, no pixels): they keep the batched path.
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  ctx.run([&] {
    Tensor x = ctx.alloc({3, 0, 2, 2}), w = ctx.alloc({4, 0, 3, 3}), b = make(ctx, {4}, 1);
    Tensor y = ctx.alloc({3, 4, 2, 2}), dy = make(ctx, {3, 4, 2, 2}, 2);
    Tensor dx = ctx.alloc({3, 0, 2, 2}), dw = ctx.alloc({4, 0, 3, 3}), db = ctx.alloc({4});
    ctx.ops().fill(ctx, db, 0.f);
    ctx.ops().conv2d_forward(ctx, x, w, b, y, Conv2dParams{1, 1});
    ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, Conv2dParams{1, 1}, InputGrad::Overwrite);
    for (int64_t i = 0; i < y.numel(); ++i) CHECK(y.f32()[i] == b.f32()[i / 4 % 4]);
    for (int64_t k = 0; k < 4; ++k) {
      double s = 0;
      for (int64_t n = 0; n < 3; ++n)
        for (int64_t j = 0; j < 4; ++j) s += dy.f32()[(n * 4 + k) * 4 + j];
      CHECK(db.f32()[k] == doctest::Approx(s).epsilon(1e-5));
    }
    Tensor x0 = ctx.alloc({0, 3, 2, 2}), w0 = make(ctx, {4, 3, 3, 3}, 3);
    Tensor y0 = ctx.alloc({0, 4, 2, 2}), dx0 = ctx.alloc({0, 3, 2, 2});
    Tensor dw0 = make(ctx, {4, 3, 3, 3}, 4), kept = make(ctx, {4, 3, 3, 3}, 4), no_db;
    ctx.ops().conv2d_forward(ctx, x0, w0, Tensor(), y0, Conv2dParams{1, 1});
    ctx.ops().conv2d_backward(ctx, x0, w0, y0, dx0, dw0, no_db, Conv2dParams{1, 1},
                              InputGrad::Overwrite);
    CHECK(values(dw0) == values(kept));
  });
}

TEST_CASE("conv2d backward adding onto dx: the bits of a backward and an add, dw and db once") {
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    // 9x9 stride 1: a GEMM per sample (81 pixels); stride 2: batched; 4 input channels on 12x12
    // at stride 1: the direct convolution (in AVX-512 builds).
    struct Case { int64_t c, h; int stride; };
    for (Case cs : {Case{3, 9, 1}, Case{3, 9, 2}, Case{4, 12, 1}}) {
      CAPTURE(int(precision));
      CAPTURE(cs.c);
      CAPTURE(cs.stride);
      ContextOptions o;
      o.precision = precision;
      DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, o);
      const Shape xs = {5, cs.c, cs.h, cs.h}, ws = {4, cs.c, 3, 3};
      const Conv2dParams prm{cs.stride, 1};
      const int64_t q = window_out(cs.h, 3, cs.stride, 1);
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

TEST_CASE("each convolution says which way it ran: its op part, forward and backward alike") {
  // What replica-bench --suite ops prints under conv2d_forward and conv2d_backward. A 3x3 layer
  // on 2x2 planes takes the plane matrix; the CNN's second layer the direct convolution (AVX-512
  // builds), or one GEMM per sample with it switched off; 7x7 outputs, the batched GEMMs.
  struct Case { Layer l; const char* part; const char* direct; };
  const char* direct_part = cpu::direct_conv_built() ? cpu::kConvDirectPart
                                                     : cpu::kConvPerSamplePart;
  for (const Case& cs : {Case{Layer{3, 6, 4, 2, 2, 3, 1, 1}, cpu::kConvPlaneMatrixPart, "1"},
                         Case{Layer{3, 20, 20, 24, 24, 5, 1, 0}, direct_part, "1"},
                         Case{Layer{3, 20, 20, 24, 24, 5, 1, 0}, cpu::kConvPerSamplePart, "0"},
                         Case{Layer{3, 64, 64, 7, 7, 3, 1, 1}, cpu::kConvBatchedPart, "1"}}) {
    CAPTURE(cs.part);
    test::ScopedEnv direct("REPLICA_DIRECT_CONV", cs.direct);
    const Layer& l = cs.l;
    const ConvGeometry g = geometry_of(l);
    DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
    OpProfile profile;
    ctx.run([&] {
      Tensor x = make(ctx, {l.n, l.c, l.h, l.w}, 1), w = make(ctx, {l.k, l.c, l.r, l.r}, 2);
      Tensor y = ctx.alloc({l.n, l.k, g.p, g.q}), dy = make(ctx, {l.n, l.k, g.p, g.q}, 3);
      Tensor dx = ctx.alloc({l.n, l.c, l.h, l.w}), dw = make(ctx, {l.k, l.c, l.r, l.r}, 4);
      Tensor no_b;
      ctx.set_op_profile(&profile);
      ctx.ops().conv2d_forward(ctx, x, w, no_b, y, Conv2dParams{l.stride, l.pad});
      ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, no_b, Conv2dParams{l.stride, l.pad},
                                InputGrad::Overwrite);
      ctx.set_op_profile(nullptr);
    });
    auto parts = profile.parts();
    REQUIRE(parts["conv2d_forward"].size() == 1);
    REQUIRE(parts["conv2d_backward"].size() == 1);
    CHECK(parts["conv2d_forward"][cs.part].calls == 1);
    CHECK(parts["conv2d_backward"][cs.part].calls == 1);
  }
}
