// Layers' behaviour: an evaluation forward keeps no activations, BatchNorm's running statistics
// as PyTorch updates and uses them, Dropout, backward_adding (a residual body's input gradient
// added onto the shortcut's) and REPLICA_RESIDUAL_SUM's two ways to the same bits. (Models
// against torchvision: test_models.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "env_guard.h"
#include "layers/layers.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "layers/resnet.h"

using namespace replica;

namespace {

DeviceContext& cpu() {
  static DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  return ctx;
}
std::unique_ptr<Model> wrap(std::unique_ptr<Module> m, uint64_t seed = 1) {
  auto model = std::make_unique<Model>(ModelSpec{"t", {}, 10}, std::move(m));
  model->materialize(cpu(), seed);
  return model;
}

Tensor tensor(const Shape& s, const std::vector<float>& v) {
  Tensor t = cpu().alloc(s);
  REQUIRE(int64_t(v.size()) == t.numel());
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

}  // namespace

// As under PyTorch's no_grad: an evaluation forward keeps no activation for a backward, so a
// large evaluation batch costs a few activations' memory (a ResNet-50 at 224x224 evaluated in
// batches of 256 held every layer's output, 20+ GB, and was killed for memory).
TEST_CASE("an evaluation forward keeps no activations; a training forward keeps them for backward") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  auto m = make_model("resnet18", {1, 28, 28}, 10);
  m->materialize(ctx, 3);
  Tensor x = ctx.alloc({4, 1, 28, 28});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i % 13) / 13.f - 0.5f;
  const size_t before = ctx.allocator().bytes_in_use();
  m->set_training(false);
  { Tensor y = m->forward(ctx, x); }
  CHECK(ctx.allocator().bytes_in_use() == before);
  CHECK_THROWS_WITH_AS(m->root().backward(ctx, ctx.alloc({4, 10})),
                       doctest::Contains("backward without a training-mode forward"), Error);
  CHECK(m->forward_kept_bytes() == 0);  // evaluation forwards do not count
  m->set_training(true);
  {
    Tensor y = m->forward(ctx, x);
    // Among what backward needs: bn1's input, the stem convolution's 4x64x14x14 output.
    CHECK(ctx.allocator().bytes_in_use() >= before + 4 * 64 * 14 * 14 * sizeof(float));
    // The model's own count: all the forward left in use, its output included.
    CHECK(m->forward_kept_bytes() == int64_t(ctx.allocator().bytes_in_use() - before));
    Tensor dy = ctx.alloc(y.shape());
    ctx.ops().fill(ctx, dy, 0.01f);
    m->backward(ctx, dy);  // releases what the forward kept
  }
  // The largest training forward's: a smaller batch after it keeps less and leaves the count.
  const int64_t four = m->forward_kept_bytes();
  const size_t before_two = ctx.allocator().bytes_in_use();
  Tensor two = m->forward(ctx, x.view(0, {2, 1, 28, 28}));
  CHECK(int64_t(ctx.allocator().bytes_in_use() - before_two) < four);
  CHECK(m->forward_kept_bytes() == four);
}

TEST_CASE("BatchNorm2d: running statistics updated as PyTorch (momentum 0.1, unbiased var)") {
  auto m = wrap(std::make_unique<BatchNorm2d>(2));
  // x [2, 2, 1, 2]: channel 0 holds {1, 2, 3, 4}, channel 1 holds {-1, -1, 5, 5}.
  Tensor x = tensor({2, 2, 1, 2}, {1, 2, -1, -1, 3, 4, 5, 5});
  Tensor y = m->forward(cpu(), x);
  const float* rm = m->buffers()[0]->value.f32();
  const float* rv = m->buffers()[1]->value.f32();
  // By hand: channel 0 mean 2.5, unbiased var 5/3; channel 1 mean 2, unbiased var 12.
  CHECK(rm[0] == doctest::Approx(0.25));                // 0.9*0 + 0.1*2.5
  CHECK(rv[0] == doctest::Approx(0.9 + 0.1 * 5.0 / 3));  // 1.0666667
  CHECK(rm[1] == doctest::Approx(0.2));
  CHECK(rv[1] == doctest::Approx(0.9 + 1.2));
  // The output uses the biased batch variance (1.25 for channel 0).
  CHECK(y.f32()[0] == doctest::Approx(-1.5 / std::sqrt(1.25 + 1e-5)));
  CHECK(y.f32()[2] == doctest::Approx(-1.0).epsilon(1e-4));  // channel 1: (-1-2)/3
  m->forward(cpu(), x);
  CHECK(rm[0] == doctest::Approx(0.475));  // 0.9*0.25 + 0.25
  CHECK(rv[0] == doctest::Approx(0.9 * (0.9 + 0.5 / 3) + 0.5 / 3));  // 1.1266667
}

TEST_CASE("BatchNorm2d: eval mode normalises with the running statistics and leaves them alone") {
  auto m = wrap(std::make_unique<BatchNorm2d>(2));
  m->params()[0]->value.f32()[0] = 2.f;   // gamma
  m->params()[0]->value.f32()[1] = 0.5f;
  m->params()[1]->value.f32()[0] = 1.f;   // beta
  m->params()[1]->value.f32()[1] = -1.f;
  float* rm = m->buffers()[0]->value.f32();
  float* rv = m->buffers()[1]->value.f32();
  rm[0] = 3.f, rm[1] = -2.f, rv[0] = 4.f, rv[1] = 0.25f;
  m->set_training(false);
  Tensor x = tensor({1, 2, 1, 2}, {5, 7, 0, -2});
  Tensor y = m->forward(cpu(), x);
  const double s0 = std::sqrt(4.0 + 1e-5), s1 = std::sqrt(0.25 + 1e-5);
  CHECK(y.f32()[0] == doctest::Approx(2 * (5 - 3) / s0 + 1));
  CHECK(y.f32()[1] == doctest::Approx(2 * (7 - 3) / s0 + 1));
  CHECK(y.f32()[2] == doctest::Approx(0.5 * (0 + 2) / s1 - 1));
  CHECK(y.f32()[3] == doctest::Approx(0.5 * (-2 + 2) / s1 - 1));
  CHECK(rm[0] == 3.f);
  CHECK(rv[1] == 0.25f);
  // A batch of one sample with one pixel is fine in eval mode, an error in training mode.
  Tensor one = tensor({1, 2, 1, 1}, {1, 2});
  CHECK_NOTHROW(m->forward(cpu(), one));
  m->set_training(true);
  CHECK_THROWS_AS(m->forward(cpu(), one), Error);
}

TEST_CASE("Dropout: identity in eval, ~p zeros scaled by 1/(1-p) in training, seeded") {
  const int64_t n = 100000;
  Tensor x = cpu().alloc({10, n / 10});
  for (int64_t i = 0; i < n; ++i) x.f32()[i] = 1.f + float(i % 7);
  auto run = [&](float p, uint64_t seed, bool training, int calls = 1) {
    auto m = wrap(std::make_unique<Dropout>(p, seed));
    m->set_training(training);
    Tensor y;
    for (int c = 0; c < calls; ++c) y = m->forward(cpu(), x);
    return std::vector<float>(y.f32(), y.f32() + y.numel());
  };
  std::vector<float> xv(x.f32(), x.f32() + n);
  CHECK(run(0.5f, 1, false) == xv);
  CHECK(run(0.f, 1, true) == xv);

  std::vector<float> y = run(0.3f, 7, true);
  int64_t zeros = 0, wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (y[size_t(i)] == 0.f) ++zeros;
    else wrong += std::fabs(y[size_t(i)] - xv[size_t(i)] / 0.7) > 1e-5 * xv[size_t(i)];
  }
  CHECK(double(zeros) / n == doctest::Approx(0.3).epsilon(0.03));  // 0.3 +- 0.009
  CHECK(wrong == 0);
  CHECK(run(0.3f, 7, true) == y);      // same seed, same mask
  CHECK(run(0.3f, 8, true) != y);      // another seed
  CHECK(run(0.3f, 7, true, 2) != y);   // the next call draws a new mask

  // set_seed(seed, calls) replays a mask; backward multiplies by the same mask.
  auto m = wrap(std::make_unique<Dropout>(0.3f, 7));
  auto* d = dynamic_cast<Dropout*>(&m->root());
  REQUIRE(d != nullptr);
  m->forward(cpu(), x);
  CHECK(d->calls() == 1);
  d->set_seed(7, 0);
  Tensor y2 = m->forward(cpu(), x);
  CHECK(std::vector<float>(y2.f32(), y2.f32() + n) == y);
  Tensor dy = cpu().alloc(x.shape());
  for (int64_t i = 0; i < n; ++i) dy.f32()[i] = 2.f;
  Tensor dx = m->backward(cpu(), dy);
  for (int64_t i = 0; i < n; i += 997)
    CHECK(dx.f32()[i] == doctest::Approx(y[size_t(i)] / xv[size_t(i)] * 2.0));

  CHECK_THROWS_AS(Dropout(1.f), Error);
  CHECK_THROWS_AS(Dropout(-0.1f), Error);
}

// A residual block's body adds its input gradient onto the shortcut's (Module::backward_adding):
// a Conv2d first child adds as it writes, any other module runs backward and then an add. Both
// must give backward-then-add's bits, and the same parameter gradients.
TEST_CASE("backward_adding gives the bits of backward and an add, conv first or not") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  for (bool conv_first : {true, false}) {
    CAPTURE(conv_first);
    const Shape in = conv_first ? Shape{4, 2, 5, 5} : Shape{4, 6};
    auto make = [&] {
      auto seq = std::make_unique<Sequential>();
      if (conv_first) {
        seq->add("0", std::make_unique<Conv2d>(2, 3, 3, 1, 1));
        seq->add("1", std::make_unique<ReLU>());
        seq->add("2", std::make_unique<Conv2d>(3, 2, 3, 1, 1));
      } else {
        seq->add("0", std::make_unique<Linear>(6, 5));
        seq->add("1", std::make_unique<ReLU>());
        seq->add("2", std::make_unique<Linear>(5, 6));
      }
      auto m = std::make_unique<Model>(ModelSpec{"test", {}, 0}, std::move(seq));
      m->materialize(ctx, 11);
      m->zero_grad(ctx);
      m->root().set_needs_input_grad(true);  // a model's first layer skips it: a body's does not
      return m;
    };
    auto fill = [&](uint32_t seed) {
      Tensor t = ctx.alloc(in);
      for (int64_t i = 0; i < t.numel(); ++i)
        t.f32()[i] = float((i * 7 + seed) % 11) / 11.f - 0.45f;
      return t;
    };
    auto plain = make(), adding = make();
    const Tensor x = fill(1), dy = fill(2);
    plain->forward(ctx, x);
    adding->forward(ctx, x);
    Tensor expected = fill(3);
    ctx.ops().add(ctx, expected, plain->backward(ctx, dy), 1.f);
    const Tensor sum = adding->root().backward_adding(ctx, dy, fill(3));
    const std::vector<float> got(sum.f32(), sum.f32() + sum.numel());
    const std::vector<float> want(expected.f32(), expected.f32() + expected.numel());
    CHECK(got == want);
    CHECK(std::memcmp(plain->flat_grads().f32(), adding->flat_grads().f32(),
                      size_t(plain->num_params()) * sizeof(float)) == 0);
  }
}

// REPLICA_RESIDUAL_SUM=add (a measurement switch for GPUs) puts the residual sum back in an add
// of its own: on CPU devices the same bits as the sum in the convolution.
TEST_CASE("REPLICA_RESIDUAL_SUM: the residual sum in the convolution or in an add, same bits") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  Tensor x = ctx.alloc({4, 1, 28, 28}), labels = ctx.alloc({4}, DType::I32);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i % 17) / 17.f - 0.5f;
  for (int64_t i = 0; i < 4; ++i) labels.i32()[i] = int32_t(i * 3 % 10);
  int64_t adds = 0;  // the last backward's add ops
  auto grads = [&](const char* sum) {
    test::ScopedEnv env("REPLICA_RESIDUAL_SUM", sum);
    auto m = make_model("resnet18", {1, 28, 28}, 10);
    m->materialize(ctx, 5);
    m->zero_grad(ctx);
    CrossEntropyLoss loss;
    loss.forward(ctx, m->forward(ctx, x), labels);
    OpProfile profile;
    ctx.set_op_profile(&profile);
    m->backward(ctx, loss.backward(ctx));
    ctx.set_op_profile(nullptr);
    const auto ops = profile.ops();
    adds = ops.count("add") ? ops.at("add").calls : 0;
    const Tensor& g = m->flat_grads();
    return std::vector<float>(g.f32(), g.f32() + g.numel());
  };
  const std::vector<float> in_conv = grads("conv");
  const int64_t adds_in_conv = adds;
  const std::vector<float> in_add = grads("add");
  CHECK(adds == adds_in_conv + 8);  // one for each of ResNet-18's eight blocks
  REQUIRE(in_conv.size() == in_add.size());
  CHECK(std::memcmp(in_conv.data(), in_add.data(), in_conv.size() * sizeof(float)) == 0);
  CHECK(grads("") == in_conv);  // empty: the default
  test::ScopedEnv bad("REPLICA_RESIDUAL_SUM", "fused");
  CHECK_THROWS_WITH_AS(make_model("resnet18", {1, 28, 28}, 10),
                       "REPLICA_RESIDUAL_SUM='fused': expected conv or add", UsageError);
}
