// DDP faults under replica-launch (Gloo on CPU): each ends in a clear error, within its timeout,
// naming the rank at fault, with no process left behind. A killed rank; a stopped (SIGSTOP)
// rank, which the others' heartbeat check names although it is they that time out; the store's
// host stopped; a missing rank at rendezvous; a peer that never joins Gloo's connect; an error
// every rank hits, printed once.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>

#include "engine/context.h"
#include "job_helpers.h"
#include "parallel/comm/peer_monitor.h"
#include "parallel/comm/process_group.h"
#include "parallel/rendezvous/store.h"

using test::kTrain;
using test::launch;
using test::run;

using test::fault_job;
using test::Timed;
using test::contains;

namespace {

// The launcher's last line.
std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  return t.substr(t.rfind('\n') == std::string::npos ? 0 : t.rfind('\n') + 1);
}

}  // namespace

// Launched as N ranks without --mode ddp, each rank trained the whole job alone (N complete DP
// runs writing the same outputs, exit 0). Now every rank refuses, in one line.
TEST_CASE("replica-train launched as ranks without --mode ddp is refused") {
  auto r = run(launch(2) + kTrain + " --synthetic --synthetic-size 64 --max-steps 2 --quiet", 60);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("started as one of 2 ranks") != std::string::npos);
  CHECK(r.output.find("give --mode ddp [every rank]") != std::string::npos);
}

TEST_CASE("a rank killed mid-training ends the job within 30 s, naming the rank") {
  if (!replica::gloo_available()) return;
  Timed t = fault_job(2, 1, "9", 4, 20);
  INFO(t.r.output);
  CHECK(t.r.exit_code != 0);
  CHECK(contains(last_line(t.r.output), "rank 1"));
  CHECK(contains(last_line(t.r.output), "killed by signal 9"));
  CHECK(t.seconds < 4 + 30);
}

TEST_CASE("a stopped rank is named by the others and by the launcher") {
  if (!replica::gloo_available()) return;
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    Timed t = fault_job(ranks, 1, "STOP", 4, 5);
    INFO(t.r.output);
    CHECK(t.r.exit_code != 0);
    // The healthy ranks' error names rank 1, and so does the launcher's last line.
    CHECK(contains(t.r.output, "rank 1 stopped answering (no heartbeat"));
    CHECK(contains(last_line(t.r.output), "rank 1 (pid "));
    CHECK(contains(last_line(t.r.output), "stopped answering"));
    CHECK(t.seconds < 4 + 5 + 15);
  }
}

TEST_CASE("a stopped rank 0 is named although its store stops too") {
  if (!replica::gloo_available()) return;
  Timed t = fault_job(2, 0, "STOP", 4, 5);
  INFO(t.r.output);
  CHECK(t.r.exit_code != 0);
  CHECK(contains(t.r.output, "rank 0, which hosts the rendezvous store, stopped answering"));
  CHECK(contains(last_line(t.r.output), "rank 0 (pid "));
  CHECK(t.seconds < 4 + 5 + 25);
}

// Every rank rejects the batch (a global batch must divide by the ranks): one line for all.
TEST_CASE("a global batch that does not divide by the ranks: one clear error, printed once") {
  if (!replica::gloo_available()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    auto r = run(launch(ranks) + kTrain + " --mode ddp --data " + tmp.str("data") +
                     " --batch-size " + std::to_string(2 * ranks - 1) + " --max-steps 1 --quiet",
                 120);
    INFO(r.output);
    CHECK(r.exit_code != 0);
    const std::string line = "must divide by the " + std::to_string(ranks) + " ranks";
    CHECK(contains(r.output, line));
    CHECK(r.output.find(line) == r.output.rfind(line));  // once
    CHECK(contains(r.output, "[every rank]"));
  }
}

// Gloo's own failure for an interface that is not there is an assertion's text that does not
// name the variable. Refused before any rank starts: found by each rank as its group connected,
// the rank holding the store could exit on it before the other rank got there, which then
// failed on the lost store, and the launcher said "rank 0 exited with code 2" and exited 1.
TEST_CASE("GLOO_SOCKET_IFNAME naming no interface: one line naming the variable") {
  if (!replica::gloo_available()) return;
  auto r = run("env GLOO_SOCKET_IFNAME=no-such-if0 " + kTrain +
                   " --synthetic --mode ddp --devices cpu*2 --max-steps 1 --no-eval --quiet",
               120);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  const std::string line =
      "GLOO_SOCKET_IFNAME=no-such-if0: this machine has no network interface of that name";
  CHECK(contains(r.output, line));
  CHECK(r.output.find(line) == r.output.rfind(line));  // once
  CHECK(!contains(r.output, "exited with code"));
  CHECK(!contains(r.output, "[rank"));
}

TEST_CASE("a rendezvous with a missing rank times out with an error naming it") {
  if (!replica::gloo_available()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  // Rank 0 of a 2-rank job, alone: rank 1 never comes.
  auto r = run("env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
               "MASTER_PORT=" + std::to_string(test::next_port()) + " " + kTrain +
                   " --mode ddp --data " + tmp.str("data") + " --batch-size 8 --max-steps 1"
                   " --quiet --timeout 3",
               60);
  CHECK(r.exit_code != 0);
  CHECK_MESSAGE(contains(r.output, "rank 1"), r.output);
  CHECK(test::count_lines(r.output) == 1);
}

// Ranks started with different flags (nodes whose command lines differ): a model or bucket
// layout that differs made Gloo abort in an all-reduce of mismatched sizes; another --lr or
// --epochs trained apart or waited alone. Every rank now stops at once with the same line.
TEST_CASE("ranks started with different flags: one error naming the setting, on every rank") {
  if (!replica::gloo_available()) return;
  test::TempDir tmp;
  const std::string base = kTrain + " --mode ddp --devices cpu --synthetic --synthetic-size 64"
                                    " --batch-size 8 --max-steps 2 --quiet --timeout 20";
  const std::pair<const char*, const char*> cases[] = {
      {"--num-classes 5", "in the number of parameters (110845 against 111100): give every rank "
                          "the same --model, --input-shape and --num-classes"},
      {"--bucket-cap-mb 0.01", "in the number of gradient buckets"},
      {"--model resnet18", "in the number of parameters"},
      {"--lr 0.5", "in --lr: start every rank with the same flags"},
      {"--seed 7", "in --seed"},
      {"--drop-last", "in --drop-last"},
      {"--epochs 2", "in --epochs"},
      {"--no-eval", "in --no-eval"}};
  for (const auto& [flag, expected] : cases) {
    CAPTURE(std::string(flag));
    const std::string env = "env WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
                            "MASTER_PORT=" + std::to_string(test::next_port());
    // Rank 1 in the background with the odd flag; rank 0 in the foreground.
    auto r = run("sh -c '" + env + " RANK=1 LOCAL_RANK=1 " + base + " " + flag + " > /dev/null 2>" +
                     tmp.str("rank1") + " & pid=$!; " + env + " RANK=0 LOCAL_RANK=0 " + base +
                     "; rc0=$?; wait $pid; rc1=$?; echo \"exit $rc0 $rc1\"'",
                 90);
    INFO(r.output);
    INFO(test::read_text(tmp.str("rank1")));
    CHECK(contains(r.output, std::string("rank 1 differs from rank 0 ") + expected));
    CHECK(contains(r.output, "exit 2 2"));
    CHECK(test::count_lines(r.output) == 2);  // rank 0's line and the exit codes
  }
}

// A peer gone between the rendezvous and Gloo's connect (it stopped, or exited on a usage error
// of its own): the connecting rank's error is the peer monitor's, naming that rank, so that a
// launcher reports the peer's own error rather than this consequence.
TEST_CASE("a Gloo connect whose peer never comes names that rank") {
  if (!replica::gloo_available()) return;
  replica::TcpStoreServer server("127.0.0.1", 0);
  auto store = std::make_shared<replica::TcpStoreClient>("127.0.0.1", server.port(),
                                                         std::chrono::seconds(5));
  replica::DeviceContext ctx(replica::Device{replica::DeviceType::CPU, 0, 0});
  const replica::GroupOptions o{replica::CommBackend::Gloo, 0, 2, store, "127.0.0.1",
                                std::chrono::milliseconds(1500)};
  bool named = false;
  try {
    replica::make_process_group(o, ctx);
  } catch (const replica::PeerFailure& e) {
    INFO(e.what());
    CHECK(e.ranks() == std::vector<int>{1});
    CHECK(contains(e.what(), "gloo connecting to its peers failed on rank 0 of 2"));
    CHECK(contains(e.what(), "rank 1 stopped answering"));
    named = true;
  }
  CHECK(named);
}
