// The training set held on the GPU (--data-placement device, what auto picks on a GPU when the
// set fits): the same bits as batches copied in from pinned host memory (a step ahead, on copy
// streams), on one GPU, on logical devices of one GPU sharing one copy (DP), and on DDP ranks
// holding a copy each; replica-bench keeps its batches there too. Batches copied a step ahead
// give the bits of batches copied in their step. Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "dp_reference.h"
#include "gpu_skip.h"

using test::kTrain;

namespace {

std::string train_command(const test::TempDir& tmp) {
  return kTrain + " --data " + tmp.str("data") +
         " --batch-size 32 --epochs 2 --deterministic --precision fp32 --seed 3"
         " --optimizer sgd --momentum 0.9";
}

}  // namespace

TEST_CASE("on a GPU, training on the resident set gives the host path's bits") {
  if (!test::have_gpu()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 200, 40);
  for (const char* mode : {"--mode single --devices cuda:0", "--mode dp --devices cuda:0*2",
                           "--mode ddp --devices cuda:0*2 --backend gloo"}) {
    CAPTURE(mode);
    test::check_placements_agree(train_command(tmp) + " --quiet " + mode, tmp);
  }
}

TEST_CASE("on a GPU, auto places a small training set on the device and says so") {
  if (!test::have_gpu()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 200, 40);
  auto r = test::run(train_command(tmp) + " --devices cuda:0*2 --max-steps 3 --metrics-json " +
                         tmp.str("m.json"),
                     300);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(r.output.find("data: the training set is held on the device (0.6 MB") !=
        std::string::npos);
  std::ifstream in(tmp.str("m.json"));
  CHECK(nlohmann::json::parse(in)["config"]["data_placement"] == "device");
}

TEST_CASE("replica-bench on a GPU keeps its preloaded batches in device memory, as PyTorch's does") {
  if (!test::have_gpu()) return;
  test::TempDir tmp;
  auto r = test::run(test::bin("replica-bench") +
                         " --suite dp,ddp --devices cuda:0*2 --steps 3 --warmup 1 --repeat 1"
                         " --batch 8 --json " + tmp.str("rows.jsonl"),
                     300);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  std::ifstream in(tmp.str("rows.jsonl"));
  int rows = 0;
  for (std::string line; std::getline(in, line);) {
    const auto row = nlohmann::json::parse(line);
    CHECK(row["data"] == "synthetic, preloaded in device memory (loader not timed)");
    ++rows;
  }
  CHECK(rows == 4);  // dp and ddp, on 1 and 2 devices
}

TEST_CASE("on a GPU, batches copied a step ahead on a copy stream give the in-step copies' bits") {
  if (!test::have_gpu()) return;
  using namespace replica;
  const Device gpu{DeviceType::CUDA, 0, 0};
  // ResNet-18 at batch 64: steps long enough that the host stages the next batch while the GPU
  // still runs the step before, into memory an earlier step's tensors held (a copy that did
  // not wait for those kernels would overwrite what they read).
  const EngineOptions o = test::sgd_options("resnet18", {1, 28, 28});
  const auto batches = test::make_batches(o.input_shape, 64, 6, 21, pinned_allocator());
  auto plain = make_single_device_engine(gpu, o);
  for (const auto& b : batches) plain->train_step(b);
  auto ahead = make_single_device_engine(gpu, o);
  test::train_prefetching(*ahead, batches);
  plain->synchronize();
  ahead->synchronize();
  CHECK(test::params_of(*ahead) == test::params_of(*plain));
}
