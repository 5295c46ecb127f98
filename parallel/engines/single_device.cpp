// The single-device engine: the reference every parallel engine is checked against.
#include "engine/error.h"
#include "engine/trace.h"
#include "layers/loss.h"
#include "parallel/engines/captured_step.h"
#include "parallel/engines/engine_steps.h"
#include "parallel/engines/train_engine.h"

namespace replica {

namespace {

class SingleDeviceEngine final : public OneDeviceEngine {
 public:
  SingleDeviceEngine(const Device& device, const EngineOptions& o, std::string mode)
      : OneDeviceEngine(
            std::make_unique<DeviceContext>(device, context_options(o, o.threads_per_device)),
            device.str(), o),
        mode_(std::move(mode)),
        captured_(o.cuda_graphs) {}

  std::string mode() const override { return mode_; }

  void train_step(const Batch& batch) override {
    REPLICA_CHECK(batch.size() > 0, "empty batch");
    ctx_.run([&] {
      auto [x, y] = whole_batch_to_device(ctx_, batch, track_);
      step_.optimizer->prepare_step(ctx_, model_->flat_params().numel());  // on the host
      // The device work, eager or replayed (captured_step.h): what a capture records.
      step_.loss = captured_.run(ctx_, x, y, [&](const Tensor& xs, const Tensor& ys) {
        Tensor loss;
        {
          TraceSpan span(track_, "forward", &ctx_);
          model_->zero_grad(ctx_);
          loss = step_.criterion.forward(ctx_, model_->forward(ctx_, xs), ys);
        }
        {
          TraceSpan span(track_, "backward", &ctx_);
          model_->backward(ctx_, step_.criterion.backward(ctx_));
        }
        TraceSpan span(track_, "step", &ctx_);
        step_.optimizer->apply_step(ctx_, model_->flat_params(), model_->flat_grads());
        return loss;
      });
    });
    step_.note_forward(model_->last_forward_macs(), batch.size());
  }

  void prefetch(const Batch& next) override {
    prefetcher_.stage(ctx_, next, 0, next.size(), BatchParts::Both, track_);
  }
  float last_loss() override { return step_.read_loss(ctx_); }
  void synchronize() override { ctx_.synchronize(); }
  const CapturedStep* captured_step() const override { return &captured_; }

 private:
  std::string mode_;
  CapturedStep captured_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_single_device_engine(const Device& device,
                                                       const EngineOptions& options,
                                                       const std::string& mode) {
  return std::make_unique<SingleDeviceEngine>(device, options, mode);
}

}  // namespace replica
