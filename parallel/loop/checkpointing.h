// Saving and restoring a training run: the primary replica's parameters and buffers, the
// optimizer state and the loop position, as one safetensors-compatible file.
#pragma once
#include <string>

#include "parallel/engines/train_engine.h"

namespace replica {

struct RunPosition {
  int64_t epoch = 0;          // epoch in progress (0-based)
  int64_t batch_in_epoch = 0; // batches of that epoch already trained
  int64_t global_step = 0;    // optimizer steps so far
  // The best test accuracy (top-1) of the epochs evaluated so far, and its epoch (1-based);
  // -1 and 0 before any: what --save-best compares against, a resumed run included.
  double best_accuracy = -1;
  int64_t best_epoch = 0;
  // The precision the steps so far were trained in ("fp32", "tf32", "bf16"); empty when a
  // checkpoint does not say. Master weights are fp32 in all three, so a run may resume in another.
  std::string precision;
};

std::string checkpoint_path(const std::string& dir);  // dir/checkpoint.safetensors

// What a resumed run must share with the run that wrote the checkpoint, beyond the model: the
// order of the samples (the seed, and the data: its size and drop_last decide each epoch's
// batches) and the batch, so that the saved position points at the same next batch.
struct RunIdentity {
  uint64_t seed = 0;
  int64_t batch_size = 0;
  std::string data;  // "synthetic, 512 samples", "60000 samples, drop_last", ...
  // Batches in one of this run's epochs (not saved: it follows from the above): the saved
  // position must fall inside an epoch, and its step count must be the batches before it.
  int64_t batches_per_epoch = 0;
};

// Writes atomically (never a half-written file). Tensors: "model.<param>", "buffer.<name>",
// "optim.<state>"; metadata: format, model, optimizer, seed, batch_size, data, epoch,
// batch_in_epoch, step, precision and, once an epoch was evaluated, best_accuracy and best_epoch.
void save_training_checkpoint(const std::string& dir, TrainEngine& engine, const RunPosition& pos,
                              const RunIdentity& run);

// Restores into the engine (then engine.state_loaded()) and returns the position. Errors if the
// checkpoint belongs to another model, optimizer, seed, batch size or data (checkpoints written
// before the data was recorded are taken on trust), or if its position does not add up (a step
// count that is not the batches before it, the optimizer's steps another count): resumed, such
// a position trained nothing, or Adam's bias correction went on from the wrong step.
RunPosition load_training_checkpoint(const std::string& dir, TrainEngine& engine,
                                     const RunIdentity& run);

// The trained model alone, as PyTorch's state_dict would hold it: parameters and buffers under
// their torchvision names (e.g. "layer1.0.conv1.weight"), written atomically. Loads with
// safetensors.torch.load_file() into model.load_state_dict().
void save_model_weights(const std::string& path, TrainEngine& engine);

}  // namespace replica
