// Running training jobs from tests: runs interrupted by a signal and resumed, DDP jobs with a
// fault injected into one rank, and the parameters a checkpoint holds. Shared by the CPU suites
// (Gloo) and the GPU ones (NCCL), which run the same jobs with other device flags.
#pragma once
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "engine/checkpoint.h"

namespace test {

inline const std::string& train_bin() {
  static const std::string path = bin("replica-train");
  return path;
}

struct Interrupted {
  int exit_code = -1;
  std::string output;
};

// Starts `command` (output to `log`), sends `sig` to it once `progress` shows up in its
// output, and waits for it to end.
inline Interrupted interrupt_when(const std::string& command, const std::string& log,
                                  const std::string& progress, int sig = SIGINT) {
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);  // its own group: the test's Ctrl-C never reaches the test runner
    std::string full = "exec " + command + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  Interrupted r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool sent = false;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      r.output = read_text(log);
      if (!sent) r.output += "\n(the run ended before it was interrupted)";
      return r;
    }
    if (!sent && read_text(log).find(progress) != std::string::npos) {
      kill(pid, sig);
      sent = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  r.output = read_text(log) + "\n(timed out)";
  return r;
}

inline void interrupt_and_resume(const std::string& mode_flags, const std::string& progress) {
  TempDir tmp;
  // 2560 samples / batch 32 = 80 steps per epoch, 2 epochs: seconds of work, so the signal
  // lands mid-epoch.
  write_mnist_dir(tmp.path / "data", 2560, 256);
  const std::string common = train_bin() + " " + mode_flags + " --data " + tmp.str("data") +
                             " --batch-size 32 --epochs 2 --deterministic --log-every 1 --seed 3";

  auto full = run(common + " --quiet --checkpoint " + tmp.str("full") + " --metrics-json " +
                        tmp.str("full.json"), 300);
  REQUIRE_MESSAGE(full.exit_code == 0, full.output);

  Interrupted cut = interrupt_when(common + " --checkpoint " + tmp.str("cut") +
                                       " --metrics-json " + tmp.str("cut.json"),
                                   tmp.str("cut.log"), progress);
  INFO(cut.output);
  REQUIRE(cut.exit_code == 130);
  CHECK(cut.output.find("interrupted: stopped after step") != std::string::npos);
  const auto cut_metrics = read_json(tmp.str("cut.json"));
  CHECK(cut_metrics["interrupted"] == true);
  const int64_t stopped_at = cut_metrics["steps"];
  CHECK(stopped_at > 0);
  CHECK(stopped_at < 160);
  auto ck = replica::load_checkpoint(tmp.str("cut/checkpoint.safetensors"));
  CHECK(ck.metadata.at("step") == std::to_string(stopped_at));
  CHECK(std::stoll(ck.metadata.at("batch_in_epoch")) == stopped_at % 80);

  auto rest = run(common + " --quiet --resume --checkpoint " + tmp.str("cut") +
                        " --metrics-json " + tmp.str("rest.json"), 300);
  REQUIRE_MESSAGE(rest.exit_code == 0, rest.output);
  check_same_checkpoint(tmp.str("full/checkpoint.safetensors"),
                        tmp.str("cut/checkpoint.safetensors"));
  const auto a = read_json(tmp.str("full.json")), b = read_json(tmp.str("rest.json"));
  CHECK(a["steps"] == b["steps"]);
  CHECK(a["final_loss"] == b["final_loss"]);
  CHECK(a["test_loss"] == b["test_loss"]);
  CHECK(a["test_accuracy"] == b["test_accuracy"]);
}

struct Timed {
  RunResult r;
  double seconds = 0;
};

// A DDP training job of `ranks` ranks; `after_s` seconds in, `signal` goes to rank `victim`
// (found by a marker in its command line and RANK in its environment). `device_flags` say
// where the ranks run (CPU devices with Gloo by default). The marker is the path of a file the
// ranks write, given to `marker_flag`: --trace (then every span waits for its device too) or
// --metrics-json (the untraced run).
inline Timed fault_job(int ranks, int victim, const char* signal, int after_s, int timeout_s,
                       const std::string& device_flags = " --threads-per-device 1",
                       const std::string& marker_flag = "--trace") {
  TempDir tmp;
  const std::string marker = tmp.str("marker");  // unique text in the ranks' command line
  // "[-]-trace M" matches the ranks' "--trace M" but not this pattern's own command line.
  const std::string pattern = "'[-]" + marker_flag.substr(1) + " " + marker + "'";
  const std::string job = launch(ranks) + train_bin() + " --mode ddp --synthetic" +
                          " --synthetic-size 100000 --model cnn --batch-size " +
                          std::to_string(8 * ranks) + " --epochs 1 --quiet --no-eval" +
                          device_flags + " --timeout " + std::to_string(timeout_s) + " " +
                          marker_flag + " " + marker;
  {
    std::ofstream script(tmp.path / "job.sh");
    script << "( sleep " << after_s << "; for p in $(pgrep -f " << pattern << "); do\n"
           << "  if tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=" << victim
           << "; then kill -" << signal << " $p; fi\n"
           << "done ) &\n"
           << job << "\nrc=$?\nwait\nexit $rc\n";
  }
  const auto start = std::chrono::steady_clock::now();
  Timed t;
  t.r = run("sh " + tmp.str("job.sh"), 180);
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto left = run("pgrep -f " + pattern + " || true");
  INFO("processes left: " << left.output);
  CHECK(left.output.empty());
  return t;
}

// The model parameters a checkpoint holds, in order.
inline std::vector<float> checkpoint_params(const std::string& checkpoint) {
  auto c = replica::load_checkpoint(checkpoint);
  std::vector<float> out;
  for (const auto& [name, t] : c.tensors)
    if (name.rfind("model.", 0) == 0) out.insert(out.end(), t.f32(), t.f32() + t.numel());
  return out;
}

inline double max_relative(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(a[i])));
  }
  return diff / scale;
}


}  // namespace test
