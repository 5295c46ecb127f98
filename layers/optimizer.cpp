#include "layers/optimizer.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "engine/error.h"

namespace replica {

void Optimizer::load_state(DeviceContext& ctx, int64_t numel, int64_t steps,
                           const std::vector<std::pair<std::string, Tensor>>& host_state) {
  steps_ = steps;
  if (steps == 0) return;
  allocate_state(ctx, numel);
  for (auto& [name, dst] : state()) {
    const Tensor* src = nullptr;
    for (const auto& [n, t] : host_state)
      if (n == name) src = &t;
    REPLICA_CHECK(src != nullptr, "checkpoint lacks optimizer state '{}'", name);
    REPLICA_CHECK(src->numel() == dst.numel(), "optimizer state '{}' has {} values, expected {}",
                  name, src->numel(), dst.numel());
    REPLICA_CHECK(src->dtype() == dst.dtype(), "optimizer state '{}' is {}, expected {}", name,
                  dtype_name(src->dtype()), dtype_name(dst.dtype()));
    check_loaded(name, *src);
    ctx.ops().copy(ctx, dst, *src);
  }
  ctx.synchronize();
}

void Optimizer::prepare_step(DeviceContext& ctx, int64_t numel) {
  allocate_state(ctx, numel);
  if (!scalars_.defined()) scalars_ = ctx.alloc({2});
  write_step_scalars(ctx, scalars_, next_scalars());
  ++steps_;
}

void write_step_scalars(DeviceContext& ctx, Tensor& scalars, const StepScalars& values) {
  for (int i = 0; i < 2; ++i) {
    Tensor one = scalars.view(i, {1});
    ctx.ops().fill(ctx, one, values[i]);
  }
}

Sgd::Sgd(SgdConfig c) : c_(c) {}

void Sgd::allocate_state(DeviceContext& ctx, int64_t numel) {
  if (c_.momentum != 0.f && !momentum_.defined()) momentum_ = ctx.alloc({numel});
}

void Sgd::apply_step(DeviceContext& ctx, Tensor& params, const Tensor& grads) {
  REPLICA_CHECK(scalars_.defined(), "sgd: apply_step before prepare_step");
  ctx.ops().sgd_step(ctx, params, grads, momentum_, c_, scalars_);
}

std::vector<std::pair<std::string, Tensor>> Sgd::state() {
  if (!momentum_.defined()) return {};
  return {{"momentum_buffer", momentum_}};
}

Adam::Adam(AdamConfig c) : c_(c) {}

void Adam::allocate_state(DeviceContext& ctx, int64_t numel) {
  if (m_.defined()) return;
  m_ = ctx.alloc({numel});
  v_ = ctx.alloc({numel});
  ctx.ops().fill(ctx, m_, 0.f);
  ctx.ops().fill(ctx, v_, 0.f);
}

void Adam::apply_step(DeviceContext& ctx, Tensor& params, const Tensor& grads) {
  REPLICA_CHECK(scalars_.defined(), "adam: apply_step before prepare_step");
  ctx.ops().adam_step(ctx, params, grads, m_, v_, c_, scalars_);
}

// The second moment is a running mean of squares: a negative value is a corrupt file, and its
// square root in the step would be NaN.
void Adam::check_loaded(const std::string& name, const Tensor& host) const {
  if (name != "exp_avg_sq") return;
  const float* v = host.f32();
  for (int64_t i = 0; i < host.numel(); ++i)
    REPLICA_CHECK(v[i] >= 0.f, "optimizer state 'exp_avg_sq' holds {} at element {}: a mean of "
                  "squares is never negative", v[i], i);
}

std::vector<std::pair<std::string, Tensor>> Adam::state() {
  if (!m_.defined()) return {};
  return {{"exp_avg", m_}, {"exp_avg_sq", v_}};
}

LrSchedule::LrSchedule(const std::string& text) {
  if (text == "constant") return;
  if (text == "cosine") {
    kind_ = Kind::Cosine;
    return;
  }
  REPLICA_USAGE_CHECK(text.rfind("step:", 0) == 0,
                      "unknown --lr-schedule '{}' (constant, cosine, step:N[:GAMMA])", text);
  kind_ = Kind::Step;
  const std::string spec = text.substr(5);
  const size_t colon = spec.find(':');
  const std::string n_text = spec.substr(0, colon);
  const std::string g_text = colon == std::string::npos ? "0.1" : spec.substr(colon + 1);
  const auto [n_end, n_ec] = std::from_chars(n_text.data(), n_text.data() + n_text.size(), every_);
  const auto [g_end, g_ec] =
      std::from_chars(g_text.data(), g_text.data() + g_text.size(), gamma_);
  REPLICA_USAGE_CHECK(!n_text.empty() && n_ec == std::errc() &&
                          n_end == n_text.data() + n_text.size() && every_ >= 1,
                      "--lr-schedule '{}': step:N[:GAMMA] needs N, the epochs between decays, a "
                      "whole number of at least 1",
                      text);
  REPLICA_USAGE_CHECK(!g_text.empty() && g_ec == std::errc() &&
                          g_end == g_text.data() + g_text.size() && gamma_ > 0 && gamma_ <= 1,
                      "--lr-schedule '{}': step:N[:GAMMA] needs GAMMA, the factor at each decay, "
                      "in (0, 1]",
                      text);
}

float LrSchedule::at(float lr0, int64_t step, int64_t total, int64_t epoch) const {
  switch (kind_) {
    case Kind::Constant:
      return lr0;
    case Kind::Cosine: {
      const double t = total > 0 ? std::min(1.0, double(step) / double(total)) : 0.0;
      return float(lr0 * 0.5 * (1.0 + std::cos(3.141592653589793 * t)));
    }
    case Kind::Step:
      return float(lr0 * std::pow(gamma_, double(std::max<int64_t>(epoch, 0) / every_)));
  }
  return lr0;
}

void check_optimizer_options(const OptimizerOptions& o) {
  REPLICA_USAGE_CHECK(o.name == "sgd" || o.name == "adam", "unknown optimizer '{}' (sgd, adam)",
                      o.name);
  REPLICA_USAGE_CHECK(std::isfinite(o.lr) && o.lr > 0.f,
                      "learning rate must be a positive number, got {}", o.lr);
  REPLICA_USAGE_CHECK(o.momentum >= 0.f && o.momentum < 1.f, "momentum must be in [0, 1), got {}",
                      o.momentum);
  REPLICA_USAGE_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0.f,
                      "weight decay must be a finite number >= 0, got {}", o.weight_decay);
  REPLICA_USAGE_CHECK(!o.nesterov || o.momentum > 0.f, "nesterov needs a momentum > 0");
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& o) {
  check_optimizer_options(o);
  if (o.name == "sgd") {
    SgdConfig c;
    c.lr = o.lr;
    c.momentum = o.momentum;
    c.weight_decay = o.weight_decay;
    c.nesterov = o.nesterov;
    return std::make_unique<Sgd>(c);
  }
  AdamConfig c;  // the only other name the check lets through
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  return std::make_unique<Adam>(c);
}

}  // namespace replica
