// Pieces every engine shares: moving a host batch to a device, and one evaluation batch.
#pragma once
#include "engine/data/loader.h"
#include "layers/loss.h"
#include "layers/model.h"

namespace replica {

// Host batches are used in place on CPU devices (zero copy) and copied on the stream for CUDA.
Tensor batch_to_device(DeviceContext& ctx, const Tensor& host);
// A part of `batch` (its images or labels, or rows of them) on ctx's device; on a GPU the batch
// then knows the copy may still be reading its pinned buffer (Batch::copies).
Tensor batch_to_device(DeviceContext& ctx, const Batch& batch, const Tensor& part);

// The whole batch, images and labels, on ctx's device: traced as "h2d" on `track`.
struct DeviceBatch {
  Tensor images, labels;
};
DeviceBatch whole_batch_to_device(DeviceContext& ctx, const Batch& batch,
                                  const std::string& track);

// Eval-mode forward of one batch on `model` (ctx's device): adds the summed loss and the number
// of correct predictions. Reads two numbers back (a host sync: evaluation only).
void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Tensor& images, const Tensor& labels, double& loss_sum,
                    int64_t& correct);

}  // namespace replica
