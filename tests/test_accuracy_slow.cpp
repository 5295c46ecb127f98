// Accuracy on the real Fashion-MNIST, through the real program (ctest -L slow).
//   cnn       >= 0.85 test accuracy after 1 epoch, >= 0.88 after 2 (one 2-epoch run)
//   resnet18  (1-channel 28x28 variant) >= kResnetTarget after 3 epochs
// Measured on a 2-core CPU shared with other builds (load 4-5), bench/results/
// 2026-11-21-cpu-single-device.md:
//   cnn, batch 32, Adam 1e-3, seeds 0/1/2: epoch 1 0.8748/0.8757/0.8730, epoch 2
//     0.8912/0.8923/0.8906; 64-98 s per 2-epoch run. (Batch 64 reached only 0.8826 at epoch 2
//     with seed 1: too thin a margin over 0.88.)
//   resnet18, batch 64, CONSTANT Adam 1e-3, seed 0: 0.8537, 0.8890, 0.8904; 1713 s for 3
//     epochs. The test runs it with --lr-schedule cosine, which that session did not measure.
// The timeouts leave about 2x room for a loaded machine. Skipped, with a visible message, when
// the data set is not installed.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"

namespace {

const std::string kData = "/usr/share/datasets/fashion-mnist";
// At a constant rate one run reached 0.8904 (a coin toss against 0.90); the cosine schedule is
// meant to give the margin. If it proves not to, this is the number to revisit.
constexpr double kResnetTarget = 0.90;

bool have_data() {
  if (test::fs::is_directory(kData)) return true;
  MESSAGE("skipped: " << kData << " not found (tools/setup.sh installs dataset-fashion-mnist)");
  return false;
}

// Runs replica-train with `args` plus --metrics-json; returns the metrics.
nlohmann::json train(const std::string& args, int timeout_s) {
  test::TempDir tmp;
  const std::string metrics = tmp.str("metrics.json");
  const std::string cmd = test::bin("replica-train") + " --data " + kData + " --quiet " + args +
                          " --metrics-json " + metrics;
  test::RunResult r = test::run(cmd, timeout_s);
  INFO("command: " << cmd);
  REQUIRE_MESSAGE(r.exit_code == 0, "exit code " << r.exit_code << ", output:\n" << r.output);
  std::ifstream in(metrics);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

double epoch_accuracy(const nlohmann::json& m, size_t epoch) {
  REQUIRE(m["epoch_summaries"].size() > epoch);
  return m["epoch_summaries"][epoch]["test_accuracy"].get<double>();
}

}  // namespace

TEST_CASE("cnn on Fashion-MNIST: >= 0.85 after 1 epoch, >= 0.88 after 2") {
  if (!have_data()) return;
  const auto m = train("--model cnn --epochs 2 --batch-size 32 --lr 1e-3 --seed 0", 900);
  const double a1 = epoch_accuracy(m, 0), a2 = epoch_accuracy(m, 1);
  MESSAGE("cnn test accuracy: epoch 1 " << a1 << ", epoch 2 " << a2 << " ("
                                        << m["train_seconds"].get<double>() << " s training)");
  CHECK(a1 >= 0.85);
  CHECK(a2 >= 0.88);
}

TEST_CASE("resnet18 (28x28 variant) on Fashion-MNIST: >= 0.90 after 3 epochs") {
  if (!have_data()) return;
  const auto m = train(
      "--model resnet18 --epochs 3 --batch-size 64 --lr 1e-3 --lr-schedule cosine --seed 0", 3600);
  std::ostringstream per_epoch;
  for (const auto& e : m["epoch_summaries"])
    per_epoch << " " << e["test_accuracy"].get<double>() << " (" << e["seconds"].get<double>()
              << " s)";
  MESSAGE("resnet18 test accuracy per epoch:" << per_epoch.str());
  CHECK(epoch_accuracy(m, 2) >= kResnetTarget);
}
