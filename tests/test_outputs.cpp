// replica-train's outputs as a user meets them: the metrics carry the documented fields, the
// trace its spans; outputs are checked before training starts (an unwritable one fails in
// seconds), written through a symbolic link or into a pipe without replacing it, and a
// checkpoint a killed run left half-written is cleaned up by the next run.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "engine/checkpoint.h"

using test::kTrain;
using test::expect_train_error;
using test::run;
using namespace replica;


TEST_CASE("outputs through a symbolic link or into a pipe: the link and the pipe stay") {
  test::TempDir tmp;
  const std::string run_args = kTrain + " --synthetic --synthetic-size 64 --batch-size 8" +
                               " --max-steps 2 --quiet --no-eval --devices cpu";
  // A link: its target is written, the link stays a link.
  test::fs::create_symlink("target.json", tmp.path / "link.json");
  test::fs::create_symlink("model.safetensors", tmp.path / "model-link");
  auto r = run(run_args + " --metrics-json " + tmp.str("link.json") + " --save-model " +
               tmp.str("model-link"), 60);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::fs::is_symlink(tmp.path / "link.json"));
  CHECK(test::fs::is_symlink(tmp.path / "model-link"));
  std::ifstream metrics(tmp.str("target.json"));
  CHECK(nlohmann::json::parse(metrics)["steps"] == 2);
  CHECK(load_checkpoint(tmp.str("model.safetensors")).tensors.size() > 0);
  // A pipe (as /dev/stdout can be): written into, not renamed over.
  const std::string fifo = tmp.str("pipe");
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  r = run("sh -c 'cat " + fifo + " > " + tmp.str("from-pipe") + " & " + run_args +
          " --metrics-json " + fifo + "; rc=$?; wait; exit $rc'", 60);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::fs::is_fifo(fifo));
  std::ifstream piped(tmp.str("from-pipe"));
  CHECK(nlohmann::json::parse(piped)["steps"] == 2);
}

TEST_CASE("/dev/stdout and /dev/fd/N: the output follows what the descriptor already holds") {
  test::TempDir tmp;
  const std::string run_args = kTrain + " --synthetic --synthetic-size 64 --batch-size 8" +
                               " --max-steps 2 --no-eval --devices cpu";
  // The metrics (printed with two-space indents) from what the run wrote, after its progress.
  const auto metrics_after_progress = [](const std::string& text) {
    CHECK(text.rfind("replica: cnn", 0) == 0);  // the first line survived
    const size_t open = text.find("\n{\n"), close = text.find("\n}\n", open);
    REQUIRE(open != std::string::npos);
    REQUIRE(close != std::string::npos);
    CHECK(text.find("epoch 1 ended") < open);
    return nlohmann::json::parse(text.substr(open + 1, close + 2 - open - 1));
  };
  // Stdout redirected to a file: the metrics go after the progress lines (the file was renamed
  // over, the progress lost).
  auto r = run("sh -c '" + run_args + " --metrics-json /dev/stdout > " + tmp.str("out.txt") + "'",
               60);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(metrics_after_progress(test::read_text(tmp.str("out.txt")))["steps"] == 2);
  // Stdout a pipe (it failed after training: "cannot write '/dev/stdout'").
  r = run("sh -c '" + run_args + " --metrics-json /dev/stdout | cat > " + tmp.str("piped.txt") +
              "'",
          60);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(metrics_after_progress(test::read_text(tmp.str("piped.txt")))["steps"] == 2);
  // Another descriptor, given by the shell.
  r = run("sh -c '" + run_args + " --metrics-json /dev/fd/3 3> " + tmp.str("fd3.json") + "'", 60);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(nlohmann::json::parse(test::read_text(tmp.str("fd3.json")))["steps"] == 2);
  // A descriptor not open for writing is refused before training (one this process has not
  // open, so neither has the run it starts).
  int closed = 3;
  while (fcntl(closed, F_GETFD) != -1) ++closed;
  const std::string name = "/dev/fd/" + std::to_string(closed);
  expect_train_error("--synthetic --devices cpu --metrics-json " + name,
                     "--metrics-json '" + name + "': descriptor " + std::to_string(closed) +
                         " is not open for writing");
  // Weights are a file of their own: a stream the run prints to, or that --save-best would
  // write every better model into, is refused.
  expect_train_error("--synthetic --devices cpu --save-model /dev/stdout",
                     "--save-model '/dev/stdout': weights are written to a file of their own");
}

TEST_CASE("an output that cannot be written fails before training, in seconds") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  const std::string data = "--data " + tmp.str("data") + " --devices cpu --max-steps 5 --quiet ";
  const std::string missing = tmp.str("missing-dir");
  for (const char* flag : {"--metrics-json", "--trace", "--save-model"}) {
    CAPTURE(flag);
    const auto start = std::chrono::steady_clock::now();
    expect_train_error(data + flag + " " + missing + "/out.json", "does not exist");
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  }
  expect_train_error(data + "--metrics-json " + tmp.str(""), "is a directory");
  expect_train_error(data + "--save-model " + tmp.str("data/train-images-idx3-ubyte") + "/m",
                     "train-images-idx3-ubyte' is not a directory");
  // The bench checks its outputs before it measures anything.
  auto r = run(test::bin("replica-bench") + " --suite dp --json " + missing + "/rows.jsonl", 30);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("does not exist") != std::string::npos);
  CHECK_FALSE(test::fs::exists(missing));
}

// Every output is written whole over what was there and the run exits 0: two outputs on one
// file kept only the last, and an output naming a dataset file or the checkpoint replaced it.
// Now each is refused before the run starts, and the files are as they were.
TEST_CASE("outputs that are each other, the checkpoint or a file of --data are refused") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  test::fs::create_directories(tmp.path / "ck");
  const std::string images = tmp.str("data/train-images-idx3-ubyte");
  const std::string before = test::read_text(images);
  const std::string data = "--data " + tmp.str("data") + " --devices cpu --max-steps 1 --quiet ";
  const std::string out = tmp.str("out.json");
  // Another spelling of the same file, and a link to it, are the same file.
  REQUIRE(::symlink(out.c_str(), tmp.str("link.json").c_str()) == 0);
  expect_train_error(data + "--metrics-json " + out + " --trace " + tmp.str("./out.json"),
                     "--metrics-json and --trace name the same file");
  {
    std::ofstream(out) << "{}";
  }
  expect_train_error(data + "--save-model " + out + " --metrics-json " + tmp.str("link.json"),
                     "--save-model and --metrics-json name the same file");
  expect_train_error(data + "--save-best " + out + " --save-model " + out,
                     "--save-best and --save-model name the same file");
  expect_train_error(data + "--checkpoint " + tmp.str("ck") + " --save-model " +
                         tmp.str("ck/checkpoint.safetensors"),
                     "is the file that --checkpoint '" + tmp.str("ck") + "' keeps");
  for (const char* flag : {"--save-model", "--metrics-json", "--trace"}) {
    CAPTURE(flag);
    expect_train_error(data + flag + " " + images, "would replace a file of --data");
  }
  expect_train_error(data + "--trace " + tmp.str("data/../data/train-labels-idx1-ubyte"),
                     "would replace a file of --data");
  CHECK(test::read_text(images) == before);
  CHECK(test::read_text(out) == "{}");
  CHECK_FALSE(test::fs::exists(tmp.path / "ck/checkpoint.safetensors"));
  test::expect_clean_error("replica-data", "--data " + tmp.str("data") + " --out " + images,
                           "--out '" + images + "' would replace a file of --data");
  CHECK(test::read_text(images) == before);
  test::expect_clean_error("replica-bench", "--suite dp --json " + out + " --csv " + out,
                           "--json and --csv name the same file");
  CHECK(test::read_text(out) == "{}");
  // Shared in place, a device or a descriptor is not a conflict; a new file beside the data is
  // no file of the data.
  const auto r = run(kTrain + " " + data + "--save-model /dev/null --metrics-json /dev/null "
                         "--trace " + tmp.str("data/trace.json"), 120);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  // Run again: the first run's trace is now a file in --data, but not one the data is read from.
  const auto again = run(kTrain + " " + data + "--trace " + tmp.str("data/trace.json"), 120);
  CHECK_MESSAGE(again.exit_code == 0, again.output);
}

TEST_CASE("a checkpoint left half-written by a killed run is cleaned up by the next run") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 64, 16);
  test::fs::create_directories(tmp.path / "ck");
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string stale = tmp.str("ck/checkpoint.safetensors.tmp-") + std::to_string(dead);
  test::put_bytes(stale, {0, 1, 2, 3});
  auto r = run(kTrain + " --data " + tmp.str("data") + " --devices cpu --max-steps 2 --quiet" +
                   " --no-eval --checkpoint " + tmp.str("ck"),
               120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK_FALSE(test::fs::exists(stale));
  CHECK(test::fs::exists(tmp.path / "ck" / "checkpoint.safetensors"));
}

TEST_CASE("a short run writes metrics with the documented fields") {
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 256, 64);
  auto r = run(kTrain + " --data " + tmp.str("data") + " --batch-size 32 --epochs 2 --quiet" +
               " --threads-per-device 1 --metrics-json " + tmp.str("m.json") + " --trace " +
               tmp.str("t.json"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  std::ifstream in(tmp.str("m.json"));
  auto m = nlohmann::json::parse(in);
  for (const char* key : {"model", "mode", "devices", "steps", "epochs", "samples_per_sec",
                          "final_loss", "test_accuracy", "test_loss", "peak_memory_bytes"})
    CHECK_MESSAGE(m.contains(key), key);
  CHECK(m["steps"] == 16);
  CHECK(m["epochs"] == 2);
  // The first step is timed apart: samples/s counts the 15 steps after it.
  REQUIRE(m["first_step_excluded"] == true);
  const auto& e1 = m["epoch_summaries"][0];
  const double first = m["first_step_seconds"].get<double>();
  CHECK(e1["first_step_seconds"] == first);
  CHECK_FALSE(m["epoch_summaries"][1].contains("first_step_seconds"));
  CHECK(e1["samples_per_sec"].get<double>() ==
        doctest::Approx(224.0 / (e1["seconds"].get<double>() - first)).epsilon(0.02));
  CHECK(m["samples_per_sec"].get<double>() ==
        doctest::Approx(480.0 / (m["train_seconds"].get<double>() - first)).epsilon(0.02));
  CHECK(m["peak_memory_bytes"].size() == m["devices"].size());
  CHECK(m["peak_memory_bytes"][0].get<double>() > 0);
  REQUIRE(m["peak_held_bytes"].size() == m["devices"].size());
  CHECK(m["peak_held_bytes"][0].get<double>() >= m["peak_memory_bytes"][0].get<double>());
  REQUIRE(m["forward_kept_bytes"].size() == m["devices"].size());
  CHECK(m["forward_kept_bytes"][0].get<double>() > 0);
  CHECK(m["forward_kept_bytes"][0].get<double>() < m["peak_memory_bytes"][0].get<double>());
  // The synthetic bands are easy: two epochs learn them.
  CHECK(m["test_accuracy"].get<double>() > 0.5);
  std::ifstream tin(tmp.str("t.json"));
  auto trace = nlohmann::json::parse(tin);
  CHECK(trace["traceEvents"].size() > 16 * 3);
}
