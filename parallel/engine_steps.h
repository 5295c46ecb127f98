// Pieces every engine shares: moving a host batch to a device, and one evaluation batch.
#pragma once
#include "layers/loss.h"
#include "layers/model.h"

namespace replica {

// Host batches are used in place on CPU devices (zero copy) and copied on the stream for CUDA.
Tensor batch_to_device(DeviceContext& ctx, const Tensor& host);

// Eval-mode forward of one batch on `model` (ctx's device): adds the summed loss and the number
// of correct predictions. Reads two numbers back (a host sync: evaluation only).
void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Tensor& images, const Tensor& labels, double& loss_sum,
                    int64_t& correct);

}  // namespace replica
