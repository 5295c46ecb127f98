// Pieces every engine shares: moving a host batch to a device, one evaluation batch, and what
// the step on the primary device keeps.
#pragma once
#include "engine/data/loader.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "layers/optimizer.h"
#include "parallel/engines/train_engine.h"  // EvalSums

namespace replica {

// Host batches are used in place on CPU devices (zero copy) and copied on the stream for CUDA.
Tensor batch_to_device(DeviceContext& ctx, const Tensor& host);

// Rows [begin, end) of the batch on ctx's device, images (F32) and/or labels (I32; the other
// part stays undefined): the copy a BatchPrefetcher staged for exactly these rows, else copied
// from the host batch now, or gathered from the set ctx's memory holds (a batch with
// Batch::resident), whose indices then cross once for both parts.
DeviceBatch batch_rows(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
                       BatchParts parts);

// The whole batch, images and labels, on ctx's device: traced as "h2d" (copied from the host)
// or "batch_gather" (cut out of the set on the device) on `track`.
DeviceBatch whole_batch_to_device(DeviceContext& ctx, const Batch& batch,
                                  const std::string& track);

// Copies the next step's batch to the devices while the current step computes. A copy enqueued
// on a device's compute stream runs between two steps' kernels, and the device idles for it
// (ResNet-50's 38.5 MB batch of 64 at 3x224x224); here it runs on a copy stream of its own
// (a second context of the device), which the step's stream waits for only where it reads the
// rows. The rows' memory comes from the device's allocator at staging time, and the copy
// stream first waits for the work the device's stream held then: memory that work freed may
// be written only after it ran. So the copy of batch k+1, staged before step k is enqueued,
// runs beside step k's kernels. Batches of a set held on the devices are gathered there, and
// CPU devices read host batches in place: neither is staged.
class BatchPrefetcher {
 public:
  // A copy stream for each CUDA device of `contexts`; with `stage_on_cpu` for CPU devices too,
  // where it only adds a copy: for tests of the staging on machines without a GPU.
  explicit BatchPrefetcher(const std::vector<DeviceContext*>& contexts,
                           bool stage_on_cpu = false);
  ~BatchPrefetcher();
  // Whether any device stages (else train loops need not look ahead for it).
  bool active() const { return !copiers_.empty(); }
  // Enqueues the copy of rows [begin, end) of `batch` to ctx's device (traced as "prefetch" on
  // `track`: the host's part), for batch_rows(ctx, batch, begin, end, parts) to take. A no-op
  // for a resident batch or a device without a copy stream. Thread-safe for distinct contexts.
  void stage(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
             BatchParts parts, const std::string& track);

 private:
  struct Copier;
  std::vector<std::unique_ptr<Copier>> copiers_;  // fixed after construction
};

// Eval-mode forward of rows [begin, end) of `batch` on `model` (ctx's device): adds the summed
// loss and the top-1/top-5 counts to `sums`. Reads the loss and counts back (a host sync:
// evaluation only). The batch may come from the host or from a set held on the device.
void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Batch& batch, int64_t begin, int64_t end, EvalSums& sums);

// The step on an engine's primary device (DP: device 0; DDP: this rank's): its optimizer and
// criterion, the last step's mean loss (a device tensor: reading it is a host sync), and the
// forward's multiply-adds per sample, taken from the first step.
struct PrimaryStep {
  PrimaryStep(DeviceContext& ctx, const OptimizerOptions& optimizer_options);
  // The last loss, copied to the host once ctx's stream has computed it.
  float read_loss(DeviceContext& ctx);
  // After a step over `samples` samples whose forward did `macs` multiply-adds (first step only).
  void note_forward(double macs, int64_t samples) {
    if (macs_per_sample == 0) macs_per_sample = macs / double(samples);
  }

  std::unique_ptr<Optimizer> optimizer;
  CrossEntropyLoss criterion;
  Tensor loss;
  double macs_per_sample = 0;
};

// What an engine of one replica on one device shares (the single-device engine, a DDP rank):
// its context, the model built on it from the options' seed, the step and the prefetcher.
class OneDeviceEngine : public TrainEngine {
 public:
  std::vector<Device> devices() const override { return {ctx_.device()}; }
  std::vector<DeviceContext*> contexts() override { return {&ctx_}; }
  bool prefetches() const override { return prefetcher_.active(); }
  void eval_batch(const Batch& batch, EvalSums& sums) override {
    evaluate_batch(ctx_, *model_, step_.criterion, batch, 0, batch.size(), sums);
  }
  void set_training(bool training) override { model_->set_training(training); }
  Model& model() override { return *model_; }
  DeviceContext& primary() override { return ctx_; }
  Optimizer& optimizer() override { return *step_.optimizer; }
  double forward_macs_per_sample() const override { return step_.macs_per_sample; }

 protected:
  OneDeviceEngine(std::unique_ptr<DeviceContext>&& ctx, std::string track, const EngineOptions& o);

  std::unique_ptr<DeviceContext> owned_ctx_;  // destroyed last: the members below use it
  DeviceContext& ctx_;
  std::string track_;
  PrimaryStep step_;
  BatchPrefetcher prefetcher_;
  std::unique_ptr<Model> model_;
};

}  // namespace replica
