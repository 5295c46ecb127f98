// Starting DDP ranks of this program under replica-launch, with a deadline, and the arguments
// that carry the suite's options into each rank.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/error.h"
#include "engine/output_files.h"
#include "parallel/rendezvous/launcher.h"
#include "tools/bench/suites.h"

namespace replica::bench {

namespace {

// The lines of the ranks' output that say what went wrong (at most 4).
std::string error_lines(const std::string& log_path) {
  std::ifstream in(log_path);
  std::string line, out;
  int kept = 0;
  while (std::getline(in, line) && kept < 4) {
    if (line.find("error") == std::string::npos && line.rfind("replica-launch:", 0) != 0) continue;
    out += (out.empty() ? "" : "; ") + line;
    ++kept;
  }
  return out.empty() ? "no error message (see " + log_path + ")" : out;
}

}  // namespace

ScratchDir::ScratchDir()
    : path(make_temporary_directory("replica-bench-", "for the ranks' results")) {}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::vector<std::string> worker_arguments(const SuiteOptions& o) {
  std::vector<std::string> args = {
      "--model", o.run.model,
      "--input-shape", fmt::format("{}", fmt::join(o.run.input_shape, "x")),
      "--batch-per-device", std::to_string(o.run.batch_per_device),
      "--warmup", std::to_string(o.run.warmup),
      "--steps", std::to_string(o.run.steps),
      "--repeat", std::to_string(o.run.repeat),
      "--seed", std::to_string(o.run.seed),
      "--threads-per-device", std::to_string(o.run.threads_per_device),
      "--precision", precision_name(o.run.precision),
      "--memory-format", memory_format_name(o.run.channels_last),
      "--devices", o.device_spec,
      "--backend", o.backend,
      "--timeout", fmt::format("{}", o.timeout_s)};
  if (o.run.cudnn_benchmark) args.push_back("--cudnn-benchmark");
  // A window traced in this configuration only (--trace-steps 0 is no number a user may give).
  if (o.run.trace_steps > 0)
    args.insert(args.end(), {"--trace-steps", std::to_string(o.run.trace_steps)});
  return args;
}

void ProgressBeat::operator()() {
  const int64_t now = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  if (now - last_us_ < 1000000) return;
  last_us_ = now;
  const int fd = open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;  // a missed beat only shortens the patience of the watchdog
  futimens(fd, nullptr);
  close(fd);
}

void launch_ranks(const SuiteOptions& o, int n, const std::vector<std::string>& worker_args,
                  const std::string& log_path, const std::string& progress_path) {
  const std::string launcher =
      (std::filesystem::path(o.self_exe).parent_path() / "replica-launch").string();
  REPLICA_USAGE_CHECK(access(launcher.c_str(), X_OK) == 0,
                      "DDP needs replica-launch next to this program ({} is missing: build the "
                      "target replica-launch)",
                      launcher);
  std::vector<std::string> args = {launcher, "--nproc-per-node", std::to_string(n),
                                   "--master-addr", "127.0.0.1",
                                   "--master-port", std::to_string(pick_free_port()), "--",
                                   o.self_exe};
  args.insert(args.end(), worker_args.begin(), worker_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  const pid_t parent = getpid();
  const pid_t pid = fork();
  REPLICA_CHECK(pid >= 0, "fork: {}", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);  // Ctrl-C reaches this program only; the launcher dies with it (below)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    execv(launcher.c_str(), argv.data());
    std::fprintf(stderr, "replica-bench: error: cannot run %s: %s\n", launcher.c_str(),
                 std::strerror(errno));
    _exit(127);
  }

  using Clock = std::chrono::steady_clock;
  using FileClock = std::filesystem::file_time_type::clock;
  const auto patience = std::chrono::duration_cast<FileClock::duration>(
      std::chrono::duration<double>(o.timeout_s));
  auto last_progress = FileClock::now();
  int status = 0;
  bool timed_out = false;
  for (;;) {
    pid_t got = waitpid(pid, &status, WNOHANG);
    if (got == pid) break;
    if (got < 0 && errno != EINTR) throw Error(fmt::format("waitpid: {}", std::strerror(errno)));
    std::error_code ec;
    if (!progress_path.empty()) {
      const auto beat = std::filesystem::last_write_time(progress_path, ec);
      if (!ec && beat > last_progress) last_progress = beat;
    }
    if (FileClock::now() - last_progress >= patience && !timed_out) {
      timed_out = true;
      kill(pid, SIGTERM);  // the launcher stops its ranks
      const auto grace = Clock::now() + std::chrono::seconds(5);
      while (waitpid(pid, &status, WNOHANG) == 0 && Clock::now() < grace)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      kill(pid, SIGKILL);  // its ranks die with it (PR_SET_PDEATHSIG)
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (timed_out)
    throw Error(fmt::format("DDP on {} ranks made no progress for --timeout {} s; stopped them ({})",
                            n, o.timeout_s, error_lines(log_path)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw Error(fmt::format("DDP on {} ranks failed: {}", n, error_lines(log_path)));
}

}  // namespace replica::bench
