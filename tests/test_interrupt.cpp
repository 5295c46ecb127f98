// Ctrl-C during training: the run stops after the step in progress, writes its checkpoint and
// exits 130; resumed, it ends bit-identical to a run that was never interrupted (DP in one
// process, and DDP started by replica-train itself, where the signal reaches only the
// launching process as a terminal's Ctrl-C would).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "engine/checkpoint.h"

namespace {

const std::string kTrain = test::bin("replica-train");

std::string read_text(const std::string& path) {
  auto bytes = test::file_bytes(path);
  return std::string(bytes.begin(), bytes.end());
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

struct Interrupted {
  int exit_code = -1;
  std::string output;
};

// Starts `command` (output to `log`), sends `sig` to it once `progress` shows up in its
// output, and waits for it to end.
Interrupted interrupt_when(const std::string& command, const std::string& log,
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

void interrupt_and_resume(const std::string& mode_flags, const std::string& progress) {
  test::TempDir tmp;
  // 2560 samples / batch 32 = 80 steps per epoch, 2 epochs: seconds of work, so the signal
  // lands mid-epoch.
  test::write_mnist_dir(tmp.path / "data", 2560, 256);
  const std::string common = kTrain + " " + mode_flags + " --data " + tmp.str("data") +
                             " --batch-size 32 --epochs 2 --deterministic --log-every 1 --seed 3";

  auto full = test::run(common + " --quiet --checkpoint " + tmp.str("full") + " --metrics-json " +
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

  auto rest = test::run(common + " --quiet --resume --checkpoint " + tmp.str("cut") +
                        " --metrics-json " + tmp.str("rest.json"), 300);
  REQUIRE_MESSAGE(rest.exit_code == 0, rest.output);
  test::check_same_checkpoint(tmp.str("full/checkpoint.safetensors"),
                        tmp.str("cut/checkpoint.safetensors"));
  const auto a = read_json(tmp.str("full.json")), b = read_json(tmp.str("rest.json"));
  CHECK(a["steps"] == b["steps"]);
  CHECK(a["final_loss"] == b["final_loss"]);
  CHECK(a["test_loss"] == b["test_loss"]);
  CHECK(a["test_accuracy"] == b["test_accuracy"]);
}

}  // namespace

TEST_CASE("Ctrl-C in a DP run: checkpoint, exit 130, resume ends bit-identical") {
  interrupt_and_resume("--mode dp --devices cpu*2 --threads-per-device 1", "step    20/80");
}

TEST_CASE("Ctrl-C in a self-launched DDP run: every rank stops after the same step") {
  // Before step 10 the ranks agree on every step, later every K steps: interrupt after both.
  for (const char* when : {"step     3/80", "step    30/80"}) {
    CAPTURE(when);
    interrupt_and_resume("--mode ddp --devices cpu*2 --threads-per-device 1", when);
  }
}

TEST_CASE("Ctrl-C without --checkpoint stops cleanly and says nothing was saved") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 2560, 64);
  Interrupted cut = interrupt_when(kTrain + " --devices cpu*2 --data " + tmp.str("data") +
                                       " --epochs 3 --log-every 1",
                                   tmp.str("log"), "step    10/80");
  INFO(cut.output);
  CHECK(cut.exit_code == 130);
  CHECK(cut.output.find("no --checkpoint DIR: nothing saved") != std::string::npos);
}

TEST_CASE("SIGKILL mid-epoch: the last epoch's checkpoint is intact and resuming ends the same") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 2560, 256);
  const std::string common = kTrain + " --devices cpu*2 --threads-per-device 1 --data " +
                             tmp.str("data") +
                             " --batch-size 32 --epochs 2 --deterministic --log-every 1 --seed 4";
  auto full = test::run(common + " --quiet --metrics-json " + tmp.str("full.json"), 300);
  REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  // Killed without warning in epoch 2: only epoch 1's checkpoint exists.
  Interrupted cut = interrupt_when(common + " --checkpoint " + tmp.str("ck"), tmp.str("log"),
                                   "epoch 2/2  step    20/80", SIGKILL);
  INFO(cut.output);
  REQUIRE(cut.exit_code == 128 + SIGKILL);
  auto ck = replica::load_checkpoint(tmp.str("ck/checkpoint.safetensors"));
  CHECK(ck.metadata.at("step") == "80");
  auto rest = test::run(common + " --quiet --resume --checkpoint " + tmp.str("ck") +
                        " --metrics-json " + tmp.str("rest.json"), 300);
  REQUIRE_MESSAGE(rest.exit_code == 0, rest.output);
  const auto a = read_json(tmp.str("full.json")), b = read_json(tmp.str("rest.json"));
  CHECK(a["final_loss"] == b["final_loss"]);
  CHECK(a["test_loss"] == b["test_loss"]);
  CHECK(a["test_accuracy"] == b["test_accuracy"]);
}
