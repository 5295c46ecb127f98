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

#include "job_helpers.h"

using test::kTrain;
using test::Interrupted;
using test::interrupt_and_resume;
using test::interrupt_when;
using test::read_json;

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

// A closed terminal or a dropped ssh session sends SIGHUP: it stops the run as Ctrl-C does,
// with the checkpoint written (it used to end the run without one).
TEST_CASE("SIGHUP stops like Ctrl-C: the step finishes, the checkpoint is written, exit 129") {
  test::TempDir tmp;
  Interrupted cut = interrupt_when(kTrain + " --devices cpu --synthetic --synthetic-size 4096 "
                                            "--batch-size 16 --log-every 1 --checkpoint " +
                                       tmp.str("ck"),
                                   tmp.str("log"), "step     5/256", SIGHUP);
  INFO(cut.output);
  CHECK(cut.exit_code == 128 + SIGHUP);
  REQUIRE(test::fs::exists(tmp.path / "ck" / "checkpoint.safetensors"));
  CHECK(std::stoll(replica::load_checkpoint(tmp.str("ck/checkpoint.safetensors"))
                       .metadata.at("step")) >= 5);
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

// Before training starts there is nothing to save: a signal ends the process at once. A rank
// waiting in the rendezvous for a peer used to sit out the whole --timeout.
TEST_CASE("a signal during the rendezvous ends the rank at once, not after --timeout") {
  const std::string rank0 = "env WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 "
                            "MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                            std::to_string(test::next_port()) + " " + kTrain +
                            " --mode ddp --devices cpu --synthetic --synthetic-size 64"
                            " --batch-size 8 --max-steps 2 --quiet --timeout 60";
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 never comes; SIGTERM (a background job of sh ignores SIGINT) after 2 s.
  auto r = test::run("sh -c '" + rank0 + " & pid=$!; sleep 2; kill -TERM $pid; wait $pid'", 90);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.output);
  CHECK(r.exit_code == 128 + SIGTERM);
  CHECK(took < 10);
}
