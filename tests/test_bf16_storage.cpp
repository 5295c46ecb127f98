// bf16 storage (engine/bf16_storage.h): in --precision bf16 activations and their gradients are
// BF16 tensors, every op computes in fp32 and rounds what it stores. What must hold:
//  - copy converts between F32 and BF16 (rounding through bf16_bits, widening exactly) and
//    fill writes bf16's pattern; other conversions are refused with a message;
//  - an op whose kernel does not take BF16 gives, on BF16 tensors, the bits of the same op on
//    their F32 widening with its outputs rounded, outputs that add (+=) included;
//  - a model in bf16 keeps BF16 activations and gradients, F32 parameters and gradients;
//  - a forward keeps half the bytes for backward in bf16 (on CPU the peak is not lower: ops
//    without BF16 kernels work on F32 copies, and the CPU's bf16 products round into copies
//    of their own);
//  - DP on two devices and one device train alike in bf16, as in fp32.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dp_reference.h"
#include "engine/bf16_storage.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "parallel/engines/dp_engine.h"
#include "seeded_values.h"

using namespace replica;

namespace {

const Device kCpu{DeviceType::CPU, 0, 0};

DeviceContext cpu_context(Precision p) { return DeviceContext(kCpu, ContextOptions{1, false, p}); }

Tensor random_f32(DeviceContext& ctx, const Shape& shape, uint32_t seed) {
  const std::vector<float> v = test::normal_values(shape_numel(shape), seed);
  Tensor t = ctx.alloc(shape);
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

Tensor to_bf16(DeviceContext& ctx, const Tensor& t) {
  Tensor b = ctx.alloc(t.shape(), DType::BF16);
  ctx.ops().copy(ctx, b, t);
  return b;
}

// F32 values of a BF16 tensor (exact), or of an F32 one rounded to bf16 and back.
std::vector<float> bf16_values(const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[size_t(i)] = t.dtype() == DType::BF16 ? bf16_value(t.bf16()[i]) : bf16_round(t.f32()[i]);
  return v;
}

// The F32 values of an F32 tensor, as they are.
std::vector<float> f32_values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// The F32 tensor a BF16 one stands for (exact).
Tensor widened(DeviceContext& ctx, const Tensor& t) {
  Tensor w = ctx.alloc(t.shape());
  ctx.ops().copy(ctx, w, t);
  return w;
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b,
                      const std::string& what) {
  REQUIRE(a.size() == b.size());
  CAPTURE(what);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("copy converts F32 <-> BF16 and fill writes bf16's pattern") {
  DeviceContext ctx = cpu_context(Precision::Bf16);
  Tensor f = ctx.alloc({6});
  const float values[] = {1.f + 1.f / 256, 1.f + 3.f / 256, -2.5f, 1e-40f, 3.4e38f, 0.f};
  std::memcpy(f.f32(), values, sizeof values);
  Tensor b = to_bf16(ctx, f);
  REQUIRE(b.dtype() == DType::BF16);
  CHECK(b.bytes() == 12);
  for (int i = 0; i < 6; ++i) CHECK(b.bf16()[i] == bf16_bits(values[i]));
  CHECK(bf16_value(b.bf16()[0]) == 1.f);                // a tie: to even
  CHECK(bf16_value(b.bf16()[1]) == 1.f + 4.f / 256);    // a tie: to even, upwards
  Tensor back = ctx.alloc({6});
  ctx.ops().copy(ctx, back, b);
  for (int i = 0; i < 6; ++i) CHECK(back.f32()[i] == bf16_round(values[i]));

  ctx.ops().fill(ctx, b, 1.f + 3.f / 256);
  for (int i = 0; i < 6; ++i) CHECK(b.bf16()[i] == bf16_bits(1.f + 3.f / 256));

  Tensor ints = ctx.alloc({6}, DType::I32);
  CHECK_THROWS_WITH_AS(
      ctx.ops().copy(ctx, ints, b),
      doctest::Contains("copy: BF16 into I32 is no conversion replica makes (F32 <-> BF16)"),
      Error);
  CHECK_THROWS_WITH_AS(b.f32(), doctest::Contains("tensor is BF16, expected F32"), Error);
}

TEST_CASE("an op on BF16 tensors: the op on their F32 widening, its outputs rounded") {
  DeviceContext ctx = cpu_context(Precision::Bf16);
  const Shape shape{4, 3, 5, 5};
  const Tensor x32 = random_f32(ctx, shape, 1), r32 = random_f32(ctx, shape, 2);
  const Tensor x = to_bf16(ctx, x32), residual = to_bf16(ctx, r32);
  // The F32 operands the BF16 ones stand for.
  const Tensor xw = widened(ctx, x), rw = widened(ctx, residual);

  SUBCASE("batch norm with a residual and a ReLU: BF16 in and out, F32 statistics") {
    Tensor gamma = random_f32(ctx, {3}, 3), beta = random_f32(ctx, {3}, 4);
    auto run = [&](const Tensor& in, const Tensor& res, Tensor& y, Tensor& mean) {
      Tensor rm = ctx.alloc({3}), rv = ctx.alloc({3}), invstd = ctx.alloc({3});
      ctx.ops().fill(ctx, rm, 0.f);
      ctx.ops().fill(ctx, rv, 1.f);
      ctx.ops().batchnorm_forward_train(ctx, in, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean,
                                        invstd, res, true);
    };
    Tensor y = ctx.alloc(shape, DType::BF16), mean = ctx.alloc({3});
    Tensor y32 = ctx.alloc(shape), mean32 = ctx.alloc({3});
    run(x, residual, y, mean);
    run(xw, rw, y32, mean32);
    expect_same_bits(bf16_values(y), bf16_values(y32), "y");
    expect_same_bits(f32_values(mean), f32_values(mean32), "mean");
  }
  SUBCASE("add into a BF16 tensor: the sum in fp32, rounded once") {
    Tensor dst = to_bf16(ctx, x32), dst32 = widened(ctx, dst);
    ctx.ops().add(ctx, dst, residual, 0.5f);
    ctx.ops().add(ctx, dst32, rw, 0.5f);
    expect_same_bits(bf16_values(dst), bf16_values(dst32), "dst");
  }
  SUBCASE("a convolution with a bias: BF16 input and output, F32 weights") {
    const Conv2dParams p{1, 1};
    Tensor w = random_f32(ctx, {2, 3, 3, 3}, 5), b = random_f32(ctx, {2}, 10);
    Tensor y = ctx.alloc({4, 2, 5, 5}, DType::BF16), y32 = ctx.alloc({4, 2, 5, 5});
    ctx.ops().conv2d_forward(ctx, x, w, b, y, p);
    ctx.ops().conv2d_forward(ctx, xw, w, b, y32, p);
    expect_same_bits(bf16_values(y), bf16_values(y32), "y");
  }
  SUBCASE("a convolution's backward: BF16 dx written or added onto a sum; F32 dw and db") {
    const Conv2dParams p{1, 1};
    Tensor w = random_f32(ctx, {2, 3, 3, 3}, 5);
    const Tensor dy = to_bf16(ctx, random_f32(ctx, {4, 2, 5, 5}, 6)), dyw = widened(ctx, dy);
    for (InputGrad mode : {InputGrad::Overwrite, InputGrad::Accumulate}) {
      CAPTURE(int(mode));
      Tensor dx = to_bf16(ctx, r32), dx32 = widened(ctx, dx);  // the sum Accumulate adds onto
      Tensor dw = ctx.alloc(w.shape()), dw32 = ctx.alloc(w.shape());
      Tensor db = ctx.alloc({2}), db32 = ctx.alloc({2});
      for (Tensor* t : {&dw, &dw32, &db, &db32}) ctx.ops().fill(ctx, *t, 0.25f);
      ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw, db, p, mode);
      ctx.ops().conv2d_backward(ctx, xw, w, dyw, dx32, dw32, db32, p, mode);
      expect_same_bits(bf16_values(dx), bf16_values(dx32), "dx");
      expect_same_bits(f32_values(dw), f32_values(dw32), "dw");
      expect_same_bits(f32_values(db), f32_values(db32), "db");
    }
  }
  SUBCASE("a linear layer's backward: BF16 x, dy and dx; F32 weight and bias gradients") {
    const Tensor in = to_bf16(ctx, random_f32(ctx, {4, 6}, 7)), inw = widened(ctx, in);
    const Tensor dy = to_bf16(ctx, random_f32(ctx, {4, 3}, 11)), dyw = widened(ctx, dy);
    Tensor w = random_f32(ctx, {3, 6}, 8);
    Tensor dx = ctx.alloc({4, 6}, DType::BF16), dx32 = ctx.alloc({4, 6});
    Tensor dw = ctx.alloc(w.shape()), dw32 = ctx.alloc(w.shape());
    Tensor db = ctx.alloc({3}), db32 = ctx.alloc({3});
    for (Tensor* t : {&dw, &dw32, &db, &db32}) ctx.ops().fill(ctx, *t, 0.f);
    ctx.ops().linear_backward(ctx, in, w, dy, dx, dw, db);
    ctx.ops().linear_backward(ctx, inw, w, dyw, dx32, dw32, db32);
    expect_same_bits(bf16_values(dx), bf16_values(dx32), "dx");
    expect_same_bits(f32_values(dw), f32_values(dw32), "dw");
    expect_same_bits(f32_values(db), f32_values(db32), "db");
  }
  SUBCASE("F32 operands, a BF16 result: a linear layer's output rounded") {
    Tensor in = random_f32(ctx, {4, 6}, 7), w = random_f32(ctx, {3, 6}, 8);
    Tensor b = random_f32(ctx, {3}, 9);
    Tensor y = ctx.alloc({4, 3}, DType::BF16), y32 = ctx.alloc({4, 3});
    ctx.ops().linear_forward(ctx, in, w, b, y);
    ctx.ops().linear_forward(ctx, in, w, b, y32);
    expect_same_bits(bf16_values(y), bf16_values(y32), "y");
  }
}

TEST_CASE("the layer counts the calls it runs on F32 copies: none for the CPU's BF16 kernels") {
  DeviceContext ctx = cpu_context(Precision::Bf16);
  const Tensor x = to_bf16(ctx, random_f32(ctx, {4, 3, 5, 5}, 1));
  const Tensor w = random_f32(ctx, {2, 3, 3, 3}, 5), none;
  Tensor y = ctx.alloc({4, 2, 5, 5}, DType::BF16);
  Tensor sum = to_bf16(ctx, random_f32(ctx, {4, 3, 5, 5}, 2));
  const int64_t before = calls_on_f32_copies(ctx.ops());
  // Kernels of the CPU's that take BF16 (CpuBackend::takes_bf16): straight through.
  ctx.ops().conv2d_forward(ctx, x, w, none, y, Conv2dParams{1, 1});
  ctx.ops().add(ctx, sum, x, 1.f);
  ctx.ops().fill(ctx, sum, 0.5f);
  CHECK(calls_on_f32_copies(ctx.ops()) == before);
  // ReLU has no BF16 kernel on the CPU (were one added, take another op here): one call on
  // copies. F32 tensors alone: none.
  REQUIRE_FALSE(make_cpu_backend()->takes_bf16(OpId::relu_forward));
  Tensor r = ctx.alloc(x.shape(), DType::BF16);
  Tensor r32 = ctx.alloc(x.shape()), x32 = ctx.alloc(x.shape());
  ctx.ops().relu_forward(ctx, x, r);
  CHECK(calls_on_f32_copies(ctx.ops()) == before + 1);
  ctx.ops().fill(ctx, x32, 1.f);
  ctx.ops().relu_forward(ctx, x32, r32);
  CHECK(calls_on_f32_copies(ctx.ops()) == before + 1);
}

// One training step's forward and backward of `name` on 4 random 1x28x28 images: the logits,
// their gradient, the parameter gradients (host copies), and the bytes the forward left in use
// for backward (activations and what the layers keep).
struct Step {
  DType logits, dlogits, params, grads;
  std::vector<float> grad_values;
  double kept_bytes;
};

Step one_step(const std::string& name, Precision precision, int64_t batch) {
  DeviceContext ctx = cpu_context(precision);
  auto model = make_model(name, {1, 28, 28}, 10);
  model->materialize(ctx, 3);
  model->set_training(true);
  Tensor x = random_f32(ctx, {batch, 1, 28, 28}, 10);
  Tensor labels = ctx.alloc({batch}, DType::I32);
  for (int64_t i = 0; i < batch; ++i) labels.i32()[i] = int32_t(i % 10);
  Tensor logits = model->forward(ctx, x);
  Step s;
  s.kept_bytes = double(model->forward_kept_bytes());
  s.logits = logits.dtype();
  CrossEntropyLoss loss;
  CHECK(loss.forward(ctx, logits, labels).dtype() == DType::F32);
  logits = Tensor();
  const Tensor dlogits = loss.backward(ctx);
  s.dlogits = dlogits.dtype();
  model->backward(ctx, dlogits);
  s.params = model->flat_params().dtype();
  s.grads = model->flat_grads().dtype();
  const Tensor& g = model->flat_grads();
  s.grad_values.assign(g.f32(), g.f32() + g.numel());
  return s;
}

TEST_CASE("a model in bf16 keeps BF16 activations and gradients, F32 parameters") {
  for (const std::string name : {"cnn", "resnet18"}) {
    CAPTURE(name);
    const Step bf16 = one_step(name, Precision::Bf16, 32);
    const Step fp32 = one_step(name, Precision::Fp32, 32);
    CHECK(bf16.logits == DType::BF16);
    CHECK(bf16.dlogits == DType::BF16);
    CHECK(bf16.params == DType::F32);
    CHECK(bf16.grads == DType::F32);
    CHECK(fp32.logits == DType::F32);
    // Every gradient finite, and as many of them non-zero as in fp32 (a ReLU's zeros aside):
    // how far bf16 moves training is test_bf16's drift (CNN, 0.034 after 4 steps).
    int64_t nonzero[2] = {0, 0};
    for (size_t i = 0; i < bf16.grad_values.size(); ++i) {
      REQUIRE(std::isfinite(bf16.grad_values[i]));
      nonzero[0] += bf16.grad_values[i] != 0.f;
      nonzero[1] += fp32.grad_values[i] != 0.f;
    }
    CHECK(nonzero[0] > nonzero[1] * 0.95);
  }
}

TEST_CASE("what a forward keeps for backward: half the bytes in bf16") {
  // Activations are most of what a forward leaves (the parameters were allocated before): the
  // CNN (convolutions, ReLUs, a max pool, linear layers) and ResNet-18 (BatchNorm keeps its
  // input and its ReLU's output too).
  using Case = std::pair<std::string, int64_t>;
  for (const auto& [name, batch] : {Case{"cnn", 128}, Case{"resnet18", 64}}) {
    CAPTURE(name);
    const double fp32 = one_step(name, Precision::Fp32, batch).kept_bytes;
    const double bf16 = one_step(name, Precision::Bf16, batch).kept_bytes;
    MESSAGE(name << " batch " << batch << ", kept by the forward: fp32 " << fp32 / 1e6
                 << " MB, bf16 " << bf16 / 1e6 << " MB (" << bf16 / fp32 << "x)");
    CHECK(bf16 < 0.55 * fp32);
  }
}

TEST_CASE("DP on two devices is one device's arithmetic in bf16 too (CNN and ResNet-18)") {
  for (const std::string name : {"cnn", "resnet18"}) {
    CAPTURE(name);
    EngineOptions o = test::sgd_options(name, {1, 28, 28});
    o.precision = Precision::Bf16;
    const auto batches = test::make_batches(o.input_shape, 8, 3, 21);
    auto dp = make_dp_engine(parse_devices("cpu*2"), o);
    for (const Batch& b : batches) dp->train_step(b);
    dp->synchronize();
    CHECK(test::relative_difference(test::reference_params(o, batches, 2), test::params_of(*dp))
          <= 1e-5);
  }
}
