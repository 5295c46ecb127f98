// replica-dp-vs-ddp: the tutorials' claim "DDP is faster than DP, even on one machine", measured.
// Runs replica-train twice with the same model, data, seed, global batch and devices, once as
// DP (one process, a thread per device) and once as DDP (a process per device), and prints the
// two side by side: throughput, accuracy, where each step's time went, bytes communicated and
// each device's peak memory.
//   replica-dp-vs-ddp                                 CNN, Fashion-MNIST, 400 steps, all devices
//   replica-dp-vs-ddp --devices cpu*4 --steps 200 -- --model resnet18 --batch-size 64
// Flags after -- go to both replica-train runs unchanged; those that would make the runs clash
// (an output, --resume) are refused (check_runs_apart).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/program.h"

#include "engine/error.h"
#include "engine/output_files.h"
#include "parallel/loop/trainer.h"
#include "parallel/rendezvous/launcher.h"
#include "samples/dp_vs_ddp_table.h"
#include "samples/train_presets.h"

using namespace replica;
namespace fs = std::filesystem;

namespace {

// A stop signal (SIGINT, SIGTERM, SIGHUP) ends the comparison between runs, not the process at
// once: the run in progress stops, and the temporary folder of the runs' logs is removed as on
// any other way out (it stayed behind). A Ctrl-C reaches the run too (it is in the terminal's
// process group); a signal sent to this process alone is passed on to the run. A signal the
// program was started with ignored (nohup's SIGHUP) stays ignored, here and in the runs.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr size_t kStops = std::size(kStopSignals);
struct sigaction g_found[kStops];  // the dispositions the program started with, for the runs
volatile sig_atomic_t g_stop_signal = 0;
volatile pid_t g_run_pid = 0;

void on_stop_signal(int sig, siginfo_t* info, void*) {
  const int saved_errno = errno;
  if (g_stop_signal == 0) g_stop_signal = sig;
  const bool sent_by_a_process = info != nullptr && info->si_code <= 0;  // kill(), not a terminal
  if (sent_by_a_process && g_run_pid > 0) kill(g_run_pid, sig);
  errno = saved_errno;
}

struct StopSignals {
  StopSignals() {
    struct sigaction sa {};
    sa.sa_sigaction = on_stop_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < kStops; ++i) {
      sigaction(kStopSignals[i], nullptr, &g_found[i]);
      if (g_found[i].sa_handler != SIG_IGN) sigaction(kStopSignals[i], &sa, nullptr);
    }
  }
  ~StopSignals() { restore(); }
  // Async-signal-safe: also in a run's process between fork() and exec().
  static void restore() {
    for (size_t i = 0; i < kStops; ++i) sigaction(kStopSignals[i], &g_found[i], nullptr);
  }
};

// Runs `program args` with its output in `log`; returns its exit status and what it printed.
// The stop signals are held back while the run is started, so that one arriving then is either
// seen before the fork (no run is started) or passed on to a run that has its pid known and the
// dispositions the program started with (before, the run's process could take it in this
// program's handler, before exec, and lose it).
std::pair<int, std::string> run_child(const std::string& program,
                                      const std::vector<std::string>& args,
                                      const std::string& log) {
  std::vector<std::string> argv_s = {program};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  sigset_t stops, before;
  sigemptyset(&stops);
  for (int sig : kStopSignals) sigaddset(&stops, sig);
  sigprocmask(SIG_BLOCK, &stops, &before);
  if (g_stop_signal != 0) {
    sigprocmask(SIG_SETMASK, &before, nullptr);
    return {128 + g_stop_signal, ""};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    StopSignals::restore();
    sigprocmask(SIG_SETMASK, &before, nullptr);
    FILE* out = std::freopen(log.c_str(), "w", stdout);
    if (out) dup2(fileno(stdout), STDERR_FILENO);
    execv(program.c_str(), argv.data());
    _exit(127);
  }
  if (pid > 0) g_run_pid = pid;
  sigprocmask(SIG_SETMASK, &before, nullptr);
  REPLICA_CHECK(pid > 0, "fork failed");
  // The pid is forgotten before the run is reaped: a signal after that must not be passed on
  // to another process that has been given the same pid.
  siginfo_t ended{};
  while (waitid(P_PID, id_t(pid), &ended, WEXITED | WNOWAIT) < 0 && errno == EINTR) {}
  g_run_pid = 0;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
}

// "replica-train --mode dp": which run `args` start, for messages.
std::string run_name(const std::vector<std::string>& args) {
  return "replica-train " + args[0] + " " + args[1];
}

std::string last_line(const std::string& text) {
  std::string last = text.substr(text.find_last_of('\n', text.size() - 2) + 1);
  while (!last.empty() && last.back() == '\n') last.pop_back();
  return last;
}

// replica-train's own check of a run's flags (--print-config parses, validates and exits), so a
// mistyped flag after -- is refused at once, before minutes of the first run.
void check_train_flags(const std::string& program, std::vector<std::string> args,
                       const std::string& log) {
  args.push_back("--print-config");
  const auto [code, text] = run_child(program, args, log);
  if (g_stop_signal != 0) return;  // run_both says so
  if (code == 2) {  // its one-line usage error, said as this program's
    std::string line = last_line(text);
    const std::string own = "replica-train: error: ";
    if (line.rfind(own, 0) == 0) line = line.substr(own.size());
    // A flag neither program has, one edit from a flag only this program has: --step for
    // --steps (--devices is replica-train's too, and its hint says so already).
    if (line.rfind("unknown flag ", 0) == 0) {
      const std::string flag = line.substr(13, line.find(' ', 13) - 13);
      for (const char* mine : {"--steps", "--keep-logs"})
        if (flag_distance(flag, mine) <= 1)
          throw UsageError(fmt::format("unknown flag {} (did you mean {}?) (see --help)", flag,
                                       mine));
    }
    throw UsageError("for replica-train: " + line);
  }
  REPLICA_CHECK(code == 0, "{} --print-config failed: {}", run_name(args), last_line(text));
}

// Runs replica-train with `args`; its own output goes to `log`. Returns its metrics, or nothing
// when a stop signal ended it.
std::optional<nlohmann::json> run_train(const std::string& program, std::vector<std::string> args,
                                        const std::string& log, const std::string& metrics) {
  args.insert(args.end(), {"--metrics-json", metrics});
  const auto [code, text] = run_child(program, args, log);
  if (g_stop_signal != 0) return std::nullopt;
  if (code != 0)
    throw Error(fmt::format("{} failed: {}", run_name(args), last_line(text)));
  std::ifstream m(metrics);
  try {
    return nlohmann::json::parse(m);
  } catch (const nlohmann::json::exception&) {
    throw Error(fmt::format("{} exited 0 but wrote no metrics to {}", run_name(args), metrics));
  }
}

// The two runs go one after the other with the same flags, so a file that one writes the other
// writes too: the DDP run's --checkpoint, --save-model, --save-best or --trace replaced the DP
// run's, and with --resume the DDP run went on from the checkpoint the DP run had just written
// and trained nothing. Every flag that makes the runs clash so is refused, a preset that sets
// an output as well (seed's --save-model, imagenet's --checkpoint and --save-best), rather
// than only the outputs typed, or each run given a file of its own: the comparison is this
// program's output, and a run's files are replica-train's, written under the names the user
// chose (replica-train --mode dp, then --mode ddp, with the same flags). `value` is what
// follows the flag.
void check_runs_apart(const std::string& flag, const std::string& value) {
  for (const char* output : {"--checkpoint", "--save-model", "--save-best", "--trace"})
    REPLICA_USAGE_CHECK(flag != output,
                        "{} would be written by both runs, the DDP run's over the DP run's: for "
                        "a run's files, run replica-train --mode dp or --mode ddp with the same "
                        "flags",
                        flag);
  REPLICA_USAGE_CHECK(flag != "--resume",
                      "--resume would resume both runs from one checkpoint, the DDP run from the "
                      "one the DP run has just written (training nothing): run replica-train "
                      "--mode dp or --mode ddp to resume");
  if (flag != "--preset" || value.empty()) return;  // no value: replica-train's check says so
  TrainConfig recipe;
  apply_preset(value, recipe);
  const std::pair<const char*, std::string> outputs[] = {{"--checkpoint", recipe.checkpoint_dir},
                                                         {"--save-model", recipe.save_model},
                                                         {"--save-best", recipe.save_best}};
  for (const auto& [output, path] : outputs)
    REPLICA_USAGE_CHECK(path.empty(),
                        "--preset {} sets {} {}, which both runs would write, the DDP run's "
                        "over the DP run's: give the recipe's other flags without --preset "
                        "(replica-train --preset {} --print-config lists them)",
                        value, output, path, value);
}

// `args` without the flags (and their values) that `mode` does not read (mode_flags()).
std::vector<std::string> for_mode(const std::vector<std::string>& args, const std::string& mode) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string name = args[i].substr(0, args[i].find('='));
    const auto f = std::find_if(mode_flags().begin(), mode_flags().end(),
                                [&](const ModeFlag& m) { return m.flag == name; });
    if (f == mode_flags().end() || std::count(f->modes.begin(), f->modes.end(), mode)) {
      out.push_back(args[i]);
    } else if (name == args[i]) {
      ++i;  // "--flag value": the value goes too
    }
  }
  return out;
}

// The flags after --: those this program sets for both runs, those that would make a run print
// instead of train, and those that would make the two runs clash are each refused by name
// rather than met as a failed run or a wrong table.
void check_extra_flags(const std::vector<std::string>& extra) {
  for (size_t i = 0; i < extra.size(); ++i) {
    const std::string flag = extra[i].substr(0, extra[i].find('='));
    if (flag == "--max-steps")
      throw UsageError("--max-steps is set by replica-dp-vs-ddp itself: give --steps N before --");
    for (const char* own : {"--mode", "--metrics-json"})
      REPLICA_USAGE_CHECK(flag != own, "{} is set by replica-dp-vs-ddp itself", flag);
    for (const char* prints : {"--print-config", "--list-devices", "--help", "-h"})
      REPLICA_USAGE_CHECK(flag != prints,
                          "{} makes replica-train print instead of train: run replica-train {} "
                          "itself",
                          flag, flag);
    const bool joined = flag != extra[i];  // "--flag=value"
    check_runs_apart(flag, joined                  ? extra[i].substr(flag.size() + 1)
                           : i + 1 < extra.size() ? extra[i + 1]
                                                  : "");
  }
}

// The runs' flags checked, then the runs, one after the other, their output in dir; nothing when
// a stop signal ended one.
std::optional<std::vector<RunMetrics>> run_both(const std::string& train,
                                                const std::vector<std::vector<std::string>>& runs,
                                                const std::string& dir) {
  for (const auto& args : runs) {
    check_train_flags(train, args, dir + "/" + args[1] + ".log");
    if (g_stop_signal != 0) return std::nullopt;
  }
  std::vector<RunMetrics> m;
  for (const auto& args : runs) {
    std::printf("running %s ...\n", run_name(args).c_str());
    std::fflush(stdout);
    const auto metrics = run_train(train, args, dir + "/" + args[1] + ".log",
                                   dir + "/" + args[1] + ".json");
    if (!metrics) return std::nullopt;
    m.push_back({args[1] == "dp" ? "DP" : "DDP", *metrics});
  }
  return m;
}

// Where the runs' logs and metrics go: ./dp-vs-ddp/ to keep, else a temporary folder.
std::string logs_directory(bool keep_logs) {
  const std::string dir = "dp-vs-ddp";
  if (!keep_logs) return make_temporary_directory("replica-dp-vs-ddp-", "for the runs' logs");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error(fmt::format("cannot make ./{} for the runs' logs (--keep-logs): {}", dir,
                            fs::exists(fs::symlink_status(dir)) && !fs::is_directory(dir)
                                ? "a file of that name is in the way"
                                : ec.message()));
  return dir;
}

int run(int argc, char** argv) {
  std::string devices;
  int64_t steps = 400;
  bool keep_logs = false;
  CLI::App app{
      "replica-dp-vs-ddp: DP and DDP on the same model, data, seed, batch and devices, side by "
      "side. Flags after -- go to both replica-train runs: replica-dp-vs-ddp [OPTIONS] [-- "
      "REPLICA-TRAIN FLAGS...]",
      "replica-dp-vs-ddp"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.add_option("--devices", devices, "device string for both runs (default: replica-train's)");
  app.add_option("--steps", steps,
                 "optimizer steps per run (fewer where its epochs end first: -- --epochs N)")
      ->capture_default_str();
  app.add_flag("--keep-logs", keep_logs, "keep both runs' output and metrics in ./dp-vs-ddp/");
  app.allow_extras();
  if (auto code = parse_cli(app, argc, argv)) return *code;
  std::vector<std::string> extra = app.remaining();
  if (!extra.empty() && extra.front() == "--") extra.erase(extra.begin());
  REPLICA_USAGE_CHECK(extra.empty() || extra.front().rfind("--", 0) == 0,
                      "unexpected argument '{}' (replica-train flags go after --)", extra.front());
  check_extra_flags(extra);
  REPLICA_USAGE_CHECK(steps >= 1, "--steps must be at least 1, got {}", steps);

  const std::string train = (fs::path(current_executable()).parent_path() / "replica-train").string();
  REPLICA_USAGE_CHECK(fs::exists(train), "replica-train not found next to this program ({})",
                      train);
  const StopSignals stop_signals;  // from here the runs' logs have a folder to remove
  const std::string dir = logs_directory(keep_logs);
  struct RemoveUnlessKept {  // also when a run fails: its error is in the message
    std::string dir;
    bool keep;
    ~RemoveUnlessKept() {
      std::error_code ec;
      if (!keep) fs::remove_all(dir, ec);
    }
  } logs{dir, keep_logs};
  std::vector<std::string> common = {"--max-steps", std::to_string(steps), "--seed", "0"};
  if (!devices.empty()) common.insert(common.end(), {"--devices", devices});
  common.insert(common.end(), extra.begin(), extra.end());

  std::vector<std::vector<std::string>> runs;
  for (const char* mode : {"dp", "ddp"}) {
    std::vector<std::string> args = {"--mode", mode};
    args.insert(args.end(), common.begin(), common.end());
    runs.push_back(for_mode(args, mode));  // --reduce to DP, --backend/--timeout/... to DDP
  }
  const std::optional<std::vector<RunMetrics>> m = run_both(train, runs, dir);
  if (!m) {
    std::fprintf(stderr, "replica-dp-vs-ddp: stopped by %s: the runs were not compared\n",
                 signal_name(g_stop_signal).c_str());
    return 128 + g_stop_signal;
  }
  std::fputs(comparison((*m)[0], (*m)[1], steps).c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-dp-vs-ddp", [&] { return run(argc, argv); });
}
