// The single-device engine: the reference every parallel engine is checked against.

#include "engine/error.h"
#include "engine/trace.h"
#include "layers/loss.h"
#include "parallel/engines/engine_steps.h"
#include "parallel/engines/train_engine.h"

namespace replica {

namespace {

class SingleDeviceEngine final : public TrainEngine {
 public:
  SingleDeviceEngine(const Device& device, const EngineOptions& o)
      : ctx_(device, context_options(o, o.threads_per_device)),
        track_(device.str()),
        step_(ctx_, o.optimizer),
        prefetcher_({&ctx_}, o.prefetch_on_cpu),
        captured_(o.cuda_graphs) {
    model_ = make_model(o.model, o.input_shape, o.num_classes);
    ctx_.run([&] { model_->materialize(ctx_, o.seed); });
  }

  std::string mode() const override { return "single"; }
  std::vector<Device> devices() const override { return {ctx_.device()}; }
  std::vector<DeviceContext*> contexts() override { return {&ctx_}; }

  void train_step(const Batch& batch) override {
    REPLICA_CHECK(batch.size() > 0, "empty batch");
    ctx_.run([&] {
      auto [x, y] = whole_batch_to_device(ctx_, batch, track_);
      one_device_step(ctx_, *model_, step_, captured_, x, y, track_);
    });
    step_.note_forward(model_->last_forward_macs(), batch.size());
  }

  void prefetch(const Batch& next) override {
    prefetcher_.stage(ctx_, next, 0, next.size(), BatchParts::Both, track_);
  }
  bool prefetches() const override { return prefetcher_.active(); }

  float last_loss() override { return step_.read_loss(ctx_); }

  void eval_batch(const Batch& batch, EvalSums& sums) override {
    evaluate_batch(ctx_, *model_, step_.criterion, batch, 0, batch.size(), sums);
  }

  void set_training(bool training) override { model_->set_training(training); }
  void synchronize() override { ctx_.synchronize(); }
  Model& model() override { return *model_; }
  DeviceContext& primary() override { return ctx_; }
  Optimizer& optimizer() override { return *step_.optimizer; }
  double forward_macs_per_sample() const override { return step_.macs_per_sample; }
  const CapturedStep* captured_step() const override { return &captured_; }

 private:
  DeviceContext ctx_;
  std::string track_;
  PrimaryStep step_;
  BatchPrefetcher prefetcher_;
  CapturedStep captured_;
  std::unique_ptr<Model> model_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_single_device_engine(const Device& device,
                                                       const EngineOptions& options) {
  return std::make_unique<SingleDeviceEngine>(device, options);
}

}  // namespace replica
