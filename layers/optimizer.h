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
  // params -= update(grads): prepare_step, then apply_step.
  void step(DeviceContext& ctx, Tensor& params, const Tensor& grads) {
    prepare_step(ctx, params.numel());
    apply_step(ctx, params, grads);
  }
  // The host's part of a step: the state (on ctx's device) allocated on the first step, the
  // step counted, and its numbers (learning rate, bias corrections) written to the device with
  // fill ops. Never inside a captured step (engine/step_graph.h): the numbers would be those of
  // the step it was captured at.
  void prepare_step(DeviceContext& ctx, int64_t numel);
  // The device's part: one fused kernel that reads those numbers. What a captured step replays.
  virtual void apply_step(DeviceContext& ctx, Tensor& params, const Tensor& grads) = 0;
  int64_t steps() const { return steps_; }
  // State for checkpoints: ("exp_avg", tensor), ... (device tensors, flat like the params).
  virtual std::vector<std::pair<std::string, Tensor>> state() = 0;
  // Restores state saved by state(); host tensors copied to ctx's device.
  void load_state(DeviceContext& ctx, int64_t numel, int64_t steps,
                  const std::vector<std::pair<std::string, Tensor>>& host_state);
  virtual float lr() const = 0;
  // Changes the learning rate from the next step on (schedules).
  virtual void set_lr(float lr) = 0;

 protected:
  virtual void allocate_state(DeviceContext& ctx, int64_t numel) = 0;
  // Throws if a loaded state tensor (host memory) holds values this optimizer never writes.
  virtual void check_loaded(const std::string& name, const Tensor& host) const {}
  // The numbers of the step about to be taken (steps_ = the steps taken before it).
  virtual StepScalars next_scalars() const = 0;
  int64_t steps_ = 0;
  Tensor scalars_;  // F32 [2] on the device: the step's numbers (backend_ops.inc)
};

class Sgd : public Optimizer {
 public:
  explicit Sgd(SgdConfig c);
  std::string name() const override { return "sgd"; }
  void apply_step(DeviceContext& ctx, Tensor& params, const Tensor& grads) override;
  std::vector<std::pair<std::string, Tensor>> state() override;
  float lr() const override { return c_.lr; }
  void set_lr(float lr) override { c_.lr = lr; }

 protected:
  void allocate_state(DeviceContext& ctx, int64_t numel) override;
  StepScalars next_scalars() const override { return sgd_step_scalars(c_, steps_ == 0); }

 private:
  SgdConfig c_;
  Tensor momentum_;
};

class Adam : public Optimizer {
 public:
  explicit Adam(AdamConfig c);
  std::string name() const override { return "adam"; }
  void apply_step(DeviceContext& ctx, Tensor& params, const Tensor& grads) override;
  std::vector<std::pair<std::string, Tensor>> state() override;
  float lr() const override { return c_.lr; }
  void set_lr(float lr) override { c_.lr = lr; }

 protected:
  void allocate_state(DeviceContext& ctx, int64_t numel) override;
  void check_loaded(const std::string& name, const Tensor& host) const override;
  StepScalars next_scalars() const override { return adam_step_scalars(c_, steps_ + 1); }

 private:
  AdamConfig c_;
  Tensor m_, v_;
};

// Writes a step's numbers into `scalars` (F32 [2] on ctx's device) with two fill ops: the
// values travel as kernel arguments, so no host buffer must outlive the call.
void write_step_scalars(DeviceContext& ctx, Tensor& scalars, const StepScalars& values);

struct OptimizerOptions {
  std::string name = "adam";  // sgd | adam
  float lr = 1e-3f;
  float momentum = 0.f, weight_decay = 0.f;
  bool nesterov = false;
};
// A learning-rate schedule, read once from its --lr-schedule text:
//   "constant"
//   "cosine"          lr0 * (1 + cos(pi * step / total)) / 2, from lr0 towards 0 at the end
//   "step:N[:GAMMA]"  PyTorch's StepLR(step_size=N, gamma=GAMMA, default 0.1): lr0 *
//                     GAMMA^(epoch // N)
class LrSchedule {
 public:
  // UsageError for another name, N < 1 or GAMMA outside (0, 1].
  explicit LrSchedule(const std::string& text);
  // The learning rate at optimizer step `step` (0-based) of `total`, in epoch `epoch` (0-based).
  float at(float lr0, int64_t step, int64_t total, int64_t epoch = 0) const;

 private:
  enum class Kind { Constant, Cosine, Step };
  Kind kind_ = Kind::Constant;
  int64_t every_ = 1;   // Step: epochs between decays
  double gamma_ = 0.1;  // Step: the factor at each decay
};

// UsageError for an unknown name, lr <= 0 or not finite, momentum outside [0, 1), negative
// weight decay, nesterov without momentum: what the command line is checked for before a run
// starts (and --print-config prints), and what make_optimizer checks again.
void check_optimizer_options(const OptimizerOptions& o);
std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& o);

}  // namespace replica
