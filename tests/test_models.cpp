// Models against torchvision: parameter counts and state_dict names (resnet18, resnet50's
// bottlenecks), output shapes, initialisation statistics (PyTorch's default uniform, BatchNorm
// ones and zeros, ResNet's kaiming), seeding, and the model zoo's refusals. (Layers' behaviour:
// test_layers.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "layers/layers.h"
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
