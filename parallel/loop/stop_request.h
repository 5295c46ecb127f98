// Ctrl-C (SIGINT), SIGTERM and SIGHUP during training: the first signal asks the training loop
// to stop after the step in progress (it then writes a checkpoint and exits 128 + signal); a second
// one removes the temporary file being written, if any (engine/output_files.h), restores the
// default action and re-raises it, which ends the process at once. Under DDP the ranks agree
// on the step after which they all stop (StopAgreement).
#pragma once
#include <cstdint>

namespace replica {

class TrainEngine;  // parallel/engines/train_engine.h

// While one lives (and `on`), SIGINT, SIGTERM and SIGHUP ask to stop; the handlers that were
// there before come back however the scope ends.
class StopRequest {
 public:
  explicit StopRequest(bool on);
  ~StopRequest();
  StopRequest(const StopRequest&) = delete;
  StopRequest& operator=(const StopRequest&) = delete;
  // The signal that asked to stop, or 0.
  static int signal();

 private:
  bool installed_ = false;
};

// Whether to stop after this step: this process got a stop signal, or (DDP) any rank did.
// The ranks must stop after the same step (the checkpoint holds a position every rank reached),
// so they agree through a small all-reduce. That all-reduce is a synchronisation point: every
// step it cost 12% of a 2-rank CNN step on 2 cores. So the ranks agree every step only for the
// first steps, time them, and then every K steps with K (rank 0's choice, shared through the
// same all-reduce) making the interval about kStopCheckSeconds: < 1% of the time, and a stop
// that lands within a fraction of a second.
class StopAgreement {
 public:
  static constexpr double kStopCheckSeconds = 0.25;
  static constexpr int64_t kCalibrationSteps = 10;
  bool after_step(TrainEngine& engine, int64_t steps_run);

 private:
  int64_t every_ = 1;
  int64_t t_first_ = 0;
};

}  // namespace replica
