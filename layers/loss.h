// Cross-entropy over logits (log-softmax + NLL, mean over the batch), as nn.CrossEntropyLoss.
#pragma once
#include "engine/context.h"

namespace replica {

class CrossEntropyLoss {
 public:
  // Returns the mean loss as a device tensor [1]; reading it is a host sync the caller chooses.
  Tensor forward(DeviceContext& ctx, const Tensor& logits, const Tensor& labels);
  // Gradient of (loss * N / denominator) w.r.t. the logits: with denominator = N (default)
  // the gradient of the mean; DP uses the global batch size when the loss covers a part.
  Tensor backward(DeviceContext& ctx, int64_t denominator = 0);

 private:
  Tensor probs_, labels_;
  DType logits_dtype_ = DType::F32;
};

}  // namespace replica
