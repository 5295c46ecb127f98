// Optimisers over a model's flat parameter and gradient buffers: one fused kernel per step.
// Update rules are PyTorch's (torch.optim.SGD, torch.optim.Adam with L2 weight decay).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/ops.h"

namespace replica {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;
  // params -= update(grads); state lives on ctx's device, allocated on the first step.
  virtual void step(DeviceContext& ctx, Tensor& params, const Tensor& grads) = 0;
  int64_t steps() const { return steps_; }
  // State for checkpoints: ("exp_avg", tensor), ... (device tensors, flat like the params).
  virtual std::vector<std::pair<std::string, Tensor>> state() = 0;
  // Restores state saved by state(); host tensors copied to ctx's device.
  void load_state(DeviceContext& ctx, int64_t numel, int64_t steps,
                  const std::vector<std::pair<std::string, Tensor>>& host_state);
  virtual float lr() const = 0;

 protected:
  virtual void allocate_state(DeviceContext& ctx, int64_t numel) = 0;
  int64_t steps_ = 0;
};

class Sgd : public Optimizer {
 public:
  explicit Sgd(SgdConfig c);
  std::string name() const override { return "sgd"; }
  void step(DeviceContext& ctx, Tensor& params, const Tensor& grads) override;
  std::vector<std::pair<std::string, Tensor>> state() override;
  float lr() const override { return c_.lr; }

 protected:
  void allocate_state(DeviceContext& ctx, int64_t numel) override;

 private:
  SgdConfig c_;
  Tensor momentum_;
};

class Adam : public Optimizer {
 public:
  explicit Adam(AdamConfig c);
  std::string name() const override { return "adam"; }
  void step(DeviceContext& ctx, Tensor& params, const Tensor& grads) override;
  std::vector<std::pair<std::string, Tensor>> state() override;
  float lr() const override { return c_.lr; }

 protected:
  void allocate_state(DeviceContext& ctx, int64_t numel) override;

 private:
  AdamConfig c_;
  Tensor m_, v_;
};

struct OptimizerOptions {
  std::string name = "adam";  // sgd | adam
  float lr = 1e-3f;
  float momentum = 0.f, weight_decay = 0.f;
  bool nesterov = false;
};
// Validates (UsageError): unknown name, lr <= 0 or not finite, momentum outside [0, 1),
// negative weight decay, nesterov without momentum.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& o);

}  // namespace replica
