// The CPU convolution: the same bits for 1, 2 and 3 threads, rows copied as runs, the tap
// table and the plane matrix equal to a convolution summed in double, a backward adding onto dx
// the bits of a backward then an add, and which way each layer ran. The direct convolution's
// own cases: tests/test_direct_conv_cpu.cpp.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "conv_layer_check.h"
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
    check_against_double_sum(l);
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
      check_against_double_sum(l);
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
