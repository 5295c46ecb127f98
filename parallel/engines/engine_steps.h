// Pieces every engine shares: moving a host batch to a device, one evaluation batch, and what
// the step on the primary device keeps.
#pragma once
#include "engine/data/loader.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "layers/optimizer.h"

namespace replica {

// Host batches are used in place on CPU devices (zero copy) and copied on the stream for CUDA.
Tensor batch_to_device(DeviceContext& ctx, const Tensor& host);
// A part of `batch` (its images, labels or indices, or rows of them) on ctx's device; on a GPU
// the batch then knows the copy may still be reading its pinned buffer (Batch::copies).
Tensor batch_to_device(DeviceContext& ctx, const Batch& batch, const Tensor& part);

// Rows [begin, end) of the batch on ctx's device, images (F32) and/or labels (I32; the other
// part stays undefined): copied from the host batch, or gathered from the set ctx's memory
// holds (a batch with Batch::resident), whose indices then cross once for both parts.
struct DeviceBatch {
  Tensor images, labels;
};
enum class BatchParts { Images, Labels, Both };
DeviceBatch batch_rows(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
                       BatchParts parts);

// The whole batch, images and labels, on ctx's device: traced as "h2d" (copied from the host)
// or "batch_gather" (cut out of the set on the device) on `track`.
DeviceBatch whole_batch_to_device(DeviceContext& ctx, const Batch& batch,
                                  const std::string& track);

// Eval-mode forward of rows [begin, end) of `batch` on `model` (ctx's device): adds the summed
// loss and the number of correct predictions. Reads two numbers back (a host sync: evaluation
// only). The batch may come from the host or from a set held on the device.
void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Batch& batch, int64_t begin, int64_t end, double& loss_sum,
                    int64_t& correct);

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

}  // namespace replica
