// TrainLoop's evaluation after each epoch (train_loop.h): every process its shard of the test set,
// top-1 and top-5 accuracy and the loss summed across processes, and the best model kept.
#include "engine/trace.h"
#include "parallel/loop/train_loop.h"

namespace replica {

// Each process evaluates its interleaved shard (rank, rank+R, ...: no padding, so nothing is
// counted twice); the totals are summed across processes, so every rank reports the same.
// Evaluation runs in the training's batches (DDP ranks: their share of it), so every device sees
// the shapes of a training step: the caching allocator hands back the blocks training freed,
// and evaluating never needs more memory than a training step. (In larger batches, every
// activation size was new: ResNet-50 at 224x224 in batches of 256 took 12.9 GB of host memory
// on cpu*2, against 3.9 GB for training alone.)
void TrainLoop::evaluate() {
  TraceSpan span("host", "evaluate");
  engine_->set_training(false);
  const int64_t batch = std::max<int64_t>(1, c_.batch_size / world_);
  Loader loader(*test_, batch, false);
  std::vector<int64_t> shard;
  for (int64_t i = engine_->rank(); i < test_->size(); i += world_) shard.push_back(i);
  EvalSums sums;
  int64_t seen = 0;
  if (!shard.empty()) {
    loader.start_epoch(std::move(shard), 0);
    while (auto b = loader.next()) {
      engine_->eval_batch(*b, sums);
      seen += b->size();
    }
  }
  // Counts below 2^53 travel exactly as doubles.
  std::vector<double> totals = {sums.loss_sum, double(sums.top1), double(sums.top5), double(seen)};
  engine_->reduce_metrics(totals);
  engine_->set_training(true);
  const double n = totals[3];
  totals_.evaluated = true;
  totals_.test_loss = n ? totals[0] / n : 0.0;
  totals_.test_accuracy = n ? totals[1] / n : 0.0;
  totals_.test_top5 = n ? totals[2] / n : 0.0;
}

// PyTorch's ImageNet example keeps model_best beside its checkpoint: the weights of the epoch
// whose test accuracy (top-1) beats every earlier one's, resumed epochs included. Every rank
// keeps the same best (the accuracy is summed across ranks); the lead writes the file.
bool TrainLoop::keep_if_best(int64_t epoch) {
  if (totals_.test_accuracy <= pos_.best_accuracy) return false;
  pos_.best_accuracy = totals_.test_accuracy;
  pos_.best_epoch = epoch;
  if (!c_.save_best.empty() && report_->lead()) {
    TraceSpan span("host", "checkpoint");
    save_model_weights(c_.save_best, *engine_);
  }
  return true;
}

}  // namespace replica
