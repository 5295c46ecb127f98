// Gradient checks of composed modules (Sequential, BasicBlock, Bottleneck) against the
// double-precision references, whole models against float32 differences of the engine's own
// loss, and the grad hooks DP's overlap and DDP's buckets build on.
#include "gradcheck_support.h"

using namespace replica;
using namespace gradref;

// ---- composed modules ---------------------------------------------------------------------------

TEST_CASE("gradcheck: Sequential conv-bn-relu-maxpool-flatten-linear-relu-linear") {
  auto net = std::make_unique<Sequential>();
  net->add("conv", std::make_unique<Conv2d>(2, 3, 3, 2, 1));
  net->add("bn", std::make_unique<BatchNorm2d>(3));
  net->add("relu", std::make_unique<ReLU>());
  net->add("pool", std::make_unique<MaxPool2d>(3, 2, 1));
  net->add("flatten", std::make_unique<Flatten>());
  net->add("fc1", std::make_unique<Linear>(12, 5));
  net->add("relu2", std::make_unique<ReLU>());
  net->add("fc2", std::make_unique<Linear>(5, 4));
  check_module(std::move(net), kImage, [](const DT& x, const Params& p) {
    DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], &p[1], 2, 1), p[2], p[3]));
    h = ref_maxpool(h, 3, 2, 1);
    h = ref_reshape(h, {3, 12});
    h = ref_relu(ref_linear(h, p[4], &p[5]));
    return ref_linear(h, p[6], &p[7]);
  });
}

TEST_CASE("gradcheck: BasicBlock, identity shortcut and stride-2 downsample") {
  // params: conv1.weight, bn1.{weight,bias}, conv2.weight, bn2.{weight,bias}[, downsample]
  auto body = [](const DT& x, const Params& p, int stride) {
    DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], nullptr, stride, 1), p[1], p[2]));
    return ref_batchnorm(ref_conv2d(h, p[3], nullptr, 1, 1), p[4], p[5]);
  };
  check_module(std::make_unique<BasicBlock>(3, 3, 1), {3, 3, 7, 5},
               [&](const DT& x, const Params& p) { return ref_relu(ref_add(body(x, p, 1), x)); });
  check_module(std::make_unique<BasicBlock>(2, 3, 2), kImage, [&](const DT& x, const Params& p) {
    DT sc = ref_batchnorm(ref_conv2d(x, p[6], nullptr, 2, 0), p[7], p[8]);
    return ref_relu(ref_add(body(x, p, 2), sc));
  });
}

TEST_CASE("gradcheck: Bottleneck with stride 2 and downsample") {
  check_module(std::make_unique<Bottleneck>(4, 2, 2), {3, 4, 7, 5},
               [](const DT& x, const Params& p) {
                 DT h = ref_relu(ref_batchnorm(ref_conv2d(x, p[0], nullptr, 1, 0), p[1], p[2]));
                 h = ref_relu(ref_batchnorm(ref_conv2d(h, p[3], nullptr, 2, 1), p[4], p[5]));
                 h = ref_batchnorm(ref_conv2d(h, p[6], nullptr, 1, 0), p[7], p[8]);
                 DT sc = ref_batchnorm(ref_conv2d(x, p[9], nullptr, 2, 0), p[10], p[11]);
                 return ref_relu(ref_add(h, sc));
               });
}

// ---- whole models -----------------------------------------------------------------------------

namespace {

// Mean cross-entropy of the model's logits, accumulated in double.
double model_loss(DeviceContext& ctx, Model& m, const Tensor& x, const std::vector<int32_t>& lab) {
  Tensor logits = m.forward(ctx, x);
  DT ld(logits.shape());
  for (int64_t i = 0; i < logits.numel(); ++i) ld.v[size_t(i)] = logits.f32()[i];
  return ref_cross_entropy(ld, lab);
}

// Analytic gradients of 30 parameters (from 30 random parameter tensors, in each the element
// with the largest gradient among 16 random ones, so the signal stands above float32 noise)
// against float32 central differences of the model's mean loss, accumulated in double.
// The loss of a small ResNet in training mode is steep in places (BatchNorm over a handful of
// values), has kinks (ReLU, max-pool) and float32 limits how small a step can be, so no single
// step suits every parameter: each quotient is taken at a ladder of steps, the closest kept.
// Nearly all must agree to 2%, and none may be off by more than 20%.
void check_model(const std::string& name, const Shape& in, int64_t classes, int64_t batch) {
  on_cpu([&](DeviceContext& ctx) {
    auto m = make_model(name, in, classes);
    m->materialize(ctx, 17);
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    Shape xs = in;
    xs.insert(xs.begin(), batch);
    Tensor x = ctx.alloc(xs);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(rng);
    Tensor labels = ctx.alloc({batch}, DType::I32);
    std::vector<int32_t> lab;
    for (int64_t i = 0; i < batch; ++i)
      lab.push_back(labels.i32()[i] = int32_t((i * 7 + 3) % classes));

    CrossEntropyLoss ce;
    ce.forward(ctx, m->forward(ctx, x), labels);
    m->backward(ctx, ce.backward(ctx));
    const std::vector<float> g = host_copy(m->flat_grads());

    std::vector<const Param*> chosen(m->params().begin(), m->params().end());
    std::shuffle(chosen.begin(), chosen.end(), rng);
    for (size_t k = 0; chosen.size() < 30; ++k) chosen.push_back(chosen[k]);
    chosen.resize(30);

    Mismatches close, gross;
    double gmax = 0;
    for (const Param* p : chosen) {
      int64_t i = p->offset;
      for (int c = 0; c < 16; ++c) {
        int64_t j = p->offset + int64_t(rng() % uint64_t(p->value.numel()));
        if (std::fabs(g[size_t(j)]) > std::fabs(g[size_t(i)])) i = j;
      }
      const double analytic = g[size_t(i)];
      gmax = std::max(gmax, std::fabs(analytic));
      float* w = m->flat_params().f32() + i;
      const float keep = *w;
      double best = 0, best_err = std::numeric_limits<double>::infinity();
      for (float h : {1e-2f, 3e-3f, 1e-3f, 3e-4f, 1e-4f, 3e-5f, 1e-5f}) {
        const float up = keep + h, down = keep - h;
        *w = up;
        const double lp = model_loss(ctx, *m, x, lab);
        *w = down;
        const double lm = model_loss(ctx, *m, x, lab);
        *w = keep;
        const double fd = (lp - lm) / (double(up) - double(down));
        const double err = std::fabs(fd - analytic) / (std::fabs(fd) + 1e-3);
        if (err < best_err) best_err = err, best = fd;
        if (std::fabs(fd - analytic) <= 2e-2 * std::fabs(fd) + 1e-3) break;  // close enough
      }
      const std::string what = p->name + "[" + std::to_string(i - p->offset) + "]";
      close.compare(what, analytic, best, 2e-2, 1e-3);
      gross.compare(what, analytic, best, 0.2, 5e-3);
    }
    INFO(name, ": ", close.count, " of ", close.checked, " differ by more than 2%:\n", close.first);
    CHECK(close.count <= 3);
    CHECK(gross.count == 0);
    CHECK(gmax > 1e-2);
  });
}

}  // namespace

TEST_CASE("gradcheck: whole cnn model against finite differences of its loss") {
  check_model("cnn", {1, 12, 12}, 4, 3);
}

TEST_CASE("gradcheck: whole resnet18 (MNIST variant) against finite differences of its loss") {
  check_model("resnet18", {1, 28, 28}, 10, 4);
}

// ---- the grad hook ------------------------------------------------------------------------------

namespace {

struct HookLog {
  std::vector<std::vector<std::string>> groups;
  std::map<const Param*, int> times;
  std::map<const Param*, std::vector<float>> at_report;  // the gradient when it was reported
};

void install(Model& m, HookLog& log) {
  m.set_grad_hook([&log](const std::vector<Param*>& ps) {
    std::vector<std::string> names;
    for (Param* p : ps) {
      names.push_back(p->name);
      ++log.times[p];
      log.at_report[p] = host_copy(p->grad);
    }
    log.groups.push_back(names);
  });
}

}  // namespace

TEST_CASE("grad hook: BasicBlock reports each parameter once, in reverse, after its backward") {
  on_cpu([&](DeviceContext& ctx) {
    auto m = wrap(ctx, std::make_unique<BasicBlock>(2, 3, 2), 4);
    HookLog log;
    install(*m, log);
    Tensor x = ctx.alloc(kImage);
    std::mt19937_64 rng(8);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = u(rng);
    Tensor y = m->forward(ctx, x);
    Tensor dy = ctx.alloc(y.shape());
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = u(rng);
    CHECK(log.groups.empty());  // forward reports nothing
    m->backward(ctx, dy);
    const std::vector<std::vector<std::string>> expected = {
        {"downsample.1.weight", "downsample.1.bias"}, {"downsample.0.weight"},
        {"bn2.weight", "bn2.bias"}, {"conv2.weight"}, {"bn1.weight", "bn1.bias"}, {"conv1.weight"}};
    CHECK(log.groups == expected);
    for (const Param* p : m->params()) {
      CAPTURE(p->name);
      CHECK(log.times[p] == 1);
      CHECK(log.at_report[p] == host_copy(p->grad));  // final when reported
    }
  });
}

TEST_CASE("grad hook: resnet18 reports all 62 parameters once per backward, fc first, conv1 last") {
  on_cpu([&](DeviceContext& ctx) {
    auto m = make_model("resnet18", {1, 28, 28}, 10);
    m->materialize(ctx, 2);
    HookLog log;
    install(*m, log);
    Tensor x = ctx.alloc({2, 1, 28, 28});
    std::mt19937_64 rng(9);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(rng);
    for (int round = 1; round <= 2; ++round) {
      CAPTURE(round);
      log.groups.clear();
      Tensor y = m->forward(ctx, x);
      Tensor dy = ctx.alloc(y.shape());
      for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(rng);
      m->backward(ctx, dy);
      REQUIRE(m->params().size() == 62);
      CHECK(log.times.size() == 62);
      for (const Param* p : m->params()) {
        CAPTURE(p->name);
        CHECK(log.times[p] == round);
        CHECK(log.at_report[p] == host_copy(p->grad));
      }
      REQUIRE(!log.groups.empty());
      CHECK(log.groups.front() == std::vector<std::string>{"fc.weight", "fc.bias"});
      CHECK(log.groups.back() == std::vector<std::string>{"conv1.weight"});
      CHECK(log.groups[log.groups.size() - 2] ==
            std::vector<std::string>{"bn1.weight", "bn1.bias"});
    }
  });
}
