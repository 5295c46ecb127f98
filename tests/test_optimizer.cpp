// Optimisers against double-precision reference loops of PyTorch's update rules
// (torch.optim.SGD and torch.optim.Adam, L2 weight decay), option validation, and
// checkpoint state round trips.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/allocator.h"
#include "engine/context.h"
#include "engine/error.h"
#include "layers/optimizer.h"

using namespace replica;

namespace {

constexpr int kSteps = 5;
constexpr int64_t kN = 7;

DeviceContext& cpu() {
  static DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  return ctx;
}

struct Problem {
  std::vector<float> p0;                    // initial parameters
  std::vector<std::vector<float>> grads;    // one gradient per step
};

Problem problem(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Problem pr;
  for (int64_t i = 0; i < kN; ++i) pr.p0.push_back(u(rng));
  for (int s = 0; s < kSteps; ++s) {
    std::vector<float> g;
    for (int64_t i = 0; i < kN; ++i) g.push_back(u(rng));
    pr.grads.push_back(g);
  }
  pr.grads[2][3] = 0.f;  // a zero gradient, and a large one
  pr.grads[1][5] = 20.f;
  return pr;
}

Tensor tensor(const std::vector<float>& v) {
  Tensor t = cpu().alloc({int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}
std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// torch.optim.SGD.step, in double.
std::vector<std::vector<double>> sgd_reference(const Problem& pr, const SgdConfig& c) {
  std::vector<double> p(pr.p0.begin(), pr.p0.end()), buf(kN, 0.0);
  std::vector<std::vector<double>> out;
  for (int s = 0; s < kSteps; ++s) {
    for (int64_t i = 0; i < kN; ++i) {
      double d = pr.grads[s][i] + double(c.weight_decay) * p[i];
      if (c.momentum != 0.f) {
        buf[i] = s == 0 ? d : double(c.momentum) * buf[i] + (1.0 - double(c.dampening)) * d;
        d = c.nesterov ? d + double(c.momentum) * buf[i] : buf[i];
      }
      p[i] -= double(c.lr) * d;
    }
    out.push_back(p);
  }
  return out;
}

// torch.optim.Adam.step (amsgrad off), in double.
std::vector<std::vector<double>> adam_reference(const Problem& pr, const AdamConfig& c) {
  std::vector<double> p(pr.p0.begin(), pr.p0.end()), m(kN, 0.0), v(kN, 0.0);
  std::vector<std::vector<double>> out;
  const double b1 = c.beta1, b2 = c.beta2;
  for (int s = 1; s <= kSteps; ++s) {
    const double bc1 = 1 - std::pow(b1, s), bc2 = 1 - std::pow(b2, s);
    for (int64_t i = 0; i < kN; ++i) {
      const double g = pr.grads[s - 1][i] + double(c.weight_decay) * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + double(c.eps);
      p[i] -= double(c.lr) / bc1 * m[i] / denom;
    }
    out.push_back(p);
  }
  return out;
}

// Runs the optimiser for kSteps and compares the parameters after every step.
void check_against(Optimizer& opt, const Problem& pr,
                   const std::vector<std::vector<double>>& want, double tol) {
  Tensor p = tensor(pr.p0);
  for (int s = 0; s < kSteps; ++s) {
    Tensor g = tensor(pr.grads[s]);
    opt.step(cpu(), p, g);
    CHECK(opt.steps() == s + 1);
    for (int64_t i = 0; i < kN; ++i) {
      CAPTURE(s);
      CAPTURE(i);
      CHECK(p.f32()[i] == doctest::Approx(want[s][i]).epsilon(tol).scale(1.0));
    }
  }
  // The reference really moved: a no-op optimiser cannot pass.
  double moved = 0;
  for (int64_t i = 0; i < kN; ++i) moved += std::fabs(want.back()[i] - pr.p0[i]);
  CHECK(moved > 0.05);
}

}  // namespace

TEST_CASE("SGD matches torch.optim.SGD: plain, momentum, dampening, nesterov, weight decay") {
  struct Case { const char* what; SgdConfig c; };
  const Case cases[] = {
      {"plain", {0.1f, 0.f, 0.f, 0.f, false}},
      {"momentum", {0.1f, 0.9f, 0.f, 0.f, false}},
      {"momentum+dampening", {0.1f, 0.9f, 0.5f, 0.f, false}},
      {"nesterov", {0.05f, 0.8f, 0.f, 0.f, true}},
      {"weight decay", {0.1f, 0.f, 0.f, 0.01f, false}},
      {"everything", {0.03f, 0.9f, 0.f, 0.1f, true}},
  };
  for (const Case& k : cases) {
    CAPTURE(k.what);
    Problem pr = problem(11);
    Sgd opt(k.c);
    check_against(opt, pr, sgd_reference(pr, k.c), 1e-6);
  }
}

TEST_CASE("SGD through make_optimizer: momentum buffer starts at the first gradient") {
  OptimizerOptions o;
  o.name = "sgd";
  o.lr = 0.1f;
  o.momentum = 0.9f;
  o.weight_decay = 5e-4f;
  auto opt = make_optimizer(o);
  CHECK(opt->name() == "sgd");
  CHECK(opt->lr() == 0.1f);
  Problem pr = problem(12);
  SgdConfig c{0.1f, 0.9f, 0.f, 5e-4f, false};
  check_against(*opt, pr, sgd_reference(pr, c), 1e-6);
  // Step 1 in closed form: p1 = p0 - lr * (g0 + wd p0).
  auto fresh = make_optimizer(o);
  Tensor p = tensor(pr.p0), g = tensor(pr.grads[0]);
  fresh->step(cpu(), p, g);
  for (int64_t i = 0; i < kN; ++i)
    CHECK(p.f32()[i] == doctest::Approx(pr.p0[i] - 0.1 * (pr.grads[0][i] + 5e-4 * pr.p0[i])));
}

TEST_CASE("Adam matches torch.optim.Adam, with and without weight decay") {
  for (float wd : {0.f, 0.05f}) {
    CAPTURE(wd);
    AdamConfig c;
    c.lr = 0.1f;
    c.weight_decay = wd;
    Problem pr = problem(13);
    Adam opt(c);
    check_against(opt, pr, adam_reference(pr, c), 1e-5);
    auto made = make_optimizer(OptimizerOptions{"adam", 0.1f, 0.f, wd, false});
    CHECK(made->name() == "adam");
    check_against(*made, pr, adam_reference(pr, c), 1e-5);
  }
  // Other betas and eps through the config.
  AdamConfig c{0.01f, 0.5f, 0.9f, 1e-3f, 0.f};
  Problem pr = problem(14);
  Adam opt(c);
  check_against(opt, pr, adam_reference(pr, c), 1e-5);
}

TEST_CASE("Adam's first step moves each parameter by lr against the sign of its gradient") {
  Adam opt(AdamConfig{0.01f});
  Problem pr = problem(15);
  Tensor p = tensor(pr.p0), g = tensor(pr.grads[0]);
  opt.step(cpu(), p, g);
  for (int64_t i = 0; i < kN; ++i) {
    const double gi = pr.grads[0][i];
    CHECK(p.f32()[i] == doctest::Approx(pr.p0[i] - 0.01 * gi / (std::fabs(gi) + 1e-8)));
  }
}

TEST_CASE("make_optimizer rejects bad options with UsageError") {
  auto bad = [](OptimizerOptions o) { CHECK_THROWS_AS(make_optimizer(o), UsageError); };
  for (const char* name : {"sgd", "adam"}) {
    CAPTURE(name);
    bad({name, 0.f});
    bad({name, -0.1f});
    bad({name, std::numeric_limits<float>::quiet_NaN()});
    bad({name, std::numeric_limits<float>::infinity()});
    bad({name, 0.1f, -0.1f});       // momentum < 0
    bad({name, 0.1f, 1.f});         // momentum >= 1
    bad({name, 0.1f, 0.f, -1e-4f});  // negative weight decay
  }
  bad({"sgd", 0.1f, 0.f, 0.f, true});  // nesterov without momentum
  bad({"rmsprop", 0.1f});
  bad({"", 0.1f});
  bad({"SGD", 0.1f});
  CHECK_NOTHROW(make_optimizer({"sgd", 0.1f, 0.9f, 0.f, true}));
  CHECK_NOTHROW(make_optimizer({"adam", 1e-3f}));
}

namespace {

// Runs an optimiser for 3 steps, restores its state into a second one through host tensors,
// then runs both for 2 more steps: the parameters must stay bit-identical. A third, fresh
// optimiser continuing from the same parameters must not, so the comparison has teeth.
void check_round_trip(const OptimizerOptions& o, size_t state_tensors) {
  auto a = make_optimizer(o), b = make_optimizer(o), fresh = make_optimizer(o);
  Problem pr = problem(21);
  Tensor pa = tensor(pr.p0);
  for (int s = 0; s < 3; ++s) {
    Tensor g = tensor(pr.grads[s]);
    a->step(cpu(), pa, g);
  }
  std::vector<std::pair<std::string, Tensor>> saved;
  for (auto& [name, t] : a->state()) {
    Tensor h = Tensor::empty(host_allocator(), t.shape());
    std::memcpy(h.f32(), t.f32(), t.bytes());
    saved.emplace_back(name, h);
  }
  CHECK(saved.size() == state_tensors);
  b->load_state(cpu(), kN, a->steps(), saved);
  CHECK(b->steps() == 3);
  Tensor pb = tensor(values(pa)), pf = tensor(values(pa));
  for (int s = 3; s < kSteps; ++s) {
    Tensor g = tensor(pr.grads[s]);
    a->step(cpu(), pa, g);
    b->step(cpu(), pb, g);
    fresh->step(cpu(), pf, g);
  }
  CHECK(b->steps() == kSteps);
  CHECK(std::memcmp(pa.f32(), pb.f32(), kN * sizeof(float)) == 0);
  CHECK(std::memcmp(pa.f32(), pf.f32(), kN * sizeof(float)) != 0);
}

}  // namespace

TEST_CASE("load_state round trip continues identically: SGD with momentum, Adam") {
  SUBCASE("sgd") { check_round_trip({"sgd", 0.1f, 0.9f, 1e-3f, true}, 1); }
  SUBCASE("adam") { check_round_trip({"adam", 0.05f, 0.f, 1e-3f}, 2); }
  SUBCASE("state names") {
    auto sgd = make_optimizer({"sgd", 0.1f, 0.9f});
    auto adam = make_optimizer({"adam", 0.1f});
    Problem pr = problem(23);
    Tensor p = tensor(pr.p0), g = tensor(pr.grads[0]);
    CHECK(adam->state().empty());  // nothing before the first step
    sgd->step(cpu(), p, g);
    adam->step(cpu(), p, g);
    REQUIRE(sgd->state().size() == 1);
    CHECK(sgd->state()[0].first == "momentum_buffer");
    REQUIRE(adam->state().size() == 2);
    CHECK(adam->state()[0].first == "exp_avg");
    CHECK(adam->state()[1].first == "exp_avg_sq");
  }
  SUBCASE("plain sgd has no state") {
    auto a = make_optimizer({"sgd", 0.1f});
    Problem pr = problem(22);
    Tensor p = tensor(pr.p0), g = tensor(pr.grads[0]);
    a->step(cpu(), p, g);
    CHECK(a->state().empty());
  }
}

TEST_CASE("load_state rejects missing or mis-sized state") {
  auto adam = make_optimizer({"adam", 0.01f});
  Tensor m = Tensor::empty(host_allocator(), {kN});
  Tensor wrong = Tensor::empty(host_allocator(), {kN + 1});
  CHECK_THROWS_AS(adam->load_state(cpu(), kN, 4, {{"exp_avg", m}}), Error);  // no exp_avg_sq
  auto adam2 = make_optimizer({"adam", 0.01f});
  CHECK_THROWS_AS(adam2->load_state(cpu(), kN, 4, {{"exp_avg", m}, {"exp_avg_sq", wrong}}), Error);
  // steps == 0: a fresh optimiser, nothing to read.
  auto sgd = make_optimizer({"sgd", 0.1f, 0.9f});
  CHECK_NOTHROW(sgd->load_state(cpu(), kN, 0, {}));
  CHECK(sgd->steps() == 0);
}

TEST_CASE("learning-rate schedules") {
  CHECK(replica::LrSchedule("constant").at(0.1f, 500, 1000) == doctest::Approx(0.1f));
  CHECK(replica::LrSchedule("cosine").at(0.1f, 0, 1000) == doctest::Approx(0.1f));
  CHECK(replica::LrSchedule("cosine").at(0.1f, 500, 1000) == doctest::Approx(0.05f));
  CHECK(replica::LrSchedule("cosine").at(0.1f, 1000, 1000) == doctest::Approx(0.0f));
  CHECK(replica::LrSchedule("cosine").at(0.1f, 250, 1000) ==
        doctest::Approx(0.1 * 0.5 * (1 + std::cos(3.141592653589793 / 4))));
  CHECK_THROWS_AS(replica::LrSchedule("linear"), replica::UsageError);
  // StepLR by epochs: x0.5 after every 2 epochs; GAMMA defaults to 0.1. The step does not
  // count: an epoch's lr is the same at its first and last step.
  for (const auto& [epoch, want] : std::vector<std::pair<int64_t, double>>{
           {0, 1.0}, {1, 1.0}, {2, 0.5}, {3, 0.5}, {4, 0.25}, {6, 0.125}})
    CHECK(replica::LrSchedule("step:2:0.5").at(1.f, 999, 1000, epoch) == doctest::Approx(want));
  CHECK(replica::LrSchedule("step:30").at(0.1f, 0, 1000, 29) == doctest::Approx(0.1));
  CHECK(replica::LrSchedule("step:30").at(0.1f, 0, 1000, 30) == doctest::Approx(0.01));
  CHECK(replica::LrSchedule("step:30").at(0.1f, 0, 1000, 60) == doctest::Approx(0.001));
  for (const char* bad : {"step:", "step:0", "step:x", "step:3:", "step:3:0", "step:3:1.5",
                          "step:3:0.1:2", "step:-2"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(replica::LrSchedule{bad}, replica::UsageError);
  }
}
