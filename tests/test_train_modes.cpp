// replica-train's strategies and presets as a user runs them: `--mode ddp` without a launcher
// starts its ranks itself, DP and DDP with the same seed reach the same accuracy, presets set
// their recipe and every flag given with them overrides it.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "engine/checkpoint.h"

using test::kTrain;
using test::read_json;
using test::run;

namespace {

const char* kFashion = "/usr/share/datasets/fashion-mnist";

nlohmann::json config_of(const std::string& args) {
  auto r = run(kTrain + " " + args + " --print-config", 30);
  INFO(args << "\n" << r.output);
  REQUIRE(r.exit_code == 0);
  return nlohmann::json::parse(r.output);
}

}  // namespace

TEST_CASE("presets set their recipe; flags given with them override it") {
  auto seed = config_of("--preset seed");
  CHECK(seed["model"] == "resnet101");
  CHECK(seed["mode"] == "ddp");
  CHECK(seed["optimizer"] == "adam");
  CHECK(seed["lr"] == 0.001);
  CHECK(seed["batch_per_device"] == 256);
  CHECK(seed["epochs"] == 10);
  CHECK(seed["log_every"] == 10);
  CHECK(seed["save_model"] == "resnet101.safetensors");

  auto cnn = config_of("--preset cnn-sgd");
  CHECK(cnn["model"] == "cnn");
  CHECK(cnn["optimizer"] == "sgd");
  CHECK(cnn["lr"] == 0.001);
  CHECK(cnn["momentum"] == 0.9);

  auto syn = config_of("--preset resnet18-synthetic");
  CHECK(syn["model"] == "resnet18");
  CHECK(syn["synthetic"] == true);
  CHECK(syn["synthetic_size"] == 10000);
  CHECK(syn["input_shape"] == "3x224x224");
  CHECK(syn["num_classes"] == 9);
  CHECK(syn["batch_per_device"] == 2);

  // PyTorch's ImageNet example; its data are the user's image folder.
  auto imagenet = config_of(std::string("--preset imagenet --data ") + kFashion);
  CHECK(imagenet["model"] == "resnet18");
  CHECK(imagenet["mode"] == "ddp");
  CHECK(imagenet["batch_size"] == 256);
  CHECK(imagenet["optimizer"] == "sgd");
  CHECK(imagenet["lr"] == 0.1);
  CHECK(imagenet["momentum"] == 0.9);
  CHECK(imagenet["weight_decay"] == 0.0001);
  CHECK(imagenet["lr_schedule"] == "step:30");
  CHECK(imagenet["epochs"] == 90);
  CHECK(imagenet["checkpoint"] == "checkpoint");
  CHECK(imagenet["save_best"] == "model_best.safetensors");
  auto no_data = run(kTrain + " --preset imagenet", 30);
  CHECK(no_data.exit_code == 2);
  CHECK(no_data.output.find("give --data DIR: --preset imagenet reads an image folder") !=
        std::string::npos);

  // Overrides, before or after the preset.
  auto o = config_of("--epochs 1 --preset seed --lr 0.01 --mode dp --batch-size 64");
  CHECK(o["epochs"] == 1);
  CHECK(o["lr"] == 0.01);
  CHECK(o["mode"] == "dp");
  CHECK(o["batch_size"] == 64);
  CHECK(o["batch_per_device"] == 0);
  CHECK(o["model"] == "resnet101");
  auto d = config_of(std::string("--preset resnet18-synthetic --data ") + kFashion);
  CHECK(d["synthetic"] == false);

  auto bad = run(kTrain + " --preset nope", 30);
  CHECK(bad.exit_code == 2);
  CHECK(bad.output.find("unknown --preset 'nope' (known: seed, cnn-sgd, resnet18-synthetic, "
                        "imagenet)") != std::string::npos);
  auto both = run(kTrain + " --batch-size 8 --batch-per-device 4", 30);
  CHECK(both.exit_code == 2);
  CHECK(both.output.find("not both") != std::string::npos);
}

// What --print-config prints is a configuration a run accepts: replica-dp-vs-ddp checks its
// runs' flags with it, before minutes of the first run.
TEST_CASE("--print-config refuses what a run refuses, with the run's line") {
  for (const auto& [args, said] : std::vector<std::pair<std::string, std::string>>{
           {"--synthetic --lr -1", "learning rate must be a positive number, got -1"},
           {"--synthetic --lr nan", "learning rate must be a positive number, got nan"},
           {"--synthetic --optimizer sgd --momentum 1", "momentum must be in [0, 1), got 1"},
           {"--synthetic --weight-decay -0.1", "must be a finite number >= 0, got -0.1"},
           {"--synthetic --weight-decay inf", "must be a finite number >= 0, got inf"},
           {"--synthetic --num-classes 1", "--num-classes must be at least 2"},
           {"--synthetic --devices cpu --cudnn-benchmark", "cpu:0 has no cuDNN: --cudnn-benchmark"},
           {"--synthetic --mode ddp --devices cpu*2 --batch-size 3",
            "--batch-size 3 is the global batch: it must divide by the 2 ranks"},
           {"--synthetic --optimizer sgd --nesterov", "nesterov needs a momentum > 0"},
           {"--synthetic --optimizer lamb", "unknown optimizer 'lamb' (sgd, adam)"},
           {"--synthetic --optimizer lamb --momentum 0.9", "unknown optimizer 'lamb'"},
           {"--synthetic --optimizer adam --momentum 0.9", "are SGD's"},
           // The model's layout, the micro-batches and the init method's syntax: said by the
           // model, the engine and the rendezvous before, once minutes of a run had gone by.
           {"--synthetic --num-classes 99999999999",
            "a classifier of 99999999999 classes: at most 1048576"},
           {"--synthetic --input-shape 1x2x2",
            "the model's layers shrink its input below one pixel"},
           {"--synthetic --mode ddp --devices cpu*2 --accumulate 64",
            "--accumulate 64: each rank's batch of 16 samples splits into at most 16"},
           {"--synthetic --mode ddp --devices cpu*2 --init-method foo://",
            "unknown init method 'foo://'"},
           {"--synthetic --mode ddp --devices cpu*2 --init-method tcp://host",
            "init method 'tcp://host': expected tcp://HOST:PORT"},
           {"--synthetic --mode ddp --devices cpu*2 --init-method tcp://127.0.0.1:99999",
            "master port 99999 is out of range (1-65535)"}}) {
    test::expect_train_error(args + " --print-config", said);
    test::expect_train_error(args + " --max-steps 1 --quiet", said);
  }
  // A switch a ResNet reads, set wrong, is refused by a CNN's run and --print-config alike.
  auto r = run("env REPLICA_RESIDUAL_SUM=mul " + kTrain + " --synthetic --print-config");
  CHECK(r.exit_code == 2);
  CHECK(r.output == "replica-train: error: REPLICA_RESIDUAL_SUM='mul': expected conv or add\n");
}

TEST_CASE("--preset seed trains ResNet-101 with DDP and rank 0 saves the model") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  // The recipe with a small batch and two steps: DDP on 2 ranks, started by replica-train.
  auto r = run(kTrain + " --preset seed --data " + tmp.str("data") +
                   " --devices cpu*2 --batch-per-device 2 --max-steps 2 --no-eval --save-model " +
                   tmp.str("model.safetensors") + " --metrics-json " + tmp.str("m.json"),
               300);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("starting 2 ranks") != std::string::npos);
  const auto m = read_json(tmp.str("m.json"));
  CHECK(m["mode"] == "ddp");
  CHECK(m["world_size"] == 2);
  CHECK(m["batch_size"] == 4);  // 2 per rank
  CHECK(m["model"] == "resnet101");
  // Every rank's memory, gathered by rank 0: bytes in use at the peak, and held (with the cache).
  REQUIRE(m["peak_memory_bytes"].size() == 2);
  REQUIRE(m["peak_held_bytes"].size() == 2);
  CHECK(m["peak_memory_devices"] == nlohmann::json({"rank 0 cpu:0", "rank 1 cpu:1"}));
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(m["peak_memory_bytes"][rank].get<double>() > 0);
    CHECK(m["peak_held_bytes"][rank].get<double>() >= m["peak_memory_bytes"][rank].get<double>());
  }
  auto saved = replica::load_checkpoint(tmp.str("model.safetensors"));
  const replica::Tensor* conv1 = saved.find("conv1.weight");
  REQUIRE(conv1 != nullptr);
  CHECK(conv1->shape() == replica::Shape{64, 1, 7, 7});  // the article's 1-channel stem
  const replica::Tensor* fc = saved.find("fc.weight");
  REQUIRE(fc != nullptr);
  CHECK(fc->shape() == replica::Shape{10, 2048});
  CHECK(saved.find("layer4.2.bn3.running_var") != nullptr);
  CHECK(saved.metadata.at("format") == "replica-model-v1");
}

TEST_CASE("--mode dp and --mode ddp on 2 CPU devices, same seed: accuracies within 1 point") {
  if (!std::filesystem::exists(std::string(kFashion) + "/t10k-labels-idx1-ubyte.gz") &&
      !std::filesystem::exists(std::string(kFashion) + "/t10k-labels-idx1-ubyte")) {
    MESSAGE("SKIPPED: Fashion-MNIST not installed (tools/setup.sh installs it)");
    return;
  }
  test::TempDir tmp;
  const std::string common = kTrain + " --devices cpu*2 --threads-per-device 1 --seed 5" +
                             " --max-steps 400 --quiet --metrics-json ";
  auto dp = run(common + tmp.str("dp.json") + " --mode dp", 300);
  REQUIRE_MESSAGE(dp.exit_code == 0, dp.output);
  auto ddp = run(common + tmp.str("ddp.json") + " --mode ddp", 300);
  REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  const auto a = read_json(tmp.str("dp.json")), b = read_json(tmp.str("ddp.json"));
  CHECK(a["mode"] == "dp");
  CHECK(b["mode"] == "ddp");
  CHECK(b["world_size"] == 2);
  const double acc_dp = a["test_accuracy"], acc_ddp = b["test_accuracy"];
  MESSAGE("test accuracy after 400 steps: dp " << acc_dp << ", ddp " << acc_ddp);
  CHECK(acc_dp > 0.75);
  CHECK(std::abs(acc_dp - acc_ddp) <= 0.01);
  // DP's device and DDP's rank each run the forward on 16 of the 32 samples: the same bytes kept
  // for backward.
  REQUIRE(a["forward_kept_bytes"].size() == 2);
  CHECK(a["forward_kept_bytes"][0].get<int64_t>() > 0);
  CHECK(a["forward_kept_bytes"] == b["forward_kept_bytes"]);
}

TEST_CASE("replica-dp-vs-ddp prints both strategies side by side; bad flags are one line") {
  // A flag of one mode goes to that mode's run only (replica-train refuses it in the other); a
  // preset that writes no file is the runs' recipe.
  auto r = run(test::bin("replica-dp-vs-ddp") +
                   " --devices cpu*2 --steps 20 -- --preset cnn-sgd --synthetic"
                   " --synthetic-size 640 --no-eval"
                   " --reduce tree --timeout=60 --backend gloo",
               300);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("DP on cpu*2, DDP on 2 ranks") != std::string::npos);
  CHECK(r.output.find("DDP/DP = ") != std::string::npos);
  CHECK(r.output.find("gradient sync, ms/step") != std::string::npos);
  CHECK(r.output.find("peak memory, device 0") != std::string::npos);
  for (const char* bad : {" --steps 0", " -- --mode single", " -- --model nope"}) {
    auto b = run(test::bin("replica-dp-vs-ddp") + bad, 60);
    CAPTURE(bad);
    CHECK(b.exit_code != 0);
    CHECK(b.output.find("error: ") != std::string::npos);
  }
  // Flags it sets itself, or that make a run print rather than train (--print-config ended in
  // a JSON parse error), are refused by name.
  for (const auto& [bad, said] : std::vector<std::pair<std::string, std::string>>{
           {" -- --print-config", "--print-config makes replica-train print instead of train"},
           {" -- --list-devices", "--list-devices makes replica-train print instead of train"},
           {" -- --max-steps 3", "give --steps N before --"},
           {" -- --metrics-json=m.json", "--metrics-json is set by"},
           {" -- --help", "--help makes replica-train print"},
           // Both runs would write the same file, the DDP run's over the DP run's, or the DDP
           // run would resume from the checkpoint the DP run had written and train nothing.
           {" -- --checkpoint ck --resume", "--checkpoint would be written by both runs"},
           {" -- --resume", "--resume would resume both runs from one checkpoint"},
           {" -- --save-model m.safetensors", "--save-model would be written by both runs"},
           {" -- --save-best=b.safetensors", "--save-best would be written by both runs"},
           {" -- --trace t.json", "--trace would be written by both runs"},
           {" -- --preset seed", "--preset seed sets --save-model resnet101.safetensors"},
           {" -- --preset=imagenet --data d", "--preset imagenet sets --checkpoint checkpoint"}}) {
    CAPTURE(bad);
    test::expect_clean_error("replica-dp-vs-ddp", bad, said);
  }
  // replica-train's flags are checked before the first run starts: one line, exit 2.
  auto typo = run(test::bin("replica-dp-vs-ddp") + " --device cpu*2", 60);
  CHECK(typo.exit_code == 2);
  CHECK(typo.output == "replica-dp-vs-ddp: error: for replica-train: unknown flag --device (did "
                       "you mean --devices?) (see --help)\n");
  // Its own flags: a typo is offered its own nearest flag, a bad value is named as a bad value
  // (not as the replica-train flags after it).
  auto own = run(test::bin("replica-dp-vs-ddp") + " --step 10", 60);
  CHECK(own.exit_code == 2);
  CHECK(own.output == "replica-dp-vs-ddp: error: unknown flag --step (did you mean --steps?) "
                      "(see --help)\n");
  auto value = run(test::bin("replica-dp-vs-ddp") + " --steps abc -- --epochs 2", 60);
  CHECK(value.exit_code == 2);
  CHECK(value.output.find("--steps") != std::string::npos);
  CHECK(value.output.find("unknown flag") == std::string::npos);
}

TEST_CASE("replica-dp-vs-ddp: a log directory it cannot make is one line naming it and why") {
  test::TempDir tmp;
  const std::string none = tmp.str("none");
  auto r = run("env TMPDIR=" + none + " " + test::bin("replica-dp-vs-ddp") + " --steps 2", 60);
  CHECK(r.exit_code == 1);
  CHECK(r.output == "replica-dp-vs-ddp: error: cannot make a temporary directory for the runs' "
                    "logs: TMPDIR=" + none + " does not exist\n");
  // --keep-logs keeps them in ./dp-vs-ddp/, where a file of that name is in the way here.
  test::put_bytes(tmp.str("dp-vs-ddp"), {1});
  r = run("sh -c 'cd " + tmp.str() + " && " + test::bin("replica-dp-vs-ddp") +
              " --steps 2 --keep-logs'",
          60);
  CHECK(r.exit_code == 1);
  CHECK(r.output == "replica-dp-vs-ddp: error: cannot make ./dp-vs-ddp for the runs' logs "
                    "(--keep-logs): a file of that name is in the way\n");
}

TEST_CASE("replica-dp-vs-ddp: a run whose metrics lack a figure is one line naming both") {
  // replica-train, but the DDP run's metrics say null for its loss, as a run that trained no
  // step wrote it; replica-dp-vs-ddp runs the replica-train beside it.
  test::TempDir tmp;
  const std::string program = tmp.str("replica-dp-vs-ddp");
  std::filesystem::copy_file(test::bin("replica-dp-vs-ddp"), program);
  {
    std::ofstream train(tmp.str("replica-train"));
    train << "#!/bin/sh\n"
          << kTrain << " \"$@\" || exit\n"
          << "mode= metrics=\n"
          << "while [ $# -gt 0 ]; do\n"
          << "  case $1 in --mode) mode=$2 ;; --metrics-json) metrics=$2 ;; esac\n"
          << "  shift\n"
          << "done\n"
          << "if [ \"$mode\" = ddp ] && [ -n \"$metrics\" ]; then\n"
          << "  sed -i 's/\"final_loss\": .*,$/\"final_loss\": null,/' \"$metrics\"\n"
          << "fi\n";
  }
  std::filesystem::permissions(tmp.str("replica-train"), std::filesystem::perms::owner_all);
  auto r = run(program + " --devices cpu*2 --steps 2 -- --synthetic --synthetic-size 64 --no-eval",
               120);
  CHECK(r.exit_code == 1);
  // The runs' lines, then the error, and no part of the table ("type must be number, but is
  // null" came after half of it).
  CHECK(r.output == "running replica-train --mode dp ...\nrunning replica-train --mode ddp ...\n"
                    "replica-dp-vs-ddp: error: the DDP run (replica-train --mode ddp) reported "
                    "no final_loss, so the runs cannot be compared\n");
}

TEST_CASE("replica-dp-vs-ddp: the header says the steps the runs took, and why they are fewer") {
  // 64 samples in batches of 32: an epoch is 2 steps, and replica-train's runs end with their
  // epochs (1 unless given) when those come first (the header said "99999999999 steps").
  const std::string runs = test::bin("replica-dp-vs-ddp") + " --devices cpu*2 --steps ";
  const std::string flags = " -- --synthetic --synthetic-size 64 --no-eval";
  auto r = run(runs + "99999999999" + flags, 120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::contains(r.output, "cnn, global batch 32, 2 steps (all of 1 epoch, fewer than "
                                 "--steps 99999999999: -- --epochs N trains more), seed 0;"));
  r = run(runs + "3" + flags + " --epochs 2", 120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::contains(r.output, "cnn, global batch 32, 3 steps, seed 0;"));
}

TEST_CASE("replica-dp-vs-ddp: a stop signal ends the run in progress and removes the logs") {
  // SIGTERM to replica-dp-vs-ddp alone (a Ctrl-C reaches its run as well): passed on to the run,
  // one line, 128 + the signal, and the temporary folder of the runs' logs removed (it stayed).
  test::TempDir tmp;
  const std::string command = "env TMPDIR=" + tmp.str() + " " + test::bin("replica-dp-vs-ddp") +
                              " --devices cpu*2 --steps 100000 -- --synthetic --epochs 1000 "
                              "--no-eval";
  auto r = run("sh -c '" + command + " & pid=$!; sleep 3; kill -TERM $pid; wait $pid; " +
                   "echo exit $?'",
               120);
  INFO(r.output);
  CHECK(test::contains(r.output, "replica-dp-vs-ddp: stopped by SIGTERM: the runs were not "
                                 "compared\nexit 143\n"));
  CHECK(std::filesystem::is_empty(tmp.path));
  // Without the mend the run went on alone (for 1,000 epochs): not past this test.
  run("pkill -A -f " + tmp.str("replica-dp-vs-ddp-"), 10);
}
