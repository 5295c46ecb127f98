// DDP over NCCL with several ranks on ONE GPU (each rank its own NCCL host id, over sockets):
// the same jobs the Gloo suites run on CPU devices — collectives in closed form, equivalence to
// one device (buckets, --accumulate, evaluation), BatchNorm replicas in step, Ctrl-C agreement,
// and faults (a killed rank, a stopped rank, a missing rank). Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gpu_skip.h"
#include "job_helpers.h"
#include "parallel/comm/process_group.h"

using test::kTrain;
using test::launch;
using test::run;
using test::contains;

namespace {

std::string nccl_on_one_gpu(int ranks) {
  return " --devices cuda:0*" + std::to_string(ranks) + " --backend nccl";
}

bool ready() {
  if (!test::have_gpu()) return false;
  if (!replica::nccl_available()) {
    std::printf("SKIPPED: no CUDA GPU found usable with NCCL (%s)\n",
                replica::nccl_problem().c_str());
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("NCCL collectives in closed form on 2 and 3 ranks of one GPU") {
  if (!ready()) return;
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto r = run(launch(n) + test::bin("replica-collectives") +
                     " --check --backend nccl --timeout 60",
                 180);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(contains(r.output, "nccl over sockets"));
    size_t oks = 0;
    for (size_t p = r.output.find(": ok"); p != std::string::npos; p = r.output.find(": ok", p + 1))
      ++oks;
    CHECK(oks == size_t(n));
  }
}

TEST_CASE("DDP over NCCL on cuda:0*2 and cuda:0*3 equals one device, evaluation included") {
  if (!ready()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 360, 96);  // 15 steps of 24: no sampler padding
  const std::string common = " --data " + tmp.str("data") +
                             " --model cnn --batch-size 24 --max-steps 5 --optimizer sgd"
                             " --momentum 0.9 --lr 0.05 --seed 5 --quiet --deterministic"
                             " --precision fp32";
  auto single = run(kTrain + " --mode single --devices cuda:0" + common + " --checkpoint " +
                        tmp.str("single") + " --metrics-json " + tmp.str("single.json"),
                    180);
  REQUIRE_MESSAGE(single.exit_code == 0, single.output);
  const auto reference = test::checkpoint_params(tmp.str("single/checkpoint.safetensors"));
  const auto ref_metrics = test::read_json(tmp.str("single.json"));
  // cuDNN picks its algorithms per batch shape, so one device's batch of 24 and the ranks'
  // shares round differently: a tolerance of 1e-4 where the CPU suites hold 1e-5.
  auto same_as_reference = [&](const std::string& dir, const std::string& metrics) {
    CHECK(test::max_relative(reference, test::checkpoint_params(dir + "/checkpoint.safetensors")) <=
          1e-4);
    const auto m = test::read_json(metrics);
    // Parameters within 1e-4 can still tip a near-tied logit: one of the 96 test samples.
    CHECK(std::fabs(m["test_accuracy"].get<double>() - ref_metrics["test_accuracy"].get<double>()) <=
          1.0 / 96 + 1e-9);
    CHECK(std::fabs(m["test_loss"].get<double>() - ref_metrics["test_loss"].get<double>()) <=
          1e-4);
    CHECK(m["devices_share_gpu"] == true);
    CHECK(contains(m["collectives"].get<std::string>(), "nccl over sockets"));
  };
  for (int n : {2, 3}) {
    for (const char* cap : {"0.0001", "1000"}) {  // a bucket per parameter; one bucket
      CAPTURE(n);
      CAPTURE(cap);
      const std::string dir = tmp.str(std::string("ddp") + std::to_string(n) + "-" + cap);
      auto r = run(launch(n) + kTrain + " --mode ddp --bucket-cap-mb " + cap + common +
                       nccl_on_one_gpu(n) + " --checkpoint " + dir + " --metrics-json " +
                       dir + ".json",
                   300);
      REQUIRE_MESSAGE(r.exit_code == 0, r.output);
      same_as_reference(dir, dir + ".json");
    }
  }
  const std::string dir = tmp.str("ddp-accumulate");
  auto r = run(launch(2) + kTrain + " --mode ddp --accumulate 2" + common + nccl_on_one_gpu(2) +
                   " --checkpoint " + dir + " --metrics-json " + dir + ".json",
               300);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  same_as_reference(dir, dir + ".json");
}

TEST_CASE("BatchNorm over NCCL: every rank holds identical parameters after every step") {
  if (!ready()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 256, 64);
  auto r = run("env REPLICA_DDP_CHECK_SYNC=1 " + launch(3) + kTrain + " --mode ddp --data " +
                   tmp.str("data") + " --model resnet18 --batch-size 12 --max-steps 4" +
                   " --optimizer adam --quiet" + nccl_on_one_gpu(3),
               300);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
}

TEST_CASE("Ctrl-C in a self-launched NCCL DDP run: every rank stops after the same step") {
  if (!ready()) return;
  for (const char* when : {"step     3/80", "step    30/80"}) {
    CAPTURE(when);
    test::interrupt_and_resume("--mode ddp" + nccl_on_one_gpu(2), when);
  }
}

TEST_CASE("NCCL: a killed rank ends the job within the timeout, named, nothing left") {
  if (!ready()) return;
  test::Timed t = test::fault_job(2, 1, "9", 8, 20, nccl_on_one_gpu(2));
  INFO(t.r.output);
  CHECK(t.r.exit_code != 0);
  CHECK(contains(t.r.output, "rank 1"));
  CHECK(t.seconds < 8 + 20 + 15);
}

// Traced, every span waits for its device; untraced, the host waits for the GPU when it releases
// a batch's pinned buffer. Either wait would hang behind an all-reduce whose peer stopped, were
// it not preceded by the group's timed one.
TEST_CASE("NCCL: a stopped rank is named by the others and by the launcher") {
  if (!ready()) return;
  for (const char* marker_flag : {"--trace", "--metrics-json"}) {
    CAPTURE(marker_flag);
    test::Timed t = test::fault_job(2, 1, "STOP", 8, 10, nccl_on_one_gpu(2), marker_flag);
    INFO(t.r.output);
    CHECK(t.r.exit_code != 0);
    CHECK(contains(t.r.output, "rank 1 stopped answering"));
    CHECK(t.seconds < 8 + 10 + 20);
  }
}

TEST_CASE("NCCL: a missing rank ends in a timeout error naming it") {
  if (!ready()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  auto r = run("env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
               "MASTER_PORT=" + std::to_string(test::next_port()) + " " + kTrain +
                   " --mode ddp --data " + tmp.str("data") + " --batch-size 8 --max-steps 1" +
                   " --quiet --timeout 3" + nccl_on_one_gpu(2),
               60);
  CHECK(r.exit_code != 0);
  CHECK_MESSAGE(contains(r.output, "rank 1"), r.output);
}

namespace {

struct Span {
  std::string track, phase;
  double start, end;
};

// The complete spans of a Chrome trace, each with its track (thread) name.
std::vector<Span> trace_spans(const nlohmann::json& trace) {
  std::map<std::pair<int, int>, std::string> names;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name")
      names[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"].get<std::string>();
  std::vector<Span> spans;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "X")
      spans.push_back({names[{e["pid"].get<int>(), e["tid"].get<int>()}],
                       e["name"].get<std::string>(), e["ts"].get<double>(),
                       e["ts"].get<double>() + e["dur"].get<double>()});
  return spans;
}

}  // namespace

TEST_CASE("NCCL DDP trace: all-reduces timed on the communication stream overlap backward") {
  if (!ready()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 256, 64);
  // ResNet-18 in 1 MB buckets: dozens of all-reduces per step, the first ones due early in
  // backward.
  auto r = run(launch(2) + kTrain + " --mode ddp --data " + tmp.str("data") +
                   " --model resnet18 --batch-size 32 --max-steps 4 --no-eval --quiet" +
                   " --bucket-cap-mb 1" + nccl_on_one_gpu(2) + " --trace " + tmp.str("t.json"),
               300);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const auto spans = trace_spans(test::read_json(tmp.str("t.json")));
  std::vector<Span> backward, allreduce;
  for (const Span& s : spans) {
    if (s.track.rfind("rank0 ", 0) != 0) continue;
    if (contains(s.track, "nccl stream") && s.phase == "allreduce") allreduce.push_back(s);
    if (!contains(s.track, "nccl stream") && s.phase == "backward") backward.push_back(s);
  }
  REQUIRE(backward.size() >= 4);
  CHECK(allreduce.size() >= 4 * 10);  // every step's buckets, timed on the GPU
  int overlapping = 0;
  for (const Span& a : allreduce)
    for (const Span& b : backward)
      if (a.start > b.start && a.start < b.end) ++overlapping;
  MESSAGE(allreduce.size() << " device-timed all-reduces on rank 0, " << overlapping
                           << " of them starting during a backward");
  CHECK(overlapping > 0);
}
