// CUDA vs CPU parity for every Backend op but convolution and BatchNorm (those are in
// test_cuda_conv_norm_parity.cpp): the same inputs through both backends, outputs compared within
// per-op tolerances. Odd shapes on purpose (batch 3, 5x7 images, stride 2, padding 1). Without
// a GPU every case says so, visibly, and passes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_parity_rig.h"
#include "engine/cudart.h"
#include "env_guard.h"
#include "gpu_skip.h"

using namespace replica;
using namespace test;

TEST_CASE("cuda runtime: device count, names and versions") {
  int n = -1;
  CHECK_NOTHROW(n = cuda_device_count());  // no driver or no GPU is zero, never an error
  CHECK(n >= 0);
  CHECK(cuda_device_count() == n);
  if (!test::have_gpu()) return;
  MESSAGE(cudart::versions());
  for (int i = 0; i < n; ++i) {
    CHECK(!cudart::device_name(i).empty());
    CHECK(cudart::device_total_memory(i) > 0);
  }
}

TEST_CASE("cuda parity: memory ops (fill, copy, add, scale, zero-size)") {
  if (!test::have_gpu()) return;
  Rig r;
  Pair a = make_random(r, {3, 5, 7}, 1);
  Pair b = make_random(r, {3, 5, 7}, 2);
  expect_close(r, a, 0, 0, "copy host->device->host round trip");

  r.c().add(r.cpu, a.c, b.c, -0.75f);
  r.g().add(r.gpu, a.g, b.g, -0.75f);
  expect_close(r, a, 1e-6, 1e-7, "add");

  r.c().scale(r.cpu, a.c, 3.5f);
  r.g().scale(r.gpu, a.g, 3.5f);
  expect_close(r, a, 1e-6, 1e-7, "scale");
  Pair u = make_random_unaligned(r, {3, 5, 7}, 4, -1.f, 1.f);  // one float at a time
  r.c().add(r.cpu, u.c, b.c, 2.f);
  r.g().add(r.gpu, u.g, b.g, 2.f);
  r.c().scale(r.cpu, u.c, -1.5f);
  r.g().scale(r.gpu, u.g, -1.5f);
  expect_close(r, u, 1e-6, 1e-7, "add and scale, unaligned");

  Tensor d2d = r.gpu.alloc({3, 5, 7});
  r.g().copy(r.gpu, d2d, a.g);
  expect_close(host_values(a.c), gpu_values(r, d2d), 0, 0, "device-to-device copy");

  Pair f = make_random(r, {13}, 3);
  r.c().fill(r.cpu, f.c, 2.5f);
  r.g().fill(r.gpu, f.g, 2.5f);
  expect_close(r, f, 0, 0, "fill 2.5");
  r.c().fill(r.cpu, f.c, 0.f);
  r.g().fill(r.gpu, f.g, 0.f);
  expect_close(r, f, 0, 0, "fill 0");

  Tensor ig = r.gpu.alloc({1}, DType::I32);
  r.g().fill(r.gpu, ig, 7.f);
  CHECK(gpu_int(r, ig) == 7);

  // Zero-size tensors are no-ops, not errors.
  Tensor z1 = r.gpu.alloc({0, 4}), z2 = r.gpu.alloc({0, 4});
  CHECK_NOTHROW(r.g().fill(r.gpu, z1, 1.f));
  CHECK_NOTHROW(r.g().add(r.gpu, z1, z2, 1.f));
  CHECK_NOTHROW(r.g().scale(r.gpu, z1, 2.f));
  CHECK_NOTHROW(r.g().copy(r.gpu, z1, z2));
  CHECK_NOTHROW(r.g().relu_forward(r.gpu, z1, z2));
  CHECK_NOTHROW(r.gpu.synchronize());
}

TEST_CASE("cuda parity: gather_rows (float4 rows, odd rows, I32 labels, an unaligned table)") {
  if (!test::have_gpu()) return;
  Rig r;
  const std::vector<int32_t> rows = {4, 0, 4, 2, 6};  // repeats and out of order
  Pair idx = make_labels(r, rows);
  // Shapes: rows of 28 floats (the float4 path), of 7 (one float at a time); labels are I32 rows
  // of one element; a table starting one float into an allocation takes the 4-byte path.
  for (const Shape& table_shape : {Shape{7, 1, 4, 7}, Shape{7, 7}}) {
    CAPTURE(shape_str(table_shape));
    Pair table = make_random(r, table_shape, 11);
    Shape out_shape = table_shape;
    out_shape[0] = 5;
    Pair out = make_random(r, out_shape, 12);
    r.c().gather_rows(r.cpu, out.c, table.c, idx.c);
    r.g().gather_rows(r.gpu, out.g, table.g, idx.g);
    expect_close(r, out, 0, 0, "gather_rows");
  }
  Pair big = make_random(r, {1 + 7 * 8}, 13);
  Tensor unaligned_g = big.g.slice_rows(1, 1 + 7 * 8).reshape({7, 8});
  Tensor unaligned_c = big.c.slice_rows(1, 1 + 7 * 8).reshape({7, 8});
  Pair out{r.cpu.alloc({5, 8}), r.gpu.alloc({5, 8})};
  r.c().gather_rows(r.cpu, out.c, unaligned_c, idx.c);
  r.g().gather_rows(r.gpu, out.g, unaligned_g, idx.g);
  expect_close(r, out, 0, 0, "gather_rows from a table 4 bytes past an alignment");

  Pair labels = make_labels(r, {10, 11, 12, 13, 14, 15, 16});
  Tensor got = r.gpu.alloc({5}, DType::I32);
  r.g().gather_rows(r.gpu, got, labels.g, idx.g);
  const std::vector<int32_t> host = gpu_ints(r, got);
  for (int i = 0; i < 5; ++i) CHECK(host[size_t(i)] == 10 + rows[size_t(i)]);
}

TEST_CASE("cuda parity: linear forward and backward") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t N = 3, in = 7, out = 5;
  Pair x = make_random(r, {N, in}, 10), w = make_random(r, {out, in}, 11);
  Pair b = make_random(r, {out}, 12), dy = make_random(r, {N, out}, 13);
  Pair y = make_random(r, {N, out}, 14), y2 = make_random(r, {N, out}, 15);
  r.c().linear_forward(r.cpu, x.c, w.c, b.c, y.c);
  r.g().linear_forward(r.gpu, x.g, w.g, b.g, y.g);
  expect_close(r, y, kGemmRtol, kGemmAtol, "linear y (with bias)");
  r.c().linear_forward(r.cpu, x.c, w.c, Tensor(), y2.c);
  r.g().linear_forward(r.gpu, x.g, w.g, Tensor(), y2.g);
  expect_close(r, y2, kGemmRtol, kGemmAtol, "linear y (no bias)");

  // dw and db accumulate onto what is there; dx is overwritten.
  Pair dx = make_random(r, {N, in}, 16), dw = make_random(r, {out, in}, 17);
  Pair db = make_random(r, {out}, 18);
  for (int rep = 0; rep < 2; ++rep) {
    r.c().linear_backward(r.cpu, x.c, w.c, dy.c, dx.c, dw.c, db.c);
    r.g().linear_backward(r.gpu, x.g, w.g, dy.g, dx.g, dw.g, db.g);
  }
  expect_close(r, dx, kGemmRtol, kGemmAtol, "linear dx");
  expect_close(r, dw, kGemmRtol, kGemmAtol, "linear dw (+= twice)");
  expect_close(r, db, kGemmRtol, kGemmAtol, "linear db (+= twice)");

  // Skipped outputs and an empty batch.
  Tensor none;
  CHECK_NOTHROW(r.g().linear_backward(r.gpu, x.g, w.g, dy.g, none, dw.g, none));
  Tensor x0 = r.gpu.alloc({0, in}), y0 = r.gpu.alloc({0, out});
  CHECK_NOTHROW(r.g().linear_forward(r.gpu, x0, w.g, b.g, y0));
  CHECK_NOTHROW(r.gpu.synchronize());

  // The bias passes' 64-bit index path (real shapes take it only past 2^31 values).
  const test::WideIndexPath wide;
  Pair yw = make_random(r, {N, out}, 19), dbw = make_random(r, {out}, 20);
  r.c().linear_forward(r.cpu, x.c, w.c, b.c, yw.c);
  r.g().linear_forward(r.gpu, x.g, w.g, b.g, yw.g);
  expect_close(r, yw, kGemmRtol, kGemmAtol, "linear y (with bias, wide index)");
  r.c().linear_backward(r.cpu, x.c, w.c, dy.c, none, none, dbw.c);
  r.g().linear_backward(r.gpu, x.g, w.g, dy.g, none, none, dbw.g);
  expect_close(r, dbw, kGemmRtol, kGemmAtol, "linear db (wide index)");
}

TEST_CASE("cuda parity: relu, mul and dropout") {
  if (!test::have_gpu()) return;
  Rig r;
  // Float4s (420 values), float4s and a tail of 1 (105), and one float at a time (unaligned).
  for (const Shape& shape : {Shape{3, 4, 5, 7}, Shape{3, 5, 7}})
    for (const bool unaligned : {false, true}) {
      const auto make = unaligned ? make_random_unaligned : make_random;
      const std::string tag = shape_str(shape) + (unaligned ? " unaligned" : "");
      Pair x = make(r, shape, 50, -1.f, 1.f), y = make(r, shape, 51, -1.f, 1.f);
      Pair dy = make(r, shape, 52, -1.f, 1.f), dx = make(r, shape, 53, -1.f, 1.f);
      r.c().relu_forward(r.cpu, x.c, y.c);
      r.g().relu_forward(r.gpu, x.g, y.g);
      expect_close(r, y, 0, 0, "relu y " + tag);
      r.c().relu_backward(r.cpu, y.c, dy.c, dx.c);
      r.g().relu_backward(r.gpu, y.g, dy.g, dx.g);
      expect_close(r, dx, 0, 0, "relu dx " + tag);
      Pair prod = make(r, shape, 54, -1.f, 1.f);
      r.c().mul(r.cpu, x.c, dy.c, prod.c);
      r.g().mul(r.gpu, x.g, dy.g, prod.g);
      expect_close(r, prod, 0, 0, "mul " + tag);
    }

  const Shape s{3, 4, 5, 7};
  Pair x = make_random(r, s, 50);

  for (float p : {0.f, 0.3f, 0.5f, 1.f}) {
    Pair yd = make_random(r, s, 55), mask = make_random(r, s, 56);
    r.c().dropout_forward(r.cpu, x.c, yd.c, mask.c, p, 1234567);
    r.g().dropout_forward(r.gpu, x.g, yd.g, mask.g, p, 1234567);
    expect_close(r, mask, 0, 0, "dropout mask p=" + std::to_string(p));
    expect_close(r, yd, 0, 0, "dropout y p=" + std::to_string(p));
  }
}

namespace {

void maxpool_case(const Shape& xs, Pool2dParams p, bool ties) {
  Rig r;
  const int64_t P = window_out(xs[2], p.kernel, p.stride, p.padding);
  const int64_t Q = window_out(xs[3], p.kernel, p.stride, p.padding);
  const Shape ys{xs[0], xs[1], P, Q};
  std::vector<float> v = random_values(shape_numel(xs), 60, -3.f, 3.f);
  if (ties)
    for (auto& e : v) e = std::round(e);  // few distinct values: many tied maxima
  const std::string tag = "maxpool " + shape_str(xs) + " k" + std::to_string(p.kernel) + " s" +
                          std::to_string(p.stride) + " p" + std::to_string(p.padding) +
                          (ties ? " ties" : "");
  Pair x = make_twin(r, xs, v), y = make_random(r, ys, 61), dy = make_random(r, ys, 62);
  Pair dx = make_random(r, xs, 63);
  r.c().maxpool2d_forward(r.cpu, x.c, y.c, p);
  r.g().maxpool2d_forward(r.gpu, x.g, y.g, p);
  expect_close(r, y, 0, 0, tag + " y");
  r.c().maxpool2d_backward(r.cpu, x.c, y.c, dy.c, dx.c, p);
  r.g().maxpool2d_backward(r.gpu, x.g, y.g, dy.g, dx.g, p);
  expect_close(r, dx, 1e-6, 1e-7, tag + " dx");
}

void adaptive_case(const Shape& xs, int64_t P, int64_t Q) {
  Rig r;
  const Shape ys{xs[0], xs[1], P, Q};
  const std::string tag = "adaptive avgpool " + shape_str(xs) + " -> " + std::to_string(P) + "x" +
                          std::to_string(Q);
  Pair x = make_random(r, xs, 70), y = make_random(r, ys, 71), dy = make_random(r, ys, 72);
  Pair dx = make_random(r, xs, 73);
  r.c().adaptive_avgpool2d_forward(r.cpu, x.c, y.c);
  r.g().adaptive_avgpool2d_forward(r.gpu, x.g, y.g);
  expect_close(r, y, 1e-6, 1e-7, tag + " y");
  r.c().adaptive_avgpool2d_backward(r.cpu, dy.c, dx.c);
  r.g().adaptive_avgpool2d_backward(r.gpu, dy.g, dx.g);
  expect_close(r, dx, 1e-6, 1e-7, tag + " dx");
}

}  // namespace

TEST_CASE("cuda parity: max pooling") {
  if (!test::have_gpu()) return;
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, false);  // ResNet's stem pool
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, true);
  maxpool_case({3, 4, 5, 7}, Pool2dParams{2, 2, 0}, true);
  maxpool_case({3, 2, 9, 8}, Pool2dParams{3, 1, 1}, true);  // overlapping windows, stride 1
  const test::WideIndexPath wide;  // the 64-bit index path
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, true);
  maxpool_case({3, 2, 9, 8}, Pool2dParams{3, 1, 1}, true);
}

TEST_CASE("cuda parity: adaptive average pooling") {
  if (!test::have_gpu()) return;
  adaptive_case({3, 4, 7, 7}, 1, 1);
  adaptive_case({3, 4, 5, 5}, 2, 2);
  adaptive_case({3, 4, 5, 7}, 3, 2);
  adaptive_case({3, 2, 3, 2}, 5, 4);  // output larger than input
  const test::WideIndexPath wide;  // the 64-bit index path
  adaptive_case({3, 4, 5, 7}, 3, 2);
  adaptive_case({3, 2, 3, 2}, 5, 4);
}

TEST_CASE("cuda parity: cross-entropy and count_correct") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t N = 5, C = 7;
  Pair logits = make_random(r, {N, C}, 80, -4.f, 4.f), probs = make_random(r, {N, C}, 81);
  Pair loss = make_random(r, {1}, 82);
  Pair labels = make_labels(r, {3, 0, 6, 2, 3});
  r.c().cross_entropy_forward(r.cpu, logits.c, labels.c, probs.c, loss.c);
  r.g().cross_entropy_forward(r.gpu, logits.g, labels.g, probs.g, loss.g);
  expect_close(r, probs, 1e-5, 1e-7, "cross-entropy probs");
  expect_close(r, loss, 1e-5, 1e-7, "cross-entropy loss");

  Pair dlogits = make_random(r, {N, C}, 83);
  r.c().cross_entropy_backward(r.cpu, probs.c, labels.c, 1.f / N, dlogits.c);
  r.g().cross_entropy_backward(r.gpu, probs.g, labels.g, 1.f / N, dlogits.g);
  expect_close(r, dlogits, 1e-5, 1e-7, "cross-entropy dlogits");

  // A label out of range gives a NaN loss on both.
  Pair bad = make_labels(r, {3, 0, 7, 2, 3});
  r.c().cross_entropy_forward(r.cpu, logits.c, bad.c, probs.c, loss.c);
  r.g().cross_entropy_forward(r.gpu, logits.g, bad.g, probs.g, loss.g);
  CHECK(std::isnan(gpu_values(r, loss.g)[0]));
  expect_close(r, loss, 0, 0, "cross-entropy loss, bad label");

  // count_correct adds to what is there; ties go to the lower index, a NaN label logit and a
  // label out of range are never counted; top-1 ... top-K for K = 1, 5 and past C.
  std::vector<float> tied = random_values(N * C, 84);
  for (auto& e : tied) e = std::round(e * 2.f);
  tied[3] = std::nanf("");  // row 0's label (3)
  tied[C + 4] = std::nanf("");  // another class of row 1
  Pair tl = make_twin(r, {N, C}, tied);
  for (const int64_t K : {int64_t(1), int64_t(5), C + 2}) {
    for (const Pair* lg : {&logits, &tl}) {
      CAPTURE(K);
      Tensor cc = r.cpu.alloc({K}, DType::I32);
      Tensor cg = r.gpu.alloc({K}, DType::I32);
      r.c().fill(r.cpu, cc, 3.f);
      r.g().fill(r.gpu, cg, 3.f);
      for (const Pair* lb : {&labels, &bad}) {
        r.c().count_correct(r.cpu, lg->c, lb->c, cc);
        r.g().count_correct(r.gpu, lg->g, lb->g, cg);
      }
      CHECK(gpu_ints(r, cg) == std::vector<int32_t>(cc.i32(), cc.i32() + K));
    }
  }
}

TEST_CASE("cuda parity: sgd (momentum, nesterov, weight decay)") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t n = 1000;
  struct Variant {
    SgdConfig c;
    const char* name;
  };
  const Variant variants[] = {
      {SgdConfig{0.1f, 0.9f, 0.f, 1e-4f, true}, "momentum 0.9 nesterov wd 1e-4"},
      {SgdConfig{0.05f, 0.9f, 0.1f, 5e-4f, false}, "momentum 0.9 dampening 0.1 wd 5e-4"},
      {SgdConfig{0.1f, 0.f, 0.f, 1e-2f, false}, "plain, wd 1e-2"},
  };
  for (const auto& var : variants) {
    Pair p = make_random(r, {n}, 90), buf = make_random(r, {n}, 91);
    const bool momentum = var.c.momentum != 0.f;
    Tensor bc = momentum ? buf.c : Tensor(), bg = momentum ? buf.g : Tensor();
    for (int step = 0; step < 3; ++step) {
      Pair g = make_random(r, {n}, 92 + step);
      Pair scalars = step_scalars(r, sgd_step_scalars(var.c, step == 0));
      r.c().sgd_step(r.cpu, p.c, g.c, bc, var.c, scalars.c);
      r.g().sgd_step(r.gpu, p.g, g.g, bg, var.c, scalars.g);
    }
    expect_close(r, p, 1e-5, 1e-6, std::string("sgd params, ") + var.name);
    if (momentum) expect_close(r, buf, 1e-5, 1e-6, std::string("sgd buffer, ") + var.name);
  }
}

TEST_CASE("cuda parity: adam, 3 steps") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t n = 1000;
  AdamConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 1e-2f;
  Pair p = make_random(r, {n}, 100);
  Pair m = make_twin(r, {n}, std::vector<float>(n, 0.f));
  Pair v = make_twin(r, {n}, std::vector<float>(n, 0.f));
  for (int64_t step = 1; step <= 3; ++step) {
    Pair g = make_random(r, {n}, 101 + static_cast<uint32_t>(step));
    Pair scalars = step_scalars(r, adam_step_scalars(c, step));
    r.c().adam_step(r.cpu, p.c, g.c, m.c, v.c, c, scalars.c);
    r.g().adam_step(r.gpu, p.g, g.g, m.g, v.g, c, scalars.g);
  }
  expect_close(r, p, 1e-5, 1e-6, "adam params");
  expect_close(r, m, 1e-5, 1e-7, "adam m");
  expect_close(r, v, 1e-5, 1e-8, "adam v");
}
