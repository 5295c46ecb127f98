// Resuming replica-train from its checkpoint as a user does: each epoch trains in its own order
// (what a resume's position counts in), the run continues bit-identically, stops cleanly at or
// past its planned end, refuses a checkpoint of another model, batch size or corrupt metadata,
// and says when it goes on in another precision than the checkpoint's.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "job_helpers.h"

#include "engine/allocator.h"
#include "engine/checkpoint.h"
#include "engine/data/dataset.h"
#include "engine/data/loader.h"
#include "engine/device.h"
#include "parallel/engines/train_engine.h"
#include "parallel/loop/checkpointing.h"

using test::kTrain;
using test::expect_train_error;
using test::run;
using namespace replica;

namespace {

// `c` with element i of its tensor `name` set to v, in a fresh tensor: copies of a Checkpoint
// share their tensors' storage, and `c` stays as it was.
Checkpoint with_element(const Checkpoint& c, const std::string& name, int64_t i, float v) {
  Checkpoint out = c;
  bool found = false;
  for (auto& [n, t] : out.tensors)
    if (n == name) {
      Tensor copy = Tensor::empty(host_allocator(), t.shape(), DType::F32);
      for (int64_t j = 0; j < t.numel(); ++j) copy.f32()[j] = t.f32()[j];
      copy.f32()[i] = v;
      t = copy;
      found = true;
    }
  REQUIRE(found);
  return out;
}

}  // namespace

TEST_CASE("a run resumed from its checkpoint continues bit-identically") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 320, 64);
  // 320 samples / batch 32 = 10 steps per epoch; stop mid-epoch 2 and resume.
  const std::string common = kTrain + " --data " + tmp.str("data") +
                             " --batch-size 32 --epochs 3 --deterministic --quiet --no-eval"
                             " --threads-per-device 2 --seed 7";
  // On a GPU the data is kept on the device ("auto"); pinned host batches copied at each step
  // are the other path, and the one whose buffers a resumed loader refills.
  std::vector<std::string> optimizers = {" --optimizer adam", " --optimizer sgd --momentum 0.9"};
  if (replica::cuda_device_count() > 0)
    optimizers.push_back(" --optimizer adam --data-placement host");
  for (const std::string& opt : optimizers) {
    CAPTURE(opt);
    auto full = run(common + opt + " --checkpoint " + tmp.str("full"));
    REQUIRE_MESSAGE(full.exit_code == 0, full.output);
    auto part = run(common + opt + " --max-steps 13 --checkpoint " + tmp.str("part"));
    REQUIRE_MESSAGE(part.exit_code == 0, part.output);
    auto rest = run(common + opt + " --resume --checkpoint " + tmp.str("part"));
    REQUIRE_MESSAGE(rest.exit_code == 0, rest.output);

    CHECK(replica::load_checkpoint(tmp.str("full/checkpoint.safetensors")).metadata.at("step") ==
          "30");
    test::check_same_checkpoint(tmp.str("full/checkpoint.safetensors"),
                                tmp.str("part/checkpoint.safetensors"));
    test::fs::remove_all(tmp.path / "full");
    test::fs::remove_all(tmp.path / "part");
  }
}

// The position a resume continues from is (epoch, batch in that epoch's order): each epoch must
// train in its own order. Two epochs of replica-train are the engine stepped over epoch 0's
// order (epoch_order), then over epoch 1's, bit for bit.
TEST_CASE("each epoch trains in its own order: two epochs of a run, stepped by hand") {
  test::TempDir tmp;
  const int64_t n = 24, batch = 8;
  const uint64_t seed = 5;
  auto r = run(kTrain + " --mode single --devices cpu --synthetic --synthetic-size 24"
               " --batch-size 8 --epochs 2 --optimizer sgd --lr 0.05 --momentum 0.9 --seed 5"
               " --threads-per-device 1 --precision fp32 --no-eval --quiet --checkpoint " +
               tmp.str("run"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);

  REQUIRE(epoch_order(n, seed, 0, true) != epoch_order(n, seed, 1, true));
  EngineOptions o;
  o.model = "cnn";
  o.input_shape = {1, 28, 28};
  o.num_classes = 10;
  o.seed = seed;
  o.threads_per_device = 1;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.05f;
  o.optimizer.momentum = 0.9f;
  auto engine = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  const auto data = make_synthetic(n, o.input_shape, 10, seed);
  Loader loader(*data, batch, /*drop_last=*/false);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch_order(n, seed, epoch, true), epoch, 0);
    for (int64_t b = 0; b < n / batch; ++b) engine->train_step(*loader.next());
  }
  engine->synchronize();
  const Tensor params = to_host(engine->primary(), engine->model().flat_params());
  const std::vector<float> by_hand(params.f32(), params.f32() + params.numel());
  CHECK(test::checkpoint_params(tmp.str("run/checkpoint.safetensors")) == by_hand);
}

// --epochs and --max-steps count from the run's first step: a resumed run that has them all
// says so and evaluates the model (exit 0, no empty table; a run stopped during its last step
// saved it unevaluated), one told to stop before the checkpoint's step is refused.
TEST_CASE("resume at or past the end of the planned run") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 32);  // 4 steps per epoch at batch 32
  const std::string base = "--data " + tmp.str("data") + " --batch-size 32 --no-eval " +
                           "--checkpoint " + tmp.str("ck");
  REQUIRE(run(kTrain + " " + base + " --quiet").exit_code == 0);
  const std::string evaluated = "--data " + tmp.str("data") + " --batch-size 32 --checkpoint " +
                                tmp.str("ck");
  auto again = run(kTrain + " " + evaluated + " --resume");
  INFO(again.output);
  CHECK(again.exit_code == 0);
  CHECK(again.output.find("nothing left to train: the checkpoint has all 4 steps that --epochs 1 "
                          "plan") != std::string::npos);
  CHECK(again.output.find("train loss") == std::string::npos);
  CHECK(again.output.find("\ntest accuracy 0.") != std::string::npos);
  expect_train_error(base + " --resume --max-steps 2 --quiet",
                     "--resume: the checkpoint in " + tmp.str("ck") + " is at step 4, past the "
                     "2 steps that --epochs 1 --max-steps 2 plan");
  auto more = run(kTrain + " " + base + " --resume --epochs 2 --quiet");
  REQUIRE_MESSAGE(more.exit_code == 0, more.output);
  CHECK(load_checkpoint(tmp.str("ck/checkpoint.safetensors")).metadata.at("step") == "8");
}

TEST_CASE("resume refuses a checkpoint of another model or batch size") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 32);
  const std::string base =
      kTrain + " --data " + tmp.str("data") + " --quiet --no-eval --max-steps 2";
  REQUIRE(run(base + " --batch-size 32 --checkpoint " + tmp.str("ck")).exit_code == 0);
  expect_train_error("--data " + tmp.str("data") +
                         " --quiet --max-steps 3 --batch-size 16 --resume --checkpoint " +
                         tmp.str("ck"),
                     "batch size");
  // Metadata that is not a count, and a tensor of another dtype, are named.
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  const std::string resume = "--data " + tmp.str("data") +
                             " --quiet --max-steps 3 --batch-size 32 --resume --checkpoint " +
                             tmp.str("ck");
  // Other data, or drop_last, orders the epoch's batches otherwise: the position would point
  // into another order (both were resumed before).
  expect_train_error("--synthetic --synthetic-size 128 --quiet --max-steps 3 --batch-size 32 "
                     "--resume --checkpoint " + tmp.str("ck"),
                     "trained on '128 samples', this run reads 'synthetic, 128 samples'");
  expect_train_error(resume + " --drop-last", "this run reads '128 samples, drop_last'");
  Checkpoint good = load_checkpoint(ck);
  for (const char* epoch : {"-1", "abc", "99999999999999999999"}) {
    Checkpoint bad = good;
    bad.metadata["epoch"] = epoch;
    save_checkpoint(ck, bad);
    expect_train_error(resume, fmt::format("metadata 'epoch' is '{}', not a count", epoch));
  }
  Checkpoint retyped = good;
  for (auto& [name, t] : retyped.tensors)
    if (name == "model.fc2.bias") t = Tensor::empty(host_allocator(), t.shape(), DType::I32);
  save_checkpoint(ck, retyped);
  expect_train_error(resume, "tensor 'model.fc2.bias' is I32, expected F32");
  // A NaN in the weights (a diverged run's checkpoint) is named, not resumed into a run that
  // later blames the learning rate.
  save_checkpoint(ck, with_element(good, "model.fc2.bias", 3, std::nanf("")));
  expect_train_error(resume, "tensor 'model.fc2.bias' holds nan at element 3");
  // And the optimizer's state: resumed, it made the weights NaN a step later.
  std::string state_name;
  for (const auto& [name, t] : good.tensors)
    if (name.rfind("optim.", 0) == 0 && t.dtype() == DType::F32 && state_name.empty())
      state_name = name;
  REQUIRE_FALSE(state_name.empty());
  save_checkpoint(ck, with_element(good, state_name, 0, std::numeric_limits<float>::infinity()));
  expect_train_error(resume, "tensor '" + state_name + "' holds inf at element 0");
  // A corrupt checkpoint is an error, not a crash.
  test::fs::resize_file(tmp.path / "ck" / "checkpoint.safetensors", 100);
  expect_train_error("--data " + tmp.str("data") +
                         " --quiet --max-steps 3 --batch-size 32 --resume --checkpoint " +
                         tmp.str("ck"),
                     "checkpoint");
}

// A position whose fields are each a count but do not fit together: resumed, an epoch past the
// end trained nothing and exited 0, an optimizer step count off the loop's went on with Adam's
// bias correction of another step. And a second moment below zero, which Adam never writes.
TEST_CASE("resume refuses a position that does not add up, and a negative second moment") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 32);  // 4 steps an epoch at batch 32
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  REQUIRE(run(kTrain + " --data " + tmp.str("data") + " --quiet --no-eval --max-steps 2 "
              "--batch-size 32 --checkpoint " + tmp.str("ck"))
              .exit_code == 0);
  const std::string resume = "--data " + tmp.str("data") +
                             " --quiet --no-eval --epochs 3 --batch-size 32 --resume "
                             "--checkpoint " + tmp.str("ck");
  const Checkpoint good = load_checkpoint(ck);
  REQUIRE(good.metadata.at("step") == "2");
  struct Case {
    std::map<std::string, std::string> fields;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{{"epoch", "99999999999"}},
       "its position does not add up: epoch 99999999999 (0-based), batch 2 of it and step 2, "
       "with 4 batches an epoch"},
      {{{"epoch", "3"}, {"batch_in_epoch", "0"}, {"step", "5"}}, "does not add up: epoch 3"},
      {{{"step", "3"}}, "does not add up: epoch 0 (0-based), batch 2 of it and step 3"},
      {{{"batch_in_epoch", "99999999"}},
       "it stopped after batch 99999999 of an epoch, and this run's epochs have 4 batches"},
      {{{"optimizer_steps", "1000"}}, "the optimizer took 1000 steps, the loop 2"}};
  for (const Case& c : cases) {
    Checkpoint bad = good;
    for (const auto& [key, value] : c.fields) bad.metadata[key] = value;
    save_checkpoint(ck, bad);
    expect_train_error(resume, c.error);
  }
  save_checkpoint(ck, with_element(good, "optim.exp_avg_sq", 7, -1.f));
  expect_train_error(resume, "'exp_avg_sq' holds -1 at element 7");
  // A position that adds up is taken: the start of the second epoch, its 4 steps taken.
  Checkpoint moved = good;
  for (const auto& [key, value] : std::map<std::string, std::string>{
           {"epoch", "1"}, {"batch_in_epoch", "0"}, {"step", "4"}, {"optimizer_steps", "4"}})
    moved.metadata[key] = value;
  save_checkpoint(ck, moved);
  auto r = run(kTrain + " " + resume);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(load_checkpoint(ck).metadata.at("step") == "12");
}

// A checkpoint or model of NaN weights is not written: --resume would refuse it, and it would
// replace the last good one. (A NaN weight also makes the loss NaN at its step, as the ReLUs
// keep NaN: this is the check behind that one.)
TEST_CASE("a checkpoint or model of NaN weights is not written; the files before stay") {
  test::TempDir tmp;
  EngineOptions o;
  o.model = "cnn";
  o.input_shape = {1, 28, 28};
  o.num_classes = 10;
  o.threads_per_device = 1;
  o.optimizer.name = "sgd";
  auto engine = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  const RunIdentity run{0, 32, "synthetic, 64 samples", 2};
  save_training_checkpoint(tmp.str("ck"), *engine, RunPosition{}, run);
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  const auto before = test::fs::last_write_time(ck);
  Param* first = engine->model().params().front();
  REQUIRE(first->value.on_host());
  first->value.f32()[2] = std::nanf("");
  const std::string diverged = "training diverged: tensor 'model." + first->name +
                               "' holds nan at element 2 (lower --lr?); " + ck + " not written";
  CHECK(test::contains(test::error_of([&] {
                         save_training_checkpoint(tmp.str("ck"), *engine, RunPosition{}, run);
                       }),
                       diverged));
  CHECK(test::fs::last_write_time(ck) == before);
  CHECK(test::contains(test::error_of([&] { save_model_weights(tmp.str("m.st"), *engine); }),
                       "tensor '" + first->name + "' holds nan at element 2"));
  CHECK_FALSE(test::fs::exists(tmp.path / "m.st"));
}

// The checkpoint records the precision its steps were trained in. Master weights and optimizer
// state are fp32 at every precision, so a run may go on in another one; it says so, once, with
// the flag that would keep the checkpoint's.
TEST_CASE("a resume in another precision than the checkpoint's says so") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 128, 32);
  const std::string base = kTrain + " --data " + tmp.str("data") +
                           " --no-eval --batch-size 32 --checkpoint " + tmp.str("ck");
  auto bf16 = run(base + " --quiet --max-steps 2 --precision bf16");
  REQUIRE_MESSAGE(bf16.exit_code == 0, bf16.output);
  const std::string ck = tmp.str("ck/checkpoint.safetensors");
  CHECK(load_checkpoint(ck).metadata.at("precision") == "bf16");

  const std::string said = "the checkpoint was trained in bf16; this run goes on in fp32 (give "
                           "--precision bf16 to keep it)";
  auto fp32 = run(base + " --max-steps 3 --precision fp32 --resume");
  REQUIRE_MESSAGE(fp32.exit_code == 0, fp32.output);
  CHECK_MESSAGE(fp32.output.find(said) != std::string::npos, fp32.output);
  CHECK(load_checkpoint(ck).metadata.at("precision") == "fp32");
  auto same = run(base + " --max-steps 4 --precision fp32 --resume");  // the same: nothing said
  REQUIRE_MESSAGE(same.exit_code == 0, same.output);
  CHECK(same.output.find("was trained in") == std::string::npos);

  // A checkpoint from before the field resumes as it did; a value not a precision is corrupt.
  Checkpoint c = load_checkpoint(ck);
  c.metadata.erase("precision");
  save_checkpoint(ck, c);
  auto older = run(base + " --max-steps 5 --precision bf16 --resume");
  REQUIRE_MESSAGE(older.exit_code == 0, older.output);
  CHECK(older.output.find("was trained in") == std::string::npos);
  c = load_checkpoint(ck);
  c.metadata["precision"] = "fp16";
  save_checkpoint(ck, c);
  expect_train_error("--data " + tmp.str("data") +
                         " --quiet --no-eval --batch-size 32 --max-steps 6 --resume --checkpoint " +
                         tmp.str("ck"),
                     "corrupt checkpoint: metadata 'precision' is 'fp16', not fp32, tf32 or bf16");
}
