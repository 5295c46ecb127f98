// RunReport: what a training run tells its user and leaves behind. The opening lines, the
// progress line (rewritten in place on a terminal), a line per epoch, the closing table of every
// epoch with the phase breakdown and each device's (DDP: each rank's) peak memory, the metrics
// JSON, the merged Chrome trace and the saved model. Only the lead process (rank 0) prints and
// writes; gather_ranks() and write_rank_trace() are steps every process takes part in.
#pragma once
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/engines/train_engine.h"
#include "parallel/loop/run_summary.h"
#include "parallel/loop/trainer.h"

namespace replica {

// The run's first step allocates every buffer and warms the caches (on a GPU it also picks the
// convolution algorithms): in a 20-step run it weighed as much as five steady steps. When more
// steps follow in its epoch, the per-step figures (samples/s, phases, wall/step) leave it out
// and it is reported apart. Where the steady steps start:
struct FirstStep {
  bool excluded = false;
  double seconds = 0;
  int64_t samples = 0;
  PhaseTotals phases;  // the Tracer's totals when it had ended
};

// What the training loop counted, for the metrics.
struct RunTotals {
  int64_t steps = 0;           // optimizer steps in all: where the run stands
  int64_t steps_this_run = 0;  // after a resume, fewer
  int64_t samples = 0;         // trained in this run, over every rank
  double train_seconds = 0;
  float final_loss = std::nanf("");
  bool evaluated = false;
  double test_loss = 0, test_accuracy = 0, test_top5 = 0;
  double best_accuracy = -1;  // the best epoch's test accuracy (RunPosition), -1: none
  int64_t best_epoch = 0;
  int stop_signal = 0;  // the signal that stopped the run, or 0
  FirstStep first_step;
};

class RunReport {
 public:
  RunReport(const TrainConfig& config, TrainEngine& engine, std::string device_spec);

  bool lead() const { return lead_; }
  void say(const std::string& line) const;
  void progress(const std::string& line) const;  // a terminal: in place; a pipe: a line
  void end_progress() const;                     // after the last in-place progress line

  // An epoch's summary (as in the metrics' "epoch_summaries") and its line; `how` is "done",
  // "interrupted" or "ended (--max-steps)".
  void epoch_done(const nlohmann::json& summary, const char* how);
  // Top-5 accuracy is shown where the model has more than 5 classes (else every sample counts);
  // top5_note(a) is " (top-5 a)" then, else empty.
  bool shows_top5() const;
  std::string top5_note(double top5) const;
  void say_best_saved(double accuracy, int64_t epoch) const;  // --save-best wrote the model

  // Each device's peak memory (bytes in use and held) and what a forward kept for backward,
  // after training; DDP: every rank's, exactly (an integer all-gather: every rank calls it).
  void gather_ranks();
  // DDP traces: every rank writes its own file; the lead merges them once all have (call after
  // the ranks' last collective, before they part).
  void write_rank_trace() const;

  // The metrics JSON of the run.
  nlohmann::json metrics(const RunTotals& totals) const;
  // The lead's files (merged trace, model weights, metrics JSON) and closing lines.
  void finish(const RunTotals& totals, const nlohmann::json& metrics) const;

 private:
  const TrainConfig& c_;
  TrainEngine& engine_;
  std::string device_spec_;
  bool lead_, quiet_, tty_;
  int world_;
  nlohmann::json epochs_ = nlohmann::json::array();
  std::vector<std::string> device_names_;  // DP: each device; DDP: "rank R cpu:R" per rank
  // Per entry of device_names_: peak bytes in use, bytes held, bytes a forward kept.
  std::vector<int64_t> peaks_, held_, kept_;
};

}  // namespace replica
