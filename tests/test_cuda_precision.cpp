// Precision modes on the GPU. `--precision tf32` lets cuBLAS and cuDNN round GEMM and
// convolution inputs to TF32 (10-bit mantissa) on tensor cores. What must hold:
//  - the mode really changes the math where the GPU has TF32: a GEMM moves off the fp32 result by
//    about TF32's rounding (relative L2 ~3e-4 for 512-long dot products), where fp32 stays ~1e-7;
//  - it stays within that rounding for GEMMs and convolutions, forward and backward;
//  - training follows fp32: a few SGD steps of the CNN and ResNet-18 in tf32 track fp32.
// `--precision bf16` rounds operands and results to bf16 alike on both backends, so the GPU's
// bf16 is held against the CPU's bf16 (only the order of the fp32 sums differs, which moves a
// result by one bf16 step now and then) and must be visibly off fp32 (~2^-9 per operand).
// Strict fp32 (a DeviceContext's default) is what every parity and equivalence test uses.
// Skips visibly without a GPU, and the tf32 cases without TF32 tensor cores.
#include <doctest/doctest.h>

#include <string>
#include <tuple>
#include <vector>

#include "device_tensors.h"
#include "dp_reference.h"
#include "engine/context.h"
#include "engine/cudart.h"
#include "engine/data/dataset.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "gpu_skip.h"
#include "parallel/engines/train_engine.h"
#include "precision_rig.h"

using namespace replica;
using namespace test;

TEST_CASE("--precision resolves for this GPU: auto is tf32 exactly where tensor cores have it") {
  if (!test::have_gpu()) return;
  const std::vector<Device> gpu = {kGpu};
  const bool tf32 = cudart::compute_capability(0) >= 80;
  CHECK(resolve_precision("auto", gpu) == (tf32 ? Precision::Tf32 : Precision::Fp32));
  CHECK(resolve_precision("fp32", gpu) == Precision::Fp32);
  if (tf32) CHECK(resolve_precision("tf32", gpu) == Precision::Tf32);
  else CHECK_THROWS_AS(resolve_precision("tf32", gpu), UsageError);
  CHECK(resolve_precision("auto", {kGpu, Device{DeviceType::CPU, 0, 0}}) == Precision::Fp32);
}

TEST_CASE("tf32 GEMMs: off fp32 by TF32's rounding, forward and backward") {
  if (!have_tf32()) return;
  Trio t;
  const int64_t N = 256, in = 512, out = 384;
  auto fwd = on_all(t, {{N, in}, {out, in}}, {{N, out}},
                    [](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
                      c.ops().linear_forward(c, i[0], i[1], Tensor(), o[0]);
                    });
  expect_precisions(fwd[0], "linear y", true);
  auto bwd = on_all(t, {{N, in}, {out, in}, {N, out}}, {{N, in}, {out, in}},
                    [](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
                      Tensor no_db;
                      c.ops().linear_backward(c, i[0], i[1], i[2], o[0], o[1], no_db);
                    });
  expect_precisions(bwd[0], "linear dx", true);
  expect_precisions(bwd[1], "linear dw", true);
}

TEST_CASE("tf32 convolutions: within TF32's rounding, forward and backward") {
  if (!have_tf32()) return;
  Trio t;
  const Shape x{16, 64, 14, 14}, w{64, 64, 3, 3}, y{16, 64, 14, 14};
  const Conv2dParams p{1, 1};
  // cuDNN may still choose an FMA algorithm for a shape, so no "must differ" here.
  auto fwd = on_all(t, {x, w}, {y},
                    [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
                      c.ops().conv2d_forward(c, i[0], i[1], Tensor(), o[0], p);
                    });
  expect_precisions(fwd[0], "conv y", false);
  auto bwd = on_all(t, {x, w, y}, {x, w},
                    [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
                      Tensor no_db;
                      c.ops().conv2d_backward(c, i[0], i[1], i[2], o[0], o[1], no_db, p,
                                              InputGrad::Overwrite);
                    });
  expect_precisions(bwd[0], "conv dx", false);
  expect_precisions(bwd[1], "conv dw", false);
}

TEST_CASE("tf32 training follows fp32: CNN 3 SGD steps") {
  if (!have_tf32()) return;
  const double drift = test::precision_update_drift(kGpu, Precision::Tf32, 3, 8, 1e-2);
  CHECK(drift < 2e-2);
  if (!tf32_overridden()) CHECK(drift > 1e-6);  // its GEMMs went through TF32
}

// ResNet-18 at batch 8 is not smooth at TF32's scale: its max-pools route gradients by which of
// near-equal inputs is largest, and its last BatchNorms normalise 8 values per channel, so any
// ~1e-3 change flips some routes. On the CPU in fp32, noise of +-2^-11 (TF32's rounding) on the
// input pixels alone changes one step's update by 5.6% (relative L2); 1e-6 noise by 1.1e-5.
// On an H100 (2026-11-25) TF32 changed it by 11.2-11.6%, and the noise below by 5.6%. So TF32
// is compared with what its own rounding, put on the input alone, does in fp32 on the same GPU:
// within 5x of that. A wrong TF32 kernel (a bad algorithm, a lost term) changes it by O(1).
TEST_CASE("tf32 training follows fp32: ResNet-18 one SGD step, against rounding noise") {
  if (!have_tf32()) return;
  EngineOptions o = test::sgd_options("resnet18", {1, 28, 28});
  auto fp32 = make_single_device_engine(kGpu, o);
  auto noisy = make_single_device_engine(kGpu, o);
  o.precision = Precision::Tf32;
  auto tf32 = make_single_device_engine(kGpu, o);
  const Batch batch = test::make_batches(o.input_shape, 8, 1, 6).at(0);
  const test::NoiseDrift d =
      test::step_against_noise(*fp32, *tf32, *noisy, batch, 1.f / 2048, "resnet18 fp32 vs tf32");
  CHECK(d.drift < 5 * d.noise_drift);
  CHECK(d.drift < 0.5);
}

TEST_CASE("bf16 GEMMs and convolutions: the CPU's bf16 numbers, forward and backward") {
  if (!have_tf32()) return;  // bf16 tensor cores arrived with TF32's (compute capability 8.0)
  Trio t;
  const std::vector<DeviceContext*> ctxs = {&t.cpu, &t.cpu_bf16, &t.bf16};
  const int64_t N = 128, in = 512, out = 384;
  auto fwd = on_all(
      t, {{N, in}, {out, in}, {out}}, {{N, out}},
      [](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
        c.ops().linear_forward(c, i[0], i[1], i[2], o[0]);
      },
      ctxs);
  expect_bf16(fwd[0], "linear y");
  auto bwd = on_all(
      t, {{N, in}, {out, in}, {N, out}, {out, in}}, {{N, in}, {out, in}, {out}},
      [](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
        c.ops().copy(c, o[1], i[3]);  // dw accumulates onto a nonzero gradient
        c.ops().linear_backward(c, i[0], i[1], i[2], o[0], o[1], o[2]);
      },
      ctxs);
  expect_bf16(bwd[0], "linear dx");
  expect_bf16(bwd[1], "linear dw");
  CHECK(test::relative_l2(bwd[2][0], bwd[2][2]) < 1e-5);  // bias gradients stay fp32

  for (const auto& [x, w, p] : {std::tuple<Shape, Shape, Conv2dParams>{
                                    {16, 64, 14, 14}, {64, 64, 3, 3}, {1, 1}},
                                {{16, 32, 28, 28}, {64, 32, 1, 1}, {2, 0}}}) {
    CAPTURE(shape_str(x));
    const int64_t P = window_out(x[2], int(w[2]), p.stride, p.padding);
    const Shape y{x[0], w[0], P, P};
    auto cf = on_all(
        t, {x, w, {w[0]}}, {y},
        [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
          c.ops().conv2d_forward(c, i[0], i[1], i[2], o[0], p);
        },
        ctxs);
    expect_bf16(cf[0], "conv y");
    auto cb = on_all(
        t, {x, w, y}, {x, w},
        [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
          Tensor no_db;
          c.ops().conv2d_backward(c, i[0], i[1], i[2], o[0], o[1], no_db, p, InputGrad::Overwrite);
        },
        ctxs);
    expect_bf16(cb[0], "conv dx");
    expect_bf16(cb[1], "conv dw");
    // dx added onto what it holds (a residual block's first convolution): staged in bf16, NCHW
    // and NHWC, the result is added as it is copied back, as the CPU's bf16 adds its own.
    auto ca = on_all(
        t, {x, w, y, x}, {x, w},
        [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
          Tensor no_db;
          c.ops().copy(c, o[0], i[3]);
          c.ops().conv2d_backward(c, i[0], i[1], i[2], o[0], o[1], no_db, p,
                                  InputGrad::Accumulate);
        },
        {&t.cpu_bf16, &t.bf16, &t.bf16_nhwc});
    for (size_t g : {size_t(1), size_t(2)}) {
      CAPTURE(g);
      CHECK(test::relative_l2(ca[0][0], ca[0][g]) < 1e-3);  // dx (+=)
      CHECK(test::relative_l2(ca[1][0], ca[1][g]) < 1e-3);  // dw
    }
  }
}

TEST_CASE("bf16 training on the GPU follows the CPU's bf16: CNN 3 SGD steps") {
  if (!have_tf32()) return;
  const test::DeviceDrift d = test::device_vs_cpu_drift(kGpu, "cnn", Precision::Bf16, 3, 8, 1e-2);
  CHECK(d.params < 1e-3);
  CHECK(d.update < 0.1);  // a wrong gradient moves the update by its own size
}
