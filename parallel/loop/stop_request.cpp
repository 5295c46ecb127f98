#include "parallel/loop/stop_request.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iterator>
#include <vector>

#include "engine/output_files.h"
#include "engine/trace.h"
#include "parallel/engines/train_engine.h"

namespace replica {

namespace {

volatile sig_atomic_t g_signal = 0;
std::atomic<bool> g_installed{false};
// SIGHUP too: a closed terminal or a dropped ssh session (and replica-launch passing either on)
// would otherwise end a long run without the checkpoint a Ctrl-C writes.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_old[std::size(kStopSignals)];

void on_signal(int sig) {
  if (g_signal != 0) {  // the second signal: the default action, now
    remove_temporary_in_progress();  // a half-written checkpoint must not stay behind
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  g_signal = sig;
}

}  // namespace

StopRequest::StopRequest(bool on) {
  if (!on || g_installed.exchange(true)) return;
  installed_ = true;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and collectives carry on; the loop checks the flag
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    sigaction(kStopSignals[i], &sa, &g_old[i]);
}

StopRequest::~StopRequest() {
  if (!installed_) return;
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    sigaction(kStopSignals[i], &g_old[i], nullptr);
  g_installed = false;
}

int StopRequest::signal() { return g_signal; }

bool StopAgreement::after_step(TrainEngine& engine, int64_t steps_run) {
  if (engine.world_size() <= 1) return StopRequest::signal() != 0;
  if (steps_run == 1) t_first_ = Tracer::now_us();
  const bool calibrate = steps_run == kCalibrationSteps;
  if (!calibrate && steps_run % every_ != 0) return false;
  std::vector<double> v = {StopRequest::signal() ? 1.0 : 0.0, 0.0};
  if (calibrate && engine.rank() == 0) {
    const double step_s = (Tracer::now_us() - t_first_) / 1e6 / double(kCalibrationSteps - 1);
    v[1] = double(std::clamp<int64_t>(int64_t(std::ceil(kStopCheckSeconds / step_s)), 1, 1000));
  }
  engine.reduce_metrics(v);
  if (calibrate) every_ = std::max<int64_t>(1, int64_t(v[1]));
  return v[0] > 0;
}

}  // namespace replica
