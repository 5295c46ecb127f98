// replica-train as a user runs it: bad input gets one clear line and a non-zero exit (never a
// crash or a hang). (Outputs: test_outputs.cpp; resuming: test_resume.cpp.)
#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "env_guard.h"
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <numeric>
#include <tuple>

#include <nlohmann/json.hpp>

#include "engine/allocator.h"
#include "engine/context.h"
#include "engine/device.h"
#include "engine/env_switch.h"
#include "engine/error.h"

using test::kTrain;
using test::expect_train_error;
using test::run;
using namespace replica;

TEST_CASE("help and device listing succeed") {
  auto help = run(kTrain + " --help");
  CHECK(help.exit_code == 0);
  CHECK(help.output.find("--batch-size") != std::string::npos);
  auto list = run(kTrain + " --list-devices");
  CHECK(list.exit_code == 0);
  CHECK(list.output.find("cpu") != std::string::npos);
  // It prints and exits: a flag beside it would be ignored, so it is refused.
  expect_train_error("--list-devices --epochs 0",
                     "--list-devices prints the devices found and exits: it takes no other flag "
                     "(got --epochs)");
  expect_train_error("--print-config --list-devices", "it takes no other flag (got --print-config)");
}

TEST_CASE("bad flags and values are one-line errors") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  const std::string data = "--data " + tmp.str("data") + " --max-steps 1 --quiet";
  expect_train_error("--no-such-flag", "unknown flag --no-such-flag (see --help)");
  // A typo is named, with the flag it is closest to, even when the real flag is required.
  expect_train_error(data + " --devics cpu*2", "unknown flag --devics (did you mean --devices?)");
  expect_train_error(data + " --epoch=2", "unknown flag --epoch (did you mean --epochs?)");
  expect_train_error(data + " --batch 8", "unknown flag --batch (did you mean --batch-size?)");
  {
    auto r = run(test::bin("replica-sampler") + " --size 5 --replica 2");
    CHECK(r.exit_code == 2);
    CHECK(r.output == "replica-sampler: error: unknown flag --replica (did you mean --replicas?) "
                      "(see --help)\n");
  }
  expect_train_error(data + " --batch-size 0", "--batch-size");
  expect_train_error(data + " --batch-size abc", "--batch-size 'abc': expected a whole number");
  expect_train_error("--synthetic --num-classes 100000000 --max-steps 1 --quiet",
                     "a classifier of 100000000 classes: at most 1048576 (2^20)");
  expect_train_error(data + " --accumulate 99999999999",
                     "--accumulate '99999999999': the number is too large");
  expect_train_error("--synthetic --synthetic-size 256 --mode ddp --devices cpu*2 --batch-size 32 "
                     "--accumulate 100 --max-steps 1 --quiet",
                     "--accumulate 100: each rank's batch of 16 samples splits into at most 16");
  expect_train_error(data + " --lr fast", "--lr 'fast': expected a number");
  expect_train_error(data + " --lr -0.1", "learning rate");
  expect_train_error(data + " --lr nan", "learning rate");
  expect_train_error(data + " --model resnet7", "resnet7");
  expect_train_error(data + " --model transformer", "unknown model");
  expect_train_error(data + " --optimizer rmsprop", "rmsprop");
  expect_train_error(data + " --devices tpu", "unknown device");
  expect_train_error(data + " --devices cpu:0",
                     "CPU devices are counted, not numbered: cpu for one");
  expect_train_error(data + " --devices cuda:7", "GPU 7 does not exist");
  expect_train_error(data + " --devices cpu*0", "must be >= 1");
  expect_train_error(data + " --threads-per-device 0", "--threads-per-device");
  // CLI11's counts in words.
  expect_train_error(data + " --optimizer", "--optimizer needs a value");
  expect_train_error(data + " --batch-size 8 --batch-size 16",
                     "--batch-size is given 2 times: give it once");
  // Tens of thousands of threads made TBB's thread creation fail: std::terminate, no message.
  expect_train_error(data + " --threads-per-device 99999", "--threads-per-device 99999: give 1 to");
  expect_train_error(data + " --devices cuda:0,0", "cuda:0*N");
  expect_train_error(data + " --devices cpu*2*2", "not a number");
  expect_train_error(data + " --devices cpu*100000", "100000 virtual CPU devices");
  expect_train_error(data + " --devices cpu*1000", "at most");
  expect_train_error(data + " --devices cuda:99999999999", "GPU 99999999999 does not exist");
  expect_train_error(data + " --devices cuda:0,1*2", "single GPU");
  expect_train_error(data + " --precision fp16",
                     "unknown --precision 'fp16' (auto, fp32, tf32, bf16)");
  expect_train_error(data + " --devices cpu*2 --precision tf32", "needs CUDA devices");
  expect_train_error(data + " --devices cpu --cudnn-benchmark",
                     "--cudnn-benchmark needs a CUDA device");
  expect_train_error(data + " --cudnn-benchmark --deterministic",
                     "cannot be combined with --deterministic");
  expect_train_error(data + " --devices cpu --memory-format channels_last",
                     "--memory-format channels_last lays out cuDNN's operands: it needs CUDA");
  expect_train_error(data + " --devices cpu --cuda-graphs",
                     "--cuda-graphs captures a GPU's step: cpu:0 is not a CUDA device");
  expect_train_error(data + " --devices cpu*2 --cuda-graphs",
                     "--cuda-graphs captures one device's step");
  expect_train_error(data + " --mode ddp --devices cpu --cuda-graphs",
                     "--cuda-graphs captures one device's step");
  expect_train_error(data + " --memory-format nhwc",
                     "unknown --memory-format 'nhwc' (auto, nchw, channels_last)");
  expect_train_error(data + " --mode ps", "--mode");
  expect_train_error(data + " --data-placement gpu",
                     "--data-placement: expected auto, host or device");
  expect_train_error(data + " --reduce ring", "--reduce");
  expect_train_error(data + " --bucket-cap-mb 0", "--bucket-cap-mb");
  expect_train_error(data + " --epochs 0", "--epochs");
  expect_train_error(data + " --resume", "--checkpoint");
  expect_train_error("--synthetic --input-shape 3x0x4 --max-steps 1", "--input-shape");
  expect_train_error("--synthetic --input-shape banana --max-steps 1", "--input-shape");
  expect_train_error("--synthetic --input-shape 1x3x3 --max-steps 1",
                     "the model's layers shrink its input below one pixel");
  expect_train_error(data + " --momentum 0.9", "--momentum and --nesterov are SGD's");
  expect_train_error("--data " + tmp.str("data/train-images-idx3-ubyte") + " --max-steps 1",
                     "is a file: give the directory");
  // A FIFO where a data file should be: named as what it is, not as missing.
  test::fs::create_directories(tmp.path / "fifo-data");
  test::write_mnist_split(tmp.path / "fifo-data", "train", 16, 1);
  test::write_mnist_split(tmp.path / "fifo-data", "t10k", 16, 2);
  test::fs::remove(tmp.path / "fifo-data" / "t10k-labels-idx1-ubyte");
  REQUIRE(mkfifo(tmp.str("fifo-data/t10k-labels-idx1-ubyte").c_str(), 0600) == 0);
  expect_train_error("--data " + tmp.str("fifo-data") + " --max-steps 1",
                     "t10k-labels-idx1-ubyte (not a regular file)");
  // DDP: a bad flag every rank shares is one line from the launcher, exit code 2.
  expect_train_error(data + " --mode ddp --devices cpu*2 --model foo", "unknown model 'foo'");
  expect_train_error(data + " --mode ddp --devices cpu*2 --batch-size 5", "must divide by the 2");
  expect_train_error(data + " --mode ddp --devices cpu*2 --backend nccl",
                     "--backend nccl needs a GPU per rank");
  // A value CLI11 rejects takes the same path: one line for all ranks.
  expect_train_error(data + " --mode ddp --devices cpu*2 --epochs abc",
                     "--epochs 'abc': expected a whole number");
  // An empty value is not "not given".
  expect_train_error(data + " --devices ''", "--devices '': give a value");
  expect_train_error(data + " --trace ''", "--trace '': give a value");
  // A flag another mode or --synthetic would ignore.
  expect_train_error(data + " --backend gloo", "--backend applies to --mode ddp, not dp");
  expect_train_error(data + " --init-method file:///tmp/x", "--init-method applies to --mode ddp");
  expect_train_error(data + " --timeout 5", "--timeout applies to --mode ddp");
  expect_train_error(data + " --mode ddp --devices cpu*2 --reduce tree",
                     "--reduce applies to --mode dp, not ddp");
  expect_train_error(data + " --mode single --bucket-cap-mb 5",
                     "--bucket-cap-mb applies to --mode dp and ddp, not single");
  expect_train_error(data + " --synthetic-size 100", "--synthetic-size applies to --synthetic");
  expect_train_error(data + " --num-classes 3", "--num-classes applies to --synthetic");
  // A number past 64 bits is named as typed, not passed on as the largest int64.
  expect_train_error(data + " --batch-size 99999999999999999999",
                     "--batch-size '99999999999999999999': the number is too large");
  expect_train_error(data + " --num-classes 99999999999999999999", "--num-classes");
  for (const char* timeout : {"0", "-1", "nan", "inf", "1e30"}) {
    CAPTURE(timeout);
    expect_train_error(data + " --mode ddp --devices cpu*2 --timeout " + timeout,
                       "--timeout must be between 0.001 and 604800 seconds");
  }
}

TEST_CASE("environment switches: 1 on, 0 off, unset or empty the default, another word an error") {
  const char* name = "REPLICA_TEST_SWITCH";
  const test::EnvGuard guard({name});
  CHECK_FALSE(EnvSwitch(name, false).on());
  CHECK(EnvSwitch(name, true).on());
  for (const bool unset : {false, true}) {
    const EnvSwitch s(name, unset);
    setenv(name, "", 1);
    CHECK(s.on() == unset);
    setenv(name, "1", 1);
    CHECK(s.on());
    setenv(name, "0", 1);
    CHECK_FALSE(s.on());
  }
  for (const char* word : {"yes", "true", "off", "01", " 1"}) {
    setenv(name, word, 1);
    CHECK_THROWS_WITH_AS(EnvSwitch(name, false).on(),
                         fmt::format("REPLICA_TEST_SWITCH='{}': expected 1 (on) or 0 (off)", word)
                             .c_str(),
                         UsageError);
  }
  // A mistyped switch stops replica-train with the one line, before it trains: where it is read
  // (a DDP run's engine) or not (a GPU-only switch on a CPU run), and a misspelled name too.
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  const std::string data = "--data " + tmp.str("data") + " --max-steps 1 --quiet";
  const std::tuple<const char*, const char*, std::string> typos[] = {
      {"REPLICA_PREFETCH_ON_CPU", " --devices cpu*2", "REPLICA_PREFETCH_ON_CPU='on': expected"},
      {"REPLICA_DDP_CHECK_SYNC", " --mode ddp", "REPLICA_DDP_CHECK_SYNC='on': expected"},
      {"REPLICA_CUDA_SLICED_SUMS", "", "REPLICA_CUDA_SLICED_SUMS='on': expected"},
      {"REPLICA_PAD_CHANNEL", "", "REPLICA_PAD_CHANNEL is not a variable replica reads (did "
                                  "you mean REPLICA_PAD_CHANNELS?)"},
      {"REPLICA_RESIDUAL_SUMS", "", "(did you mean REPLICA_RESIDUAL_SUM?)"},
      {"REPLICA_CUDNN_API", "", "unknown cuDNN interface 'on' in REPLICA_CUDNN_API"}};
  for (const auto& [variable, where, said] : typos) {
    const test::ScopedEnv typo(variable, "on");
    expect_train_error(data + where, said);
  }
  // Every program checks them, and a variable of the tools' own (REPLICA_SKIP_BUILD) is no typo.
  {
    const test::ScopedEnv typo("REPLICA_CUDA_WIDE_INDX", "1");
    test::expect_clean_error("replica-launch", "--nproc-per-node 1 true",
                             "(did you mean REPLICA_CUDA_WIDE_INDEX?)");
  }
  const test::ScopedEnv tools_own("REPLICA_SKIP_BUILD", "1");
  const auto fine = run(kTrain + " " + data + " --no-eval");
  CHECK_MESSAGE(fine.exit_code == 0, fine.output);
}

TEST_CASE("a batch larger than the dataset is one batch of the whole dataset") {
  // 2^62 samples per batch: the loader allocates for the 64 samples there are (it crashed).
  auto r = run(kTrain + " --synthetic --synthetic-size 64 --max-steps 2 --quiet --no-eval"
                        " --devices cpu --batch-size 4611686018427387904",
               60);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
}

TEST_CASE("the step count ends the run: --max-steps on an epoch's end, a huge --epochs") {
  test::TempDir tmp;
  const auto summaries = [&](const std::string& flags) {
    const std::string json = tmp.str("m.json");
    auto r = run(kTrain + " --synthetic --synthetic-size 64 --batch-size 32 --devices cpu" +
                     " --quiet --metrics-json " + json + " " + flags,
                 60);
    REQUIRE_MESSAGE(r.exit_code == 0, r.output);
    std::ifstream in(json);
    const auto m = nlohmann::json::parse(in);
    std::vector<std::pair<int64_t, bool>> epochs;  // (steps, complete) of each epoch's line
    for (const auto& e : m["epoch_summaries"])
      epochs.emplace_back(e["steps"].get<int64_t>(), e["complete"].get<bool>());
    CHECK(m["steps"].get<int64_t>() == std::accumulate(epochs.begin(), epochs.end(), int64_t(0),
                                                       [](int64_t n, const auto& e) {
                                                         return n + e.first;
                                                       }));
    return epochs;
  };
  using Epochs = std::vector<std::pair<int64_t, bool>>;
  // 2 steps an epoch: --max-steps 2 is the first epoch, and nothing after it (it started an
  // empty second epoch that evaluated and checkpointed the same model again).
  CHECK(summaries("--epochs 3 --max-steps 2") == Epochs{{2, true}});
  CHECK(summaries("--epochs 3 --max-steps 3") == Epochs{{2, true}, {1, false}});
  // Epochs times steps past int64: the run is bounded by --max-steps (it overflowed, planned a
  // negative number of steps and trained none).
  CHECK(summaries("--epochs 4611686018427387904 --max-steps 3") == Epochs{{2, true}, {1, false}});
  expect_train_error("--synthetic --mode dp --devices cpu*2 --batch-per-device "
                     "4611686018427387904",
                     "--batch-per-device 4611686018427387904 times 2 devices is too large");
}

TEST_CASE("training files only: --no-eval trains, evaluation names what is missing") {
  test::TempDir tmp;
  test::fs::create_directories(tmp.path / "data");
  test::write_mnist_split(tmp.path / "data", "train", 64, 1);
  const std::string args = " --data " + tmp.str("data") + " --devices cpu --max-steps 2 --quiet";
  auto r = run(kTrain + args + " --no-eval", 60);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  expect_train_error(args, "missing 2 of the 4 MNIST-format files needed: t10k-images");
}

TEST_CASE("bad data directories are one-line errors") {
  test::TempDir tmp;
  expect_train_error("--data " + tmp.str("missing") + " --max-steps 1", "does not exist");
  test::fs::create_directories(tmp.path / "empty");
  expect_train_error("--data " + tmp.str("empty") + " --max-steps 1", "train-images-idx3-ubyte");

  test::write_mnist_dir(tmp.path / "trunc", 64, 16);
  const auto images = tmp.path / "trunc" / "train-images-idx3-ubyte";
  test::fs::resize_file(images, 2000);
  expect_train_error("--data " + tmp.str("trunc") + " --max-steps 1", "truncated");

  test::write_mnist_dir(tmp.path / "garbage", 64, 16);
  {
    std::ofstream g(tmp.path / "garbage" / "train-labels-idx1-ubyte", std::ios::binary);
    g << "this is not an IDX file at all, just text";
  }
  expect_train_error("--data " + tmp.str("garbage") + " --max-steps 1", "train-labels");

  // A test label past the training classes: named before training, not a NaN test loss after.
  test::write_mnist_dir(tmp.path / "labels", 64, 16);
  {
    std::fstream l(tmp.path / "labels" / "t10k-labels-idx1-ubyte",
                   std::ios::binary | std::ios::in | std::ios::out);
    l.seekp(8 + 3);  // after the IDX header: the fourth test label
    l.put(char(200));
  }
  expect_train_error("--data " + tmp.str("labels") + " --max-steps 1",
                     "the test labels go up to 200, the training labels to 9");
}

TEST_CASE("--lr-schedule step:N:GAMMA decays by epochs, as StepLR; each epoch records its lr") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 96, 32);  // 3 steps an epoch at batch 32
  auto r = run(kTrain + " --data " + tmp.str("data") + " --batch-size 32 --epochs 5 --quiet" +
               " --no-eval --threads-per-device 1 --lr 0.01 --lr-schedule step:2:0.5" +
               " --metrics-json " + tmp.str("m.json"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  std::ifstream in(tmp.str("m.json"));
  const auto m = nlohmann::json::parse(in);
  const double want[5] = {0.01, 0.01, 0.005, 0.005, 0.0025};
  for (int e = 0; e < 5; ++e) {
    CAPTURE(e);
    CHECK(m["epoch_summaries"][size_t(e)]["lr"].get<double>() == doctest::Approx(want[e]));
  }
  expect_train_error("--data " + tmp.str("data") + " --lr-schedule step:0",
                     "--lr-schedule 'step:0': step:N[:GAMMA] needs N");
}

TEST_CASE("--precision: CPU devices compute in fp32 or bf16, and the run says which it used") {
  const std::vector<Device> cpus = parse_devices("cpu*2");
  CHECK(resolve_precision("auto", cpus) == Precision::Fp32);
  CHECK(resolve_precision("fp32", cpus) == Precision::Fp32);
  CHECK(resolve_precision("bf16", cpus) == Precision::Bf16);
  CHECK_THROWS_AS(resolve_precision("tf32", cpus), UsageError);
  CHECK_THROWS_AS(resolve_precision("", cpus), UsageError);
  CHECK_THROWS_AS(DeviceContext(cpus[0], ContextOptions{1, false, Precision::Tf32}), UsageError);

  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  auto r = run(kTrain + " --data " + tmp.str("data") + " --devices cpu --max-steps 2 --no-eval" +
               " --threads-per-device 1 --metrics-json " + tmp.str("m.json"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(r.output.find("(dp mode, fp32)") != std::string::npos);
  std::ifstream in(tmp.str("m.json"));
  const auto m = nlohmann::json::parse(in);
  CHECK(m["precision"] == "fp32");
  CHECK(m["config"]["precision"] == "auto");

  // bf16 reaches every DDP rank (the launcher passes the flag on) and the run's metrics.
  r = run(kTrain + " --data " + tmp.str("data") + " --mode ddp --devices cpu*2 --max-steps 2" +
          " --no-eval --threads-per-device 1 --precision bf16 --metrics-json " + tmp.str("b.json"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(r.output.find("(ddp mode, bf16, ") != std::string::npos);
  std::ifstream in_bf16(tmp.str("b.json"));
  const auto b = nlohmann::json::parse(in_bf16);
  CHECK(b["precision"] == "bf16");
}
