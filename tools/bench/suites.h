// The DP and DDP suites: one row per device count. DP runs in this process (a thread per
// device); DDP re-executes this program as hidden rank workers under replica-launch, one process
// per device, and collects rank 0's (and every rank's) measurements from files.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/bench/harness.h"
#include "tools/bench/rows.h"

namespace replica::bench {

struct SuiteOptions {
  RunOptions run;
  std::string device_spec;       // "cpu*2", "cuda", "cuda:0*4": the largest configuration
  std::vector<Device> devices;   // parse_devices(device_spec)
  std::vector<int> counts;       // device counts to measure (each uses the first n devices)
  std::string reduce = "root";   // DP
  std::string backend = "auto";  // DDP: auto | gloo | nccl
  std::string trace_dir;         // non-empty: a Chrome trace per configuration written here
  double timeout_s = 300;        // DDP: rendezvous, each collective, a launch without progress
  std::string self_exe;          // this program (DDP ranks re-execute it)
  nlohmann::json env;
  bool quiet = false;
};

// Runs `suites` ("dp", "ddp") for every device count in o.run.repeat ROUNDS: in each round every
// configuration in turn builds its engine(s), warms up and times one window, so load from
// outside hits every configuration alike instead of spoiling one. Appends one row per (suite,
// count), the median over rounds; trace files (last round) are named in each row's "trace".
void run_suites(const SuiteOptions& o, const std::vector<std::string>& suites,
                const ModelFacts& facts, std::vector<nlohmann::json>& rows);

// One configuration on the first n devices with `run` (its warm-up, windows, traced window):
// DP in this process (one measurement), DDP as n ranks (one measurement per rank).
std::vector<Measurement> measure_dp(const SuiteOptions& o, int n, const RunOptions& run);
std::vector<Measurement> measure_ddp(const SuiteOptions& o, int n, const RunOptions& run);

// The device DDP rank `rank` runs on: the list's rank-th, wrapping round.
Device rank_device(const SuiteOptions& o, int rank);

// The DDP backend for n ranks on these devices: "nccl" when each rank has a GPU of its own and
// NCCL is built, else "gloo" (unless o.backend names one).
std::string ddp_backend(const SuiteOptions& o, int n);

// Hidden worker entry points (one DDP rank; environment from replica-launch).
//   "ddp":       trains with the harness, writes OUT.rank<r>.json
//   "allreduce": a Gloo/NCCL all-reduce size sweep, rank 0 writes OUT.json
int run_rank_worker(const std::string& kind, const SuiteOptions& o, const std::string& out);

// Launches `n` ranks of this program as `worker_args` under replica-launch (found next to this
// program) on a free port; returns when all exit 0. Throws replica::Error with the ranks' error
// lines when one fails (replica-launch then stops the others), or when the ranks make no
// progress for timeout_s: progress is the launch itself, then every touch of `progress_path`
// (if given; the ranks touch it as they step), so long runs of big models are not cut short.
void launch_ranks(const SuiteOptions& o, int n, const std::vector<std::string>& worker_args,
                  const std::string& log_path, const std::string& progress_path = "");

// Touches `path` at most once a second (a DDP rank's heartbeat for launch_ranks).
class ProgressBeat {
 public:
  explicit ProgressBeat(std::string path) : path_(std::move(path)) {}
  void operator()();

 private:
  std::string path_;
  int64_t last_us_ = 0;
};

// The hidden worker's command-line arguments that reproduce `o` in a rank.
std::vector<std::string> worker_arguments(const SuiteOptions& o);

// A fresh directory under $TMPDIR for the ranks' result files, removed with its contents.
struct ScratchDir {
  std::string path;
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name) const { return path + "/" + name; }
};

}  // namespace replica::bench
