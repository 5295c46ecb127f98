// Evaluation as the tutorials' recipes do it: top-1 and top-5 accuracy after every epoch, each
// rank on its shard and the totals summed (every mode reports the same for the same model), and
// the best epoch's model kept (--save-best, PyTorch's model_best), across a resume too.
#include <doctest/doctest.h>

#include "cli_helpers.h"

#include <algorithm>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"

using test::kTrain;
using test::read_json;
using test::run;
using namespace replica;

namespace {

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("top-5 accuracy is reported beside top-1 where the model has more than 5 classes") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 256, 64);
  auto r = run(kTrain + " --data " + tmp.str("data") + " --batch-size 32 --epochs 2" +
               " --threads-per-device 1 --metrics-json " + tmp.str("m.json"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_of(r.output, " done: train loss ") == 2);
  CHECK(count_of(r.output, ", test accuracy ") == 2);
  CHECK(count_of(r.output, " (top-5 ") == 3);  // each epoch's line and the closing line
  CHECK(r.output.find("\ntest accuracy ") != std::string::npos);
  const auto m = read_json(tmp.str("m.json"));
  const double top1 = m["test_accuracy"], top5 = m["test_top5_accuracy"];
  CHECK(top5 >= top1);
  CHECK(top5 <= 1.0);
  CHECK(top5 > 0.5);  // two epochs learn the synthetic bands
  for (const auto& e : m["epoch_summaries"]) {
    REQUIRE(e.contains("test_top5_accuracy"));
    CHECK(e["test_top5_accuracy"].get<double>() >= e["test_accuracy"].get<double>());
  }
  CHECK(m["epoch_summaries"][1]["test_top5_accuracy"] == top5);

  // With 5 classes every sample is in the top 5: nothing to report.
  auto five = run(kTrain + " --synthetic --synthetic-size 64 --num-classes 5 --batch-size 32" +
                  " --threads-per-device 1 --metrics-json " + tmp.str("five.json"));
  INFO(five.output);
  REQUIRE(five.exit_code == 0);
  CHECK(five.output.find("top-5") == std::string::npos);
  const auto f = read_json(tmp.str("five.json"));
  CHECK(f.contains("test_accuracy"));
  CHECK_FALSE(f.contains("test_top5_accuracy"));
}

// One trained model, evaluated by every engine: the single device whole batches, DP in chunks
// of each batch (61 test samples: the last batch splits 15/14), DDP on interleaved shards of 31
// and 30 samples. The counts are sums of the same per-sample decisions: equal to the bit.
TEST_CASE("single, DP cpu*2 and DDP 2 ranks evaluate the same model alike") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 61);
  const std::string data = kTrain + " --data " + tmp.str("data") +
                           " --batch-size 32 --threads-per-device 1 --checkpoint " + tmp.str("ck");
  auto trained = run(data + " --mode single --no-eval --quiet");
  REQUIRE_MESSAGE(trained.exit_code == 0, trained.output);
  nlohmann::json reference;
  for (const std::string mode : {"single", "dp", "ddp"}) {
    CAPTURE(mode);
    const std::string json = tmp.str(mode + ".json");
    auto r = run(data + " --resume --mode " + mode +
                     (mode == "single" ? std::string() : std::string(" --devices cpu*2")) +
                     " --metrics-json " + json,
                 180);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("nothing left to train") != std::string::npos);
    CHECK(r.output.find(" (top-5 0.") != std::string::npos);
    const auto m = read_json(json);
    CHECK(m["world_size"] == (mode == "ddp" ? 2 : 1));
    if (mode == "single") {
      reference = m;
      continue;
    }
    CHECK(m["test_accuracy"] == reference["test_accuracy"]);
    CHECK(m["test_top5_accuracy"] == reference["test_top5_accuracy"]);
    CHECK(m["test_loss"].get<double>() ==
          doctest::Approx(reference["test_loss"].get<double>()).epsilon(1e-5));
  }
  CHECK(reference["test_top5_accuracy"].get<double>() > reference["test_accuracy"].get<double>());
}

// After a step, each DP replica's and DDP rank's BatchNorm statistics hold its own share of the
// batch. Evaluation must read those of device 0 / rank 0, the ones the checkpoint saves: DP
// broadcasts them with the parameters after every step, DDP before evaluating (PyTorch's
// broadcast_buffers: before every forward, eval ones too). So a run's reported metrics are its
// checkpoint's, evaluated on one device.
TEST_CASE("DP and DDP evaluate with device 0's BatchNorm statistics, the model they save") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 61);
  for (const std::string mode : {"dp", "ddp"}) {
    CAPTURE(mode);
    const std::string common = kTrain + " --data " + tmp.str("data") +
                               " --model resnet18 --batch-size 32 --threads-per-device 1"
                               " --quiet --checkpoint " + tmp.str(mode);
    auto trained = run(common + " --mode " + mode + " --devices cpu*2 --metrics-json " +
                           tmp.str(mode + ".json"),
                       300);
    REQUIRE_MESSAGE(trained.exit_code == 0, trained.output);
    auto single = run(common + " --mode single --resume --metrics-json " +
                          tmp.str(mode + "-one.json"),
                      180);
    REQUIRE_MESSAGE(single.exit_code == 0, single.output);
    const auto d = read_json(tmp.str(mode + ".json")), s = read_json(tmp.str(mode + "-one.json"));
    CHECK(d["test_accuracy"] == s["test_accuracy"]);
    CHECK(d["test_top5_accuracy"] == s["test_top5_accuracy"]);
    CHECK(d["test_loss"].get<double>() ==
          doctest::Approx(s["test_loss"].get<double>()).epsilon(1e-5));
  }
}

// The best epoch's weights are written when an epoch's test accuracy beats every earlier one's;
// the checkpoint carries the best, so a resumed run compares against the epochs before it.
TEST_CASE("--save-best keeps the best epoch's model, across a resume") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 192, 64);
  const std::string base = kTrain + " --data " + tmp.str("data") +
                           " --batch-size 32 --lr 0.0003 --threads-per-device 1 --seed 3" +
                           " --checkpoint " + tmp.str("ck") + " --save-best " +
                           tmp.str("best.safetensors");
  auto first = run(base + " --epochs 1 --metrics-json " + tmp.str("first.json"));
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK(first.output.find("best test accuracy so far (") != std::string::npos);
  const double acc1 = read_json(tmp.str("first.json"))["test_accuracy"];
  const Checkpoint ck1 = load_checkpoint(tmp.str("ck/checkpoint.safetensors"));
  CHECK(ck1.metadata.at("best_epoch") == "1");
  CHECK(std::stod(ck1.metadata.at("best_accuracy")) == acc1);
  CHECK(load_checkpoint(tmp.str("best.safetensors")).metadata.at("format") == "replica-model-v1");

  auto rest = run(base + " --epochs 4 --resume --metrics-json " + tmp.str("rest.json"));
  INFO(rest.output);
  REQUIRE(rest.exit_code == 0);
  const auto m = read_json(tmp.str("rest.json"));
  // The best over epochs 1 (the first run's) to 4, the first epoch to reach it, and one saved
  // line per epoch that raised it.
  double best = acc1;
  int64_t best_epoch = 1, raises = 0;
  std::string by_epoch = fmt::format("{}", acc1);
  for (const auto& e : m["epoch_summaries"]) {
    const double acc = e["test_accuracy"];
    by_epoch += fmt::format(" {}", acc);
    if (acc > best) {
      best = acc;
      best_epoch = e["epoch"];
      ++raises;
    }
  }
  REQUIRE(m["epoch_summaries"].size() == 3);
  CHECK(m["best_test_accuracy"] == best);
  CHECK(m["best_epoch"] == best_epoch);
  CHECK(count_of(rest.output, "best test accuracy so far (") == size_t(raises));
  const Checkpoint ck = load_checkpoint(tmp.str("ck/checkpoint.safetensors"));
  CHECK(ck.metadata.at("best_epoch") == std::to_string(best_epoch));
  // The saved model is that epoch's: the last epoch's weights are the checkpoint's.
  const Checkpoint saved = load_checkpoint(tmp.str("best.safetensors"));
  const Tensor* fc = saved.find("fc2.weight");
  const Tensor* fc_last = ck.find("model.fc2.weight");
  REQUIRE(fc != nullptr);
  REQUIRE(fc_last != nullptr);
  const bool same = std::equal(fc->f32(), fc->f32() + fc->numel(), fc_last->f32());
  CHECK(same == (best_epoch == 4));
  MESSAGE("test accuracy by epoch: " << by_epoch << "; best epoch " << best_epoch);
}

// The best the checkpoint carries is the bar: a resumed run below it writes nothing. A run
// resumed at its end (stopped during its last step, or trained without evaluation) evaluates
// the model, and a new best goes into the checkpoint too, for the resume after it.
TEST_CASE("--save-best: the checkpoint's best is the bar, and a resume at the end updates it") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 96, 32);
  const std::string base = kTrain + " --data " + tmp.str("data") + " --batch-size 32" +
                           " --threads-per-device 1 --checkpoint " + tmp.str("ck") +
                           " --save-best " + tmp.str("best.safetensors");
  REQUIRE(run(base + " --epochs 1 --quiet").exit_code == 0);
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  Checkpoint c = load_checkpoint(ck);
  c.metadata["best_accuracy"] = "1";
  save_checkpoint(ck, c);
  const auto before = test::file_bytes(tmp.str("best.safetensors"));
  auto r = run(base + " --epochs 3 --resume --metrics-json " + tmp.str("m.json"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("best test accuracy so far") == std::string::npos);
  CHECK(test::file_bytes(tmp.str("best.safetensors")) == before);
  const auto m = read_json(tmp.str("m.json"));
  CHECK(m["best_test_accuracy"] == 1.0);
  CHECK(m["best_epoch"] == 1);

  test::fs::remove_all(tmp.path / "ck");
  test::fs::remove(tmp.path / "best.safetensors");
  REQUIRE(run(kTrain + " --data " + tmp.str("data") + " --batch-size 32 --threads-per-device 1" +
              " --no-eval --quiet --checkpoint " + tmp.str("ck"))
              .exit_code == 0);
  CHECK(load_checkpoint(ck).metadata.count("best_epoch") == 0);
  auto end = run(base + " --resume");
  INFO(end.output);
  REQUIRE(end.exit_code == 0);
  CHECK(end.output.find("nothing left to train") != std::string::npos);
  CHECK(end.output.find("best test accuracy so far (") != std::string::npos);
  CHECK(test::fs::exists(tmp.path / "best.safetensors"));
  CHECK(load_checkpoint(ck).metadata.at("best_epoch") == "1");
}

TEST_CASE("--save-best: bad combinations and a corrupt best in the checkpoint are one line") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 32);
  const std::string data = "--data " + tmp.str("data") + " --batch-size 32 --quiet";
  test::expect_clean_error("replica-train", data + " --no-eval --save-best " + tmp.str("b"),
                           "--save-best keeps the model of the epoch with the best test "
                           "accuracy: it needs the evaluation that --no-eval turns off");
  test::expect_clean_error("replica-train",
                           data + " --save-best " + tmp.str("m") + " --save-model " + tmp.str("m"),
                           "--save-best and --save-model name the same file");
  test::expect_clean_error("replica-train", data + " --save-best " + tmp.str("no/such/dir/b"),
                           "--save-best");
  REQUIRE(run(kTrain + " " + data + " --checkpoint " + tmp.str("ck")).exit_code == 0);
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  const Checkpoint good = load_checkpoint(ck);
  REQUIRE(good.metadata.count("best_accuracy") == 1);
  for (const char* bad : {"1.5", "-0.1", "abc", "nan", ""}) {
    Checkpoint c = good;
    c.metadata["best_accuracy"] = bad;
    save_checkpoint(ck, c);
    test::expect_clean_error("replica-train",
                             data + " --epochs 2 --resume --checkpoint " + tmp.str("ck"),
                             fmt::format("metadata 'best_accuracy' is '{}', not a number in "
                                         "[0, 1]",
                                         bad));
  }
  Checkpoint c = good;
  c.metadata["best_epoch"] = "0";
  save_checkpoint(ck, c);
  test::expect_clean_error("replica-train",
                           data + " --epochs 2 --resume --checkpoint " + tmp.str("ck"),
                           "metadata 'best_epoch' is '0', not a count of at least 1");
}
