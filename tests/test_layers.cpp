// Layers and models: parameter counts and names against torchvision, output shapes,
// initialisation statistics, seeding, BatchNorm running statistics, Dropout, the model zoo,
// backward_adding (a residual body's input gradient added onto the shortcut's).
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

// Parameter count of a torchvision ResNet computed from its architecture (weights of convs,
// weight and bias of BatchNorms, fc weight and bias), independently of the engine's modules.
int64_t resnet_param_count(const int (&blocks)[4], bool bottleneck, int64_t in_ch,
                           int64_t classes) {
  auto conv = [](int64_t i, int64_t o, int64_t k) { return i * o * k * k; };
  auto bn = [](int64_t c) { return 2 * c; };
  const int64_t expansion = bottleneck ? 4 : 1, planes[4] = {64, 128, 256, 512};
  int64_t total = conv(in_ch, 64, 7) + bn(64), in = 64;
  for (int s = 0; s < 4; ++s)
    for (int b = 0; b < blocks[s]; ++b) {
      const int64_t p = planes[s], out = p * expansion;
      total += bottleneck
                   ? conv(in, p, 1) + bn(p) + conv(p, p, 3) + bn(p) + conv(p, out, 1) + bn(out)
                   : conv(in, p, 3) + bn(p) + conv(p, p, 3) + bn(p);
      if ((s > 0 && b == 0) || in != out) total += conv(in, out, 1) + bn(out);
      in = out;
    }
  return total + in * classes + classes;
}

// torchvision's resnet18 parameter (or buffer) names, in state_dict order.
std::vector<std::string> torchvision_resnet18_names(bool buffers) {
  const std::vector<std::string> bn_suffix =
      buffers ? std::vector<std::string>{"running_mean", "running_var"}
              : std::vector<std::string>{"weight", "bias"};
  std::vector<std::string> names;
  auto conv = [&](const std::string& n) { if (!buffers) names.push_back(n + ".weight"); };
  auto bn = [&](const std::string& n) { for (auto& s : bn_suffix) names.push_back(n + "." + s); };
  conv("conv1");
  bn("bn1");
  for (int l = 1; l <= 4; ++l)
    for (int b = 0; b < 2; ++b) {
      std::string p = "layer" + std::to_string(l) + "." + std::to_string(b) + ".";
      conv(p + "conv1");
      bn(p + "bn1");
      conv(p + "conv2");
      bn(p + "bn2");
      if (l > 1 && b == 0) {
        conv(p + "downsample.0");
        bn(p + "downsample.1");
      }
    }
  if (!buffers) names.insert(names.end(), {"fc.weight", "fc.bias"});
  return names;
}

const Param& param(const Model& m, const std::string& name) {
  for (const Param* p : m.params())
    if (p->name == name) return *p;
  FAIL("no parameter " << name);
  throw 0;
}

struct Stats {
  double mean = 0, std = 0, max_abs = 0;
};
Stats stats(const Tensor& t) {
  Stats s;
  const float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    s.mean += p[i];
    s.max_abs = std::max(s.max_abs, double(std::fabs(p[i])));
  }
  s.mean /= double(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) s.std += (p[i] - s.mean) * (p[i] - s.mean);
  s.std = std::sqrt(s.std / double(t.numel()));
  return s;
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

TEST_CASE("parameter counts equal torchvision's") {
  static const int r18[4] = {2, 2, 2, 2}, r50[4] = {3, 4, 6, 3}, r101[4] = {3, 4, 23, 3};
  // Independent count first: these literals are torchvision's published numbers.
  CHECK(resnet_param_count(r18, false, 3, 1000) == 11689512);
  CHECK(resnet_param_count(r50, true, 3, 1000) == 25557032);
  CHECK(resnet_param_count(r101, true, 3, 1000) == 44549160);
  // MNIST resnet101: conv1 1->64 saves (3-1)*64*49 = 6272, fc 2048->10 saves 2,028,510.
  CHECK(resnet_param_count(r101, true, 1, 10) == 44549160 - 6272 - 2028510);
  CHECK(resnet_param_count(r101, true, 1, 10) == 42514378);

  CHECK(make_model("resnet18", {3, 224, 224}, 1000)->num_params() == 11689512);
  CHECK(make_model("resnet50", {3, 224, 224}, 1000)->num_params() == 25557032);
  CHECK(make_model("resnet101", {3, 224, 224}, 1000)->num_params() == 44549160);
  CHECK(make_model("resnet101", {1, 28, 28}, 10)->num_params() == 42514378);
  CHECK(make_model("resnet18", {1, 28, 28}, 10)->num_params() ==
        resnet_param_count(r18, false, 1, 10));
  // cnn: conv 1->20 5x5 (520), conv 20->20 5x5 (10,020), fc 2000->50 (100,050), fc 50->10 (510)
  CHECK(make_model("cnn", {1, 28, 28}, 10)->num_params() == 111100);
}

TEST_CASE("resnet18 parameter and buffer names are torchvision's state_dict keys, in order") {
  auto m = make_model("resnet18", {3, 224, 224}, 1000);
  std::vector<std::string> params, buffers;
  for (const Param* p : m->params()) params.push_back(p->name);
  for (const Buffer* b : m->buffers()) buffers.push_back(b->name);
  CHECK(params.size() == 62);
  CHECK(buffers.size() == 40);  // running_mean and running_var of 20 BatchNorms
  CHECK(params == torchvision_resnet18_names(false));
  CHECK(buffers == torchvision_resnet18_names(true));
  CHECK(m->num_buffer_elements() == 2 * 4800);  // 2 x total BatchNorm channels
  CHECK(param(*m, "conv1.weight").shape == Shape{64, 3, 7, 7});
  CHECK(param(*m, "layer1.0.conv1.weight").shape == Shape{64, 64, 3, 3});
  CHECK(param(*m, "layer2.0.downsample.0.weight").shape == Shape{128, 64, 1, 1});
  CHECK(param(*m, "layer2.0.downsample.1.bias").shape == Shape{128});
  CHECK(param(*m, "fc.weight").shape == Shape{1000, 512});
  CHECK(param(*m, "fc.bias").shape == Shape{1000});
  // Offsets pack the parameters back to back in registration order.
  int64_t off = 0;
  for (const Param* p : m->params()) {
    CHECK(p->offset == off);
    off += shape_numel(p->shape);
  }
  CHECK(off == m->num_params());
}

TEST_CASE("resnet50 names its bottleneck layers as torchvision does") {
  auto m = make_model("resnet50", {3, 224, 224}, 1000);
  CHECK(m->params().size() == 161);
  CHECK(param(*m, "layer1.0.conv3.weight").shape == Shape{256, 64, 1, 1});
  CHECK(param(*m, "layer1.0.downsample.0.weight").shape == Shape{256, 64, 1, 1});
  CHECK(param(*m, "layer3.5.bn3.bias").shape == Shape{1024});
  CHECK(param(*m, "layer4.0.conv2.weight").shape == Shape{512, 512, 3, 3});
  CHECK(param(*m, "fc.weight").shape == Shape{1000, 2048});
}

TEST_CASE("cnn: fc1 sized from the input, output shapes") {
  auto m = make_model("cnn", {1, 28, 28}, 10);
  CHECK(param(*m, "fc1.weight").shape == Shape{50, 2000});
  CHECK(param(*m, "fc2.weight").shape == Shape{10, 50});
  CHECK(m->root().output_shape({5, 1, 28, 28}) == Shape{5, 10});
  auto small = make_model("cnn", {1, 12, 12}, 4);  // 12 -> 8 -> 4 -> pool 2: 20*2*2
  CHECK(param(*small, "fc1.weight").shape == Shape{50, 80});
  auto rgb = make_model("cnn", {3, 32, 32}, 10);  // 32 -> 28 -> 24 -> 12: 20*12*12
  CHECK(param(*rgb, "conv1.weight").shape == Shape{20, 3, 5, 5});
  CHECK(param(*rgb, "fc1.weight").shape == Shape{50, 2880});
}

TEST_CASE("ResNet output shapes for 28x28 and 224x224 inputs") {
  for (const char* name : {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"}) {
    CAPTURE(name);
    CHECK(make_model(name, {1, 28, 28}, 10)->root().output_shape({3, 1, 28, 28}) == Shape{3, 10});
    CHECK(make_model(name, {3, 224, 224}, 1000)->root().output_shape({2, 3, 224, 224}) ==
          Shape{2, 1000});
  }
  // And a real forward pass of the MNIST resnet18.
  auto m = make_model("resnet18", {1, 28, 28}, 10);
  m->materialize(cpu(), 3);
  Tensor x = cpu().alloc({2, 1, 28, 28});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i % 17) / 17.f - 0.5f;
  Tensor y = m->forward(cpu(), x);
  CHECK(y.shape() == Shape{2, 10});
  for (int64_t i = 0; i < y.numel(); ++i) CHECK(std::isfinite(y.f32()[i]));
}

TEST_CASE("initialisation: PyTorch's default uniform, BatchNorm ones and zeros, ResNet kaiming") {
  auto cnn = make_model("cnn", {1, 28, 28}, 10);
  cnn->materialize(cpu(), 11);
  struct U { const char* name; int64_t fan_in; };
  for (U u : {U{"conv1.weight", 25}, U{"conv2.weight", 500}, U{"fc1.weight", 2000},
              U{"fc2.weight", 50}}) {
    CAPTURE(u.name);
    const double bound = 1.0 / std::sqrt(double(u.fan_in));
    Stats s = stats(param(*cnn, u.name).value);
    CHECK(s.max_abs <= bound);
    CHECK(s.max_abs > 0.9 * bound);
    CHECK(s.std == doctest::Approx(bound / std::sqrt(3.0)).epsilon(0.1));
    CHECK(std::fabs(s.mean) < 0.1 * bound);
  }
  Stats big = stats(param(*cnn, "fc1.weight").value);  // 100,000 samples: tight
  CHECK(big.std == doctest::Approx(1.0 / std::sqrt(2000.0) / std::sqrt(3.0)).epsilon(0.01));
  for (U u : {U{"conv1.bias", 25}, U{"conv2.bias", 500}, U{"fc1.bias", 2000}, U{"fc2.bias", 50}}) {
    CAPTURE(u.name);
    Stats s = stats(param(*cnn, u.name).value);
    CHECK(s.max_abs <= 1.0 / std::sqrt(double(u.fan_in)));
    CHECK(s.max_abs > 0.3 / std::sqrt(double(u.fan_in)));
  }

  auto r = make_model("resnet18", {1, 28, 28}, 10);
  r->materialize(cpu(), 12);
  struct N { const char* name; int64_t fan_out; };
  for (N n : {N{"conv1.weight", 64 * 49}, N{"layer1.0.conv1.weight", 64 * 9},
              N{"layer4.1.conv2.weight", 512 * 9}, N{"layer3.0.downsample.0.weight", 256}}) {
    CAPTURE(n.name);
    Stats s = stats(param(*r, n.name).value);
    CHECK(s.std == doctest::Approx(std::sqrt(2.0 / double(n.fan_out))).epsilon(0.05));
    CHECK(std::fabs(s.mean) < 0.1 * s.std);
    CHECK(s.max_abs > 3 * s.std);  // a normal, not a uniform, has tails
  }
  for (const Param* p : r->params()) {
    const bool bn = p->name.find("bn") != std::string::npos ||
                    p->name.find("downsample.1") != std::string::npos;
    if (!bn) continue;
    CAPTURE(p->name);
    const float want = p->name.substr(p->name.size() - 6) == "weight" ? 1.f : 0.f;
    CHECK(std::count(p->value.f32(), p->value.f32() + p->value.numel(), want) == p->value.numel());
  }
  for (const Buffer* b : r->buffers()) {
    const float want = b->name.find("running_var") != std::string::npos ? 1.f : 0.f;
    CHECK(std::count(b->value.f32(), b->value.f32() + b->value.numel(), want) == b->value.numel());
  }
  const float bound = 1.f / std::sqrt(512.f);
  CHECK(stats(param(*r, "fc.weight").value).max_abs <= bound);
  const float* g = r->flat_grads().f32();
  CHECK(std::count(g, g + r->num_params(), 0.f) == r->num_params());
}

TEST_CASE("same seed gives bit-identical parameters, a different seed different ones") {
  auto a = make_model("cnn", {1, 28, 28}, 10), b = make_model("cnn", {1, 28, 28}, 10),
       c = make_model("cnn", {1, 28, 28}, 10);
  a->materialize(cpu(), 42);
  b->materialize(cpu(), 42);
  c->materialize(cpu(), 43);
  const size_t bytes = size_t(a->num_params()) * sizeof(float);
  CHECK(std::memcmp(a->flat_params().f32(), b->flat_params().f32(), bytes) == 0);
  int64_t same = 0;
  for (int64_t i = 0; i < a->num_params(); ++i)
    same += a->flat_params().f32()[i] == c->flat_params().f32()[i];
  CHECK(same < a->num_params() / 100);  // only the constant (none in cnn) or chance
  CHECK_THROWS_AS(a->materialize(cpu(), 42), Error);  // once only
}

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

TEST_CASE("the model zoo rejects what it does not know with UsageError") {
  for (const char* bad : {"vgg16", "resnet", "resnet19", "resnet18x", "ResNet18", "", "cnn2",
                          "resnet0", "resnet-18"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_model(bad, {1, 28, 28}, 10), UsageError);
  }
  CHECK_THROWS_AS(make_model("cnn", {1, 28, 28}, 1), UsageError);  // fewer than 2 classes
  CHECK_THROWS_AS(make_model("cnn", {28, 28}, 10), UsageError);    // not CxHxW
  CHECK_THROWS_AS(make_resnet(19, 3, 10), UsageError);
  for (const std::string& name : model_names()) CHECK_NOTHROW(make_model(name, {1, 28, 28}, 10));
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
