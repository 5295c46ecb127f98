// TrainLoop: the epochs of one training run over any engine (single, DP, DDP). It owns the data,
// the loader and the DistributedSampler's share, the position (resumed from a checkpoint), the
// learning-rate schedule, the stop agreement (Ctrl-C: every rank stops after the same step),
// evaluation after each epoch and the checkpoints; what it tells the user goes through its
// RunReport. run_training() (trainer.h) is TrainLoop(config).run().
#pragma once
#include <memory>

#include <nlohmann/json.hpp>

#include "engine/data/dataset.h"
#include "engine/data/loader.h"
#include "engine/data/resident_dataset.h"
#include "parallel/loop/checkpointing.h"
#include "parallel/loop/distributed_sampler.h"
#include "parallel/loop/run_report.h"
#include "parallel/loop/stop_request.h"
#include "parallel/loop/trainer.h"

namespace replica {

class TrainLoop {
 public:
  // Opens the data, builds the engine and, with --resume, restores the checkpoint, for a config
  // that passed validate(). Errors are thrown (UsageError for bad input).
  explicit TrainLoop(const TrainConfig& config);
  ~TrainLoop();
  // Trains until the last epoch, --max-steps or a stop request; returns the metrics.
  nlohmann::json run();

 private:
  void agree_on_settings();
  void place_data();
  void resume();
  // Where the run stood at an instant: the per-step figures are differences of two of them.
  struct Mark {
    int64_t t_us = 0;
    PhaseTotals phases;
    int64_t samples = 0, steps = 0;
  };
  Mark mark() const;
  void run_epoch(int64_t epoch);
  // Trains the epoch's batches from `first`; returns the position reached in the epoch. `steady`
  // moves past the run's first step when that step is this epoch's and more follow.
  int64_t train_batches(int64_t epoch, int64_t first, const Mark& start, Mark& steady);
  nlohmann::json epoch_summary(int64_t epoch, bool complete, const Mark& start,
                               const Mark& steady) const;
  void log_step(int64_t epoch, int64_t batch, bool last_step);
  void write_checkpoint();
  // What a checkpoint of this run records of it, and a resumed run must match.
  RunIdentity run_identity() const;
  // Evaluation (evaluation.cpp): the test set's loss and accuracy into totals_; then whether the
  // epoch (1-based) is the best so far (pos_ then holds it, and --save-best's file its weights).
  void evaluate();
  bool keep_if_best(int64_t epoch);

  TrainConfig c_;
  LrSchedule lr_schedule_;  // c_.lr_schedule, read once
  std::unique_ptr<Dataset> train_, test_;
  std::unique_ptr<TrainEngine> engine_;
  std::unique_ptr<RunReport> report_;
  // Set when the training set lives on the devices; destroyed before the engine whose contexts
  // hold its memory, after the loader whose batches point to it.
  std::unique_ptr<ResidentDataset> resident_;
  std::unique_ptr<Loader> loader_;
  std::unique_ptr<DistributedSampler> sampler_;
  int world_ = 1;
  int64_t per_epoch_ = 0;
  int64_t epochs_steps_ = 0;   // the steps of all --epochs (saturated at int64's largest)
  int64_t planned_steps_ = 0;  // the run's steps: epochs_steps_, or --max-steps if fewer
  RunPosition pos_;
  RunTotals totals_;
  StopAgreement stop_agreement_;
  int64_t t_start_us_ = 0;
  bool stop_ = false;
  bool look_ahead_ = false;  // the engine copies each batch a step ahead (host data, GPUs)
};

}  // namespace replica
