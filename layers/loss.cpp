#include "layers/loss.h"

#include "engine/error.h"
#include "engine/ops.h"

namespace replica {

Tensor CrossEntropyLoss::forward(DeviceContext& ctx, const Tensor& logits, const Tensor& labels) {
  REPLICA_CHECK(logits.ndim() == 2 && labels.numel() == logits.dim(0),
                "cross-entropy: logits {} and {} labels", shape_str(logits.shape()),
                labels.numel());
  probs_ = ctx.alloc(logits.shape());
  logits_dtype_ = logits.dtype();
  labels_ = labels;
  Tensor loss = ctx.alloc({1});
  ctx.ops().cross_entropy_forward(ctx, logits, labels, probs_, loss);
  return loss;
}

Tensor CrossEntropyLoss::backward(DeviceContext& ctx, int64_t denominator) {
  REPLICA_CHECK(probs_.defined(), "cross-entropy backward without forward");
  int64_t n = denominator > 0 ? denominator : probs_.dim(0);
  Tensor dlogits = ctx.alloc(probs_.shape(), logits_dtype_);  // the logits' gradient: their dtype
  ctx.ops().cross_entropy_backward(ctx, probs_, labels_, 1.f / float(n), dlogits);
  probs_ = labels_ = Tensor();
  return dlogits;
}

}  // namespace replica
