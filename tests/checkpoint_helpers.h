// Comparing two checkpoint files tensor by tensor, bit for bit (resume and data-placement
// tests), and runs that must end in the same checkpoint.
#pragma once
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "engine/checkpoint.h"

namespace test {

// Same step, same tensor names in the same order, identical bytes.
inline void check_same_checkpoint(const std::string& a_path, const std::string& b_path) {
  auto a = replica::load_checkpoint(a_path);
  auto b = replica::load_checkpoint(b_path);
  CHECK(a.metadata.at("step") == b.metadata.at("step"));
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    CAPTURE(a.tensors[i].first);
    REQUIRE(a.tensors[i].first == b.tensors[i].first);
    const auto& ta = a.tensors[i].second;
    const auto& tb = b.tensors[i].second;
    REQUIRE(ta.bytes() == tb.bytes());
    CHECK(std::memcmp(ta.raw(), tb.raw(), ta.bytes()) == 0);
  }
}

// A small MNIST-format set in tmp/data and a replica-train command over it that ends in the same
// bits however the batches reach the devices: 200 samples, batch 32 (7 steps an epoch with a
// partial last batch), two epochs (reshuffled), deterministic, SGD with momentum.
inline std::string small_mnist_train(const TempDir& tmp) {
  write_mnist_dir(tmp.path / "data", 200, 40);
  return bin("replica-train") + " --data " + tmp.str("data") +
         " --batch-size 32 --epochs 2 --deterministic --quiet --seed 3"
         " --threads-per-device 1 --optimizer sgd --momentum 0.9";
}

// The modes every such run is checked in: one device, DP over two, DDP over two ranks.
inline const std::vector<std::string>& cpu_modes() {
  static const std::vector<std::string> modes = {
      "--mode single --devices cpu", "--mode dp --devices cpu*2", "--mode ddp --devices cpu*2"};
  return modes;
}

// Runs `train` (a replica-train command) with the training set on the host and on the device:
// both end in the same checkpoint, bit for bit, and record the placement they used.
inline void check_placements_agree(const std::string& train, const TempDir& tmp) {
  for (const char* placement : {"host", "device"}) {
    const std::string dir = tmp.str(placement);
    auto r = run(train + " --data-placement " + placement + " --checkpoint " + dir +
                     " --metrics-json " + dir + ".json",
                 300);
    REQUIRE_MESSAGE(r.exit_code == 0, r.output);
    std::ifstream in(dir + ".json");
    CHECK(nlohmann::json::parse(in)["config"]["data_placement"] == placement);
  }
  check_same_checkpoint(tmp.str("host/checkpoint.safetensors"),
                        tmp.str("device/checkpoint.safetensors"));
  fs::remove_all(tmp.path / "host");
  fs::remove_all(tmp.path / "device");
}

}  // namespace test
