// channels_last activations on the GPU (engine/tensor.h): copies between layouts give the CPU's
// bits; BatchNorm, ReLU and add read and write NHWC tensors themselves and give NCHW's results;
// convolutions read and write them where they are; ResNets trained with them follow NCHW within
// rounding noise. tests/test_channels_last.cpp proves the layers' plumbing on CPU devices.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device_tensors.h"
#include "dp_reference.h"
#include "engine/context.h"
#include "engine/cuda/op_parts.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "engine/ops.h"
#include "env_guard.h"
#include "gpu_skip.h"
#include "parallel/engines/train_engine.h"
#include "seeded_values.h"

using namespace replica;

using test::get;
using test::normal_values;
using test::put;

namespace {

const Device kGpu{DeviceType::CUDA, 0, 0};

ContextOptions options(Precision precision, bool channels_last) {
  ContextOptions o{0, true, precision};
  o.channels_last = channels_last;
  return o;
}

bool have_bf16() { return test::have_tensor_cores("bf16 cases"); }

// The bits of each value (a NaN equals a NaN of the same bits; -0 differs from 0).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("copy between layouts on the GPU gives the CPU's bits (F32, BF16, partial tiles)") {
  if (!test::have_gpu()) return;
  DeviceContext gpu(kGpu, options(Precision::Fp32, false));
  for (const Shape& shape : {Shape{3, 40, 7, 9}, Shape{2, 64, 1, 1}, Shape{2, 1, 5, 5},
                             Shape{2, 96, 33, 35}}) {
    CAPTURE(shape_str(shape));
    const auto v = normal_values(shape_numel(shape), 3);
    const Tensor nchw = put(gpu, shape, v);
    for (DType dtype : {DType::F32, DType::BF16}) {
      Tensor nhwc = gpu.alloc(shape, dtype, true);
      gpu.ops().copy(gpu, nhwc, nchw);  // the GPU's transposes
      const Tensor expected = put(gpu, shape, v, dtype, true);  // the CPU's
      CHECK(get(gpu, nhwc) == get(gpu, expected));
      Tensor back = gpu.alloc(shape);
      gpu.ops().copy(gpu, back, nhwc);
      CHECK(get(gpu, back) == get(gpu, put(gpu, shape, v, dtype, false)));
    }
  }
}

TEST_CASE("BatchNorm, ReLU and add take channels_last tensors themselves: NCHW's results") {
  if (!test::have_gpu()) return;
  for (const Precision precision : {Precision::Fp32, Precision::Bf16}) {
    if (precision == Precision::Bf16 && !have_bf16()) continue;
    const DType dt = precision == Precision::Bf16 ? DType::BF16 : DType::F32;
    const double tol = dt == DType::BF16 ? 2e-3 : 1e-5;  // BF16: a few roundings flip
    DeviceContext gpu(kGpu, options(precision, true));
    // 64, 40 and 256 channels: 2, 1 and 4 channels a thread in the row passes; 847 rows end
    // their last slice early. fused: a residual and a ReLU in the output pass and the ReLU's
    // mask in backward (a residual block's), or none of them in training and both in eval.
    std::vector<std::pair<Shape, bool>> cases;
    for (const Shape& shape : {Shape{4, 64, 9, 9}, Shape{3, 40, 5, 7}, Shape{8, 256, 14, 14},
                               Shape{7, 128, 11, 11}})
      for (const bool fused : {true, false}) cases.emplace_back(shape, fused);
    for (const auto& one : cases) {
      const Shape& shape = one.first;
      const bool fused = one.second;
      CAPTURE(shape_str(shape));
      CAPTURE(precision_name(precision));
      CAPTURE(fused);
      const int64_t C = shape[1];
      const int64_t n = shape_numel(shape);
      const auto xv = normal_values(n, 1), rv = normal_values(n, 2), gv = normal_values(n, 4);
      struct Run {
        std::vector<float> y, mean, invstd, running, dx, dgamma, dbeta, eval, relu_dx, sum;
      };
      // cl: every tensor channels_last; res_cl: the residual's layout (mixed: NCHW copies).
      auto run = [&](bool cl, bool res_cl) {
        Run r;
        OpProfile profile;  // all channels_last: no op may run on NCHW copies
        gpu.set_op_profile(&profile);
        const Tensor x = put(gpu, shape, xv, dt, cl), res = put(gpu, shape, rv, dt, res_cl);
        const Tensor dy = put(gpu, shape, gv, dt, cl);
        Tensor gamma = put(gpu, {C}, normal_values(C, 5));
        Tensor beta = put(gpu, {C}, normal_values(C, 6));
        Tensor rm = gpu.alloc({C}), rvar = gpu.alloc({C}), mean = gpu.alloc({C});
        Tensor invstd = gpu.alloc({C}), dgamma = gpu.alloc({C}), dbeta = gpu.alloc({C});
        gpu.ops().fill(gpu, rm, 0.f);
        gpu.ops().fill(gpu, rvar, 1.f);
        gpu.ops().fill(gpu, dgamma, 0.f);
        gpu.ops().fill(gpu, dbeta, 0.f);
        Tensor y = gpu.alloc_as(x), dx = gpu.alloc_as(x), eval = gpu.alloc_as(x);
        const Tensor none;
        gpu.ops().batchnorm_forward_train(gpu, x, gamma, beta, rm, rvar, 0.1f, 1e-5f, y, mean,
                                          invstd, fused ? res : none, fused);
        gpu.ops().batchnorm_backward(gpu, x, gamma, mean, invstd, dy, fused ? y : none, dx,
                                     dgamma, dbeta);
        gpu.ops().batchnorm_forward_eval(gpu, x, gamma, beta, rm, rvar, 1e-5f, eval,
                                         fused ? none : res, !fused);
        Tensor relu_dx = gpu.alloc_as(x), sum = put(gpu, shape, rv, dt, cl);
        gpu.ops().relu_backward(gpu, y, dy, relu_dx);
        gpu.ops().add(gpu, sum, x, 0.5f);
        gpu.set_op_profile(nullptr);
        if (cl && res_cl) {
          for (const auto& [key, parts] : profile.parts()) {
            CAPTURE(key);
            CHECK(parts.count("NCHW copies of channels_last tensors") == 0);
            CHECK(parts.count("F32 NCHW copies of BF16 channels_last tensors") == 0);
          }
        }
        r.y = get(gpu, y), r.mean = get(gpu, mean), r.invstd = get(gpu, invstd);
        r.running = get(gpu, rvar), r.dx = get(gpu, dx), r.dgamma = get(gpu, dgamma);
        r.dbeta = get(gpu, dbeta), r.eval = get(gpu, eval);
        r.relu_dx = get(gpu, relu_dx), r.sum = get(gpu, sum);
        return r;
      };
      const Run a = run(false, false), b = run(true, true), mixed = run(true, false);
      CHECK(test::relative_l2(a.y, mixed.y) < tol);
      CHECK(test::relative_l2(a.dx, mixed.dx) < tol);
      CHECK(test::relative_l2(a.y, b.y) < tol);
      CHECK(test::relative_l2(a.mean, b.mean) < 1e-5);
      CHECK(test::relative_l2(a.invstd, b.invstd) < 1e-5);
      CHECK(test::relative_l2(a.running, b.running) < 1e-5);
      CHECK(test::relative_l2(a.dx, b.dx) < tol);
      CHECK(test::relative_l2(a.dgamma, b.dgamma) < 1e-4);
      CHECK(test::relative_l2(a.dbeta, b.dbeta) < 1e-4);
      CHECK(test::relative_l2(a.eval, b.eval) < tol);
      CHECK(test::relative_l2(a.relu_dx, b.relu_dx) < tol);
      CHECK(a.sum == b.sum);  // add is flat: the same sums, element by element
      // A 2-D operand of as many elements beside a channels_last one is in NCHW's order: add
      // must not pair its elements with the NHWC ones position by position.
      Tensor nhwc = put(gpu, shape, rv, dt, true);
      const Tensor flat = put(gpu, {shape[0], shape_numel(shape) / shape[0]}, xv, dt, false);
      gpu.ops().add(gpu, nhwc, flat, 0.5f);
      CHECK(get(gpu, nhwc) == a.sum);
    }
  }
}

TEST_CASE("max pooling takes channels_last tensors itself: NCHW's bits") {
  if (!test::have_gpu()) return;
  struct Case {
    Shape x;
    Pool2dParams p;
  };
  // 64 channels: four a thread; 6: one; ResNet's 3x3 stride-2 pool, non-overlapping windows,
  // stride 1 (four covering windows a position), an output of one pixel.
  const Case cases[] = {{{4, 64, 17, 15}, {3, 2, 1}}, {{3, 6, 9, 9}, {3, 2, 1}},
                        {{2, 64, 8, 8}, {2, 2, 0}},   {{2, 12, 7, 9}, {3, 1, 1}},
                        {{2, 8, 3, 3}, {3, 2, 0}}};
  for (const bool wide : {false, true}) {
    std::optional<test::WideIndexPath> wide_path;  // the 64-bit index path too
    if (wide) wide_path.emplace();
    for (const Precision precision : {Precision::Fp32, Precision::Bf16}) {
      if (precision == Precision::Bf16 && !have_bf16()) continue;
      const DType dt = precision == Precision::Bf16 ? DType::BF16 : DType::F32;
      DeviceContext gpu(kGpu, options(precision, true));
      for (const Case& c : cases) {
        CAPTURE(shape_str(c.x));
        CAPTURE(c.p.kernel);
        CAPTURE(c.p.stride);
        CAPTURE(precision_name(precision));
        CAPTURE(wide);
        const Shape ys{c.x[0], c.x[1], window_out(c.x[2], c.p.kernel, c.p.stride, c.p.padding),
                       window_out(c.x[3], c.p.kernel, c.p.stride, c.p.padding)};
        // Few distinct values (tied maxima: the first wins), and a NaN (it wins its windows).
        auto xv = normal_values(shape_numel(c.x), 12);
        for (float& v : xv) v = std::round(v);
        xv[5] = std::nanf("");
        const auto gv = normal_values(shape_numel(ys), 13);
        auto run = [&](bool cl) {
          OpProfile profile;
          gpu.set_op_profile(&profile);
          const Tensor x = put(gpu, c.x, xv, dt, cl), dy = put(gpu, ys, gv, dt, cl);
          Tensor y = gpu.alloc(ys, dt, cl), dx = gpu.alloc_as(x);
          gpu.ops().maxpool2d_forward(gpu, x, y, c.p);
          gpu.ops().maxpool2d_backward(gpu, x, y, dy, dx, c.p);
          gpu.set_op_profile(nullptr);
          if (cl)
            for (const auto& [key, parts] : profile.parts()) {
              CAPTURE(key);
              CHECK(parts.count("NCHW copies of channels_last tensors") == 0);
            }
          return std::make_pair(get(gpu, y), get(gpu, dx));
        };
        const auto a = run(false), b = run(true);
        CHECK(same_bits(a.first, b.first));
        CHECK(same_bits(a.second, b.second));
      }
    }
  }
}

TEST_CASE("convolutions read and write channels_last tensors where they are: NCHW's results") {
  if (!test::have_gpu()) return;
  struct Case {
    Shape x, w;
    Conv2dParams p;
    bool bias;
  };
  const Case cases[] = {{{4, 16, 13, 11}, {40, 16, 3, 3}, {1, 1}, true},
                        {{2, 64, 14, 14}, {128, 64, 1, 1}, {2, 0}, false},
                        {{3, 72, 7, 7}, {64, 72, 3, 3}, {1, 1}, false}};
  for (const Precision precision : {Precision::Fp32, Precision::Bf16}) {
    if (precision == Precision::Bf16 && !have_bf16()) continue;
    const DType dt = precision == Precision::Bf16 ? DType::BF16 : DType::F32;
    const double tol = dt == DType::BF16 ? 2e-3 : 1e-5;
    DeviceContext nchw(kGpu, options(precision, false)), nhwc(kGpu, options(precision, true));
    for (const Case& c : cases) {
      CAPTURE(shape_str(c.x));
      CAPTURE(precision_name(precision));
      const int64_t K = c.w[0];
      const Shape ys{c.x[0], K, window_out(c.x[2], int(c.w[2]), c.p.stride, c.p.padding),
                     window_out(c.x[3], int(c.w[2]), c.p.stride, c.p.padding)};
      const auto xv = normal_values(shape_numel(c.x), 7), wv = normal_values(shape_numel(c.w), 8);
      const auto bv = normal_values(K, 9), gv = normal_values(shape_numel(ys), 10);
      const auto sv = normal_values(shape_numel(c.x), 11);
      auto run = [&](DeviceContext& ctx, bool cl) {
        const Tensor x = put(ctx, c.x, xv, dt, cl), w = put(ctx, c.w, wv);
        const Tensor b = c.bias ? put(ctx, {K}, bv) : Tensor();
        Tensor y = ctx.alloc(ys, dt, cl);
        ctx.ops().conv2d_forward(ctx, x, w, b, y, c.p);
        const Tensor dy = put(ctx, ys, gv, dt, cl);
        Tensor dx = ctx.alloc_as(x), dw = put(ctx, c.w, wv);
        Tensor db = c.bias ? put(ctx, {K}, bv) : Tensor();
        ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, c.p, InputGrad::Overwrite);
        Tensor sum = put(ctx, c.x, sv, dt, cl);  // a residual block's dx, added onto
        Tensor no_dw, no_db;
        ctx.ops().conv2d_backward(ctx, x, w, dy, sum, no_dw, no_db, c.p, InputGrad::Accumulate);
        std::vector<std::vector<float>> out = {get(ctx, y), get(ctx, dx), get(ctx, dw),
                                               get(ctx, sum)};
        if (c.bias) out.push_back(get(ctx, db));
        return out;
      };
      // NCHW; channels_last tensors where they are; NCHW tensors staged into NHWC (a first
      // block's input, the residual sum added onto an NCHW tensor).
      const auto a = run(nchw, false), b = run(nhwc, true), staged = run(nhwc, false);
      for (size_t k = 0; k < a.size(); ++k) {
        CAPTURE(k);  // y, dx, dw, dx added onto, db
        CHECK(test::relative_l2(a[k], b[k]) < tol);
        CHECK(test::relative_l2(a[k], staged[k]) < tol);
      }
    }
  }
  // A first layer's few input channels (3, or the seed recipe's 1) in a channels_last context:
  // run NHWC on operands padded with zero channels to 8 (engine/cuda/conv_padded.cu); 12
  // channels into 20, which cuDNN's NHWC kernels do not take, run NCHW on NCHW copies. Given
  // NCHW tensors (a ResNet's stem) or channels_last ones; with a bias, dx overwritten and dx
  // added onto. NCHW's results (the padding's gradients dropped).
  struct Few {
    Shape x, w;
    Conv2dParams p;
  };
  const Few few[] = {{{2, 3, 8, 8}, {8, 3, 3, 3}, {1, 0}},
                     {{3, 1, 9, 9}, {16, 1, 3, 3}, {2, 1}},
                     {{4, 3, 32, 32}, {64, 3, 7, 7}, {2, 3}},  // a ResNet's stem
                     {{2, 12, 8, 8}, {20, 12, 3, 3}, {1, 1}}};
  const test::ScopedEnv padded("REPLICA_PAD_CHANNELS", "1");  // off by default
  for (const Precision precision : {Precision::Fp32, Precision::Bf16}) {
    if (precision == Precision::Bf16 && !have_bf16()) continue;
    CAPTURE(precision_name(precision));
    const DType dt = precision == Precision::Bf16 ? DType::BF16 : DType::F32;
    DeviceContext nchw(kGpu, options(precision, false));
    DeviceContext nhwc(kGpu, options(precision, true));
    for (const Few& c : few) {
      CAPTURE(shape_str(c.x));
      const int64_t K = c.w[0];
      const Shape ys{c.x[0], K, window_out(c.x[2], int(c.w[2]), c.p.stride, c.p.padding),
                     window_out(c.x[3], int(c.w[2]), c.p.stride, c.p.padding)};
      const auto xv = normal_values(shape_numel(c.x), 1), wv = normal_values(shape_numel(c.w), 2);
      const auto gv = normal_values(shape_numel(ys), 3), bv = normal_values(K, 4);
      const auto sv = normal_values(shape_numel(c.x), 5);
      auto run = [&](DeviceContext& ctx, bool cl) {
        OpProfile profile;  // which way each convolution ran: padded, or NCHW on copies
        ctx.set_op_profile(&profile);
        const Tensor x = put(ctx, c.x, xv, dt, cl), w = put(ctx, c.w, wv);
        const Tensor b = put(ctx, {K}, bv);
        Tensor y = ctx.alloc(ys, dt, cl);
        ctx.ops().conv2d_forward(ctx, x, w, b, y, c.p);
        const Tensor dy = put(ctx, ys, gv, dt, cl);
        Tensor dx = ctx.alloc_as(x), dw = put(ctx, c.w, wv), db = put(ctx, {K}, bv);
        ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, c.p, InputGrad::Overwrite);
        Tensor sum = put(ctx, c.x, sv, dt, cl), no_dw, no_db;
        ctx.ops().conv2d_backward(ctx, x, w, dy, sum, no_dw, no_db, c.p, InputGrad::Accumulate);
        ctx.set_op_profile(nullptr);
        // Padded exactly where the channels are few and the context channels_last: each pass
        // of each call times its padding (the NCHW fallback gives the same numbers).
        const bool pads = ctx.channels_last() && c.x[1] < 8;
        const auto parts = profile.parts();
        // forward: one padding; backward, called twice: its operands, then its gradients back
        for (const auto& [op, calls] : {std::pair<std::string, int64_t>{"conv2d_forward", 1},
                                        {"conv2d_backward", 4}}) {
          CAPTURE(op);
          const auto it = parts.find(op);
          const bool timed =
              it != parts.end() && it->second.count(replica::cuda::kPaddingPart);
          CHECK(timed == pads);
          if (timed) CHECK(it->second.at(replica::cuda::kPaddingPart).calls == calls);
        }
        return std::vector<std::vector<float>>{get(ctx, y), get(ctx, dx), get(ctx, dw),
                                               get(ctx, db), get(ctx, sum)};
      };
      const auto a = run(nchw, false), stem = run(nhwc, false), b = run(nhwc, true);
      for (size_t k = 0; k < a.size(); ++k) {
        CAPTURE(k);  // y, dx, dw (added onto), db (added onto), dx added onto
        const double tol = dt == DType::BF16 ? 2e-3 : 1e-5;
        CHECK(test::relative_l2(a[k], stem[k]) < tol);
        CHECK(test::relative_l2(a[k], b[k]) < tol);
      }
    }
  }
}

// One SGD step of a ResNet with channels_last activations against the same step in NCHW, both
// on the GPU: the convolutions' algorithms differ between layouts, so the update is held to
// what rounding-sized noise on the input does (as tests/test_cuda_precision.cpp's TF32 case):
// within 2x of it. A tensor read in the wrong layout changes the update by O(1). The residual
// branches start damped (damp_residual_branches: each block's last BatchNorm weight 0.1): from
// the default init ResNet-50's step is chaotic, its update moved 133% by the noise and its loss
// by percents for an ulp anywhere, so that NHWC's step matched NCHW's only where every bit did.
// On 2026-11-29 (H200) the padded stem's other order of sums gave a loss of 2.533 against 2.397.
// Damped, on the CPU, the noise moves the update by 0.00045 (ResNet-18 fp32), 0.14 (ResNet-18
// bf16) and 0.21 (ResNet-50 bf16), and the stem in another order the logits by 0.017.
TEST_CASE("ResNets trained with channels_last activations on the GPU follow NCHW") {
  if (!test::have_gpu()) return;
  struct Case {
    std::string model;
    Shape shape;
    Precision precision;
    float noise;
  };
  for (const Case& c : {Case{"resnet18", {1, 28, 28}, Precision::Fp32, 1.f / (1 << 16)},
                        Case{"resnet18", {1, 28, 28}, Precision::Bf16, 1.f / 512},
                        Case{"resnet50", {3, 32, 32}, Precision::Bf16, 1.f / 512}}) {
    if (c.precision == Precision::Bf16 && !have_bf16()) continue;
    CAPTURE(c.model);
    CAPTURE(precision_name(c.precision));
    EngineOptions o = test::sgd_options(c.model, c.shape);
    o.precision = c.precision;
    auto nchw = make_single_device_engine(kGpu, o);
    auto noisy = make_single_device_engine(kGpu, o);
    o.channels_last = true;
    auto nhwc = make_single_device_engine(kGpu, o);
    for (TrainEngine* e : {nchw.get(), noisy.get(), nhwc.get()})
      test::damp_residual_branches(*e);
    const Batch batch = test::make_batches(o.input_shape, 16, 1, 6).at(0);
    const test::NoiseDrift d = test::step_against_noise(
        *nchw, *nhwc, *noisy, batch, c.noise,
        c.model + " " + precision_name(c.precision) + ", NCHW vs channels_last");
    CHECK(d.drift <= 2 * d.noise_drift);
  }
}
