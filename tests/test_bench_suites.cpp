// replica-bench's other suites and its failures: the loader's rate per thread count, the ops
// suite op by op and by shape, bf16 rows on a CPU device; bad input as one line, --json writes
// that never lose earlier rows, a dead or stuck DDP rank ending the run with an error, and the
// PyTorch script's message when PyTorch is missing.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_helpers.h"

using namespace test;
using doctest::Approx;

namespace {

// A short `--suite ops` run on one CPU device with `flags` added: its JSON rows, its output in
// `output`. The run must succeed.
std::vector<nlohmann::json> ops_rows(const std::string& flags, std::string* output) {
  TempDir tmp;
  const auto r = run(kBench + " --suite ops --devices cpu --batch 8 --warmup 1 "
                              "--threads-per-device 1 --json " +
                         tmp.str("ops.jsonl") + " " + flags,
                     120);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  *output = r.output;
  return read_json_lines(tmp.str("ops.jsonl"));
}

void expect_clean_error(const std::string& args, const std::string& must_contain) {
  test::expect_clean_error("replica-bench", args, must_contain);
}

}  // namespace

TEST_CASE("replica-bench --suite loader: the input pipeline's rate per thread count") {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --suite loader --input-shape 3x32x32 --batch 8 --warmup 1 "
                                    "--steps 3 --repeat 1 --threads 1,2 --json " +
                           tmp.str("loader.jsonl"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("suite loader, synthetic (seed 0): 32 x 3x32x32") != std::string::npos);
  const auto rows = read_json_lines(tmp.str("loader.jsonl"));
  REQUIRE(rows.size() == 2);
  CHECK(rows[0]["threads"] == 1);
  CHECK(rows[1]["threads"] == 2);
  CHECK(rows[0]["speedup"] == Approx(1.0));
  for (const auto& row : rows) {
    CHECK(row["samples_per_sec"].get<double>() > 0);
    // MB/s = samples/s x 3*32*32 floats x 4 bytes.
    CHECK(row["mb_per_sec"].get<double>() ==
          Approx(row["samples_per_sec"].get<double>() * 12288 / 1e6));
  }
}

TEST_CASE("replica-bench --suite ops: the CNN's step op by op, every call counted") {
  std::string output;
  const auto rows = ops_rows("--steps 3", &output);
  CHECK(output.find("suite ops, cnn on cpu:0 (fp32)") != std::string::npos);
  std::map<std::string, nlohmann::json> ops;
  double shares = 0;
  for (const auto& row : rows) {
    ops[row["op"].get<std::string>()] = row;
    shares += row["share"].get<double>();
    CHECK(row["ms_per_step"].get<double>() >= 0);
    CHECK(row["profiled_step_ms"].get<double>() > 0);
    CHECK(row["tensor_gb_per_s"].get<double>() >= 0);
  }
  CHECK(shares == doctest::Approx(1.0));
  // The CNN: conv1, relu1, conv2, relu2, pool, flatten, fc1, relu3, fc2; Adam; the batch is
  // preloaded in host memory (no copy op on CPU devices).
  const std::map<std::string, double> calls = {
      {"conv2d_forward", 2}, {"conv2d_backward", 2}, {"relu_forward", 3}, {"relu_backward", 3},
      {"maxpool2d_forward", 1}, {"maxpool2d_backward", 1}, {"linear_forward", 2},
      {"linear_backward", 2}, {"cross_entropy_forward", 1}, {"cross_entropy_backward", 1},
      {"adam_step", 1}};
  for (const auto& [op, n] : calls) {
    CAPTURE(op);
    REQUIRE(ops.count(op) == 1);
    CHECK(ops[op]["calls_per_step"].get<double>() == n);
  }
  CHECK(ops.count("copy") == 0);
  // An elementwise op moves its tensors' bytes in measurable time.
  CHECK(ops["relu_forward"]["tensor_gb_per_s"].get<double>() > 0);
  CHECK(output.find("GB/s: the bytes of an op's tensors") != std::string::npos);
  CHECK(rows.at(0)["variables"].is_object());
}

TEST_CASE("replica-bench --suite ops --by-shape: each op split by its tensors' shapes") {
  std::string output;
  const auto rows = ops_rows("--steps 2 --by-shape", &output);
  CHECK(output.find("op and tensor shapes") != std::string::npos);
  // The CNN's two convolutions are two rows of one op, a call each per step; the first takes
  // the 1-channel batch: x [8, 1, 28, 28], its weight, its bias, y.
  std::vector<std::string> conv_shapes;
  for (const auto& row : rows) {
    REQUIRE(row.contains("shapes"));
    if (row["op"] != "conv2d_forward") continue;
    CHECK(row["calls_per_step"].get<double>() == 1);
    conv_shapes.push_back(row["shapes"].get<std::string>());
  }
  REQUIRE(conv_shapes.size() == 2);
  CHECK(std::count_if(conv_shapes.begin(), conv_shapes.end(), [](const std::string& s) {
          return s.rfind("[8, 1, 28, 28] ", 0) == 0;
        }) == 1);
  const auto other = test::run(kBench + " --suite dp --by-shape --devices cpu", 60);
  CHECK(other.exit_code != 0);
  CHECK(other.output.find("--by-shape belongs to --suite ops") != std::string::npos);
}

TEST_CASE("replica-bench --precision bf16 on a CPU device: the run and its rows say bf16") {
  std::string output;
  const auto rows = ops_rows("--steps 2 --precision bf16", &output);
  CHECK(output.find("suite ops, cnn on cpu:0 (bf16)") != std::string::npos);
  REQUIRE(!rows.empty());
  for (const auto& row : rows) {
    CHECK(row["precision"] == "bf16");
    CHECK(row["memory_format"] == "nchw");  // auto: channels_last is for GPUs
  }
}

TEST_CASE("replica-bench: bad input is one line and a non-zero exit") {
  test::TempDir tmp;
  expect_clean_error("--suite ring", "--suite");
  expect_clean_error("--suite dp --model transformer", "unknown model");
  expect_clean_error("--suite dp --devices cpu*2 --device-counts 3", "--device-counts");
  expect_clean_error("--suite dp --devices tpu", "unknown device");
  expect_clean_error("--suite dp --batch 0", "--batch");
  expect_clean_error("--suite ddp --backend mpi", "--backend");
  expect_clean_error("--suite ddp --devices cpu*2 --backend nccl", "needs a GPU per rank");
  expect_clean_error("--suite dp --devices cpu*2 --precision tf32", "needs CUDA devices");
  expect_clean_error("--suite single --precision bf16", "--suite single measures CPU threads in fp32");
  expect_clean_error("--suite single --cudnn-benchmark", "--cudnn-benchmark is for dp, ddp and ops");
  expect_clean_error("--suite dp --devices cpu*2 --cudnn-benchmark",
                     "--cudnn-benchmark needs a CUDA device");
  expect_clean_error("--suite dp --devices cpu --device-counts 1 --cuda-graphs",
                     "--cuda-graphs captures a GPU's step");
  expect_clean_error("--suite dp --devices cpu*2 --cuda-graphs",
                     "--cuda-graphs captures one device's step");
  expect_clean_error("--suite dp --precision fp16", "unknown --precision 'fp16'");
  expect_clean_error("--suite dp --devices cpu*2 --memory-format channels_last",
                     "--memory-format channels_last lays out cuDNN's operands: it needs CUDA");
  expect_clean_error("--suite ops --devices cpu --memory-format channels_last", "needs CUDA");
  expect_clean_error("--suite single --memory-format nchw",
                     "--memory-format is for dp, ddp and ops");
  expect_clean_error("--suite loader --memory-format nchw",
                     "--memory-format is for dp, ddp and ops");
  expect_clean_error("--suite single --report " + tmp.str("r"), "--report");
  expect_clean_error("--suite dp --compare x.jsonl", "--compare needs --report");
  expect_clean_error("--suite dp --link nvlink4", "--link needs --report");
  expect_clean_error("--suite loader --csv " + tmp.str("x.csv"),
                     "--suite loader takes --json only");
  expect_clean_error("--suite loader --threads 0", "--threads");
  expect_clean_error("--suite loader --threads 1,99999", "--threads 99999: give 1 to");
  expect_clean_error("--suite single --threads 99999", "--threads 99999: give 1 to");
  expect_clean_error("--suite dp --threads-per-device 99999", "--threads-per-device 99999");
  expect_clean_error("--suite single --threads 1048576", "below a million");
  expect_clean_error("--suite dp --seed -1", "--seed must be >= 0");
  // Each typed value is held to its bound: -1 and 0 also stood for "not given", and passed so.
  expect_clean_error("--suite ops --devices cpu --steps -1", "--steps must be at least 1, got -1");
  expect_clean_error("--suite dp --steps -1", "--steps must be at least 1, got -1");
  expect_clean_error("--suite ops --devices cpu --warmup -1",
                     "--warmup must be at least 0, got -1");
  expect_clean_error("--suite loader --repeat -1", "--repeat must be at least 1, got -1");
  expect_clean_error("--suite dp --threads-per-device 0",
                     "--threads-per-device must be at least 1, got 0");
  expect_clean_error("--suite dp --trace-dir " + tmp.str("t") + " --trace-steps 0",
                     "--trace-steps must be at least 1, got 0");
  expect_clean_error("--report " + tmp.str("r") + " --from-results " + kFixture + " --compare " +
                         tmp.str(""),
                     "is a directory; give a file of JSON-lines rows");
  // A flag the suite never reads is an error, not a silent no-op.
  expect_clean_error("--suite single --reduce tree", "--reduce is read by --suite dp only");
  expect_clean_error("--suite ddp --reduce tree", "--reduce is read by --suite dp only");
  expect_clean_error("--suite dp --backend gloo", "--backend is read by --suite ddp only");
  expect_clean_error("--suite single --skip-alpha-beta",
                     "--skip-alpha-beta is read by --suite dp, ddp only");
  expect_clean_error("--suite dp --timeout 5", "--timeout is read by --suite ddp only");
  expect_clean_error("--suite loader --sgemm-seconds 1",
                     "--sgemm-seconds is read by --suite single");
  expect_clean_error("--suite DDP --batch 8",
                     "--suite 'DDP': expected single, loader, ops, dp, ddp");
  expect_clean_error("--suite ops --repeat 3", "--repeat is read by --suite");
  expect_clean_error("--suite loader --from-results " + kFixture, "--from-results needs --report");
  expect_clean_error("--suite dp --skip-alpha-beta", "--skip-alpha-beta needs --report DIR");
  expect_clean_error("--suite dp --trace-steps 3", "--trace-steps needs --trace-dir DIR");
  expect_clean_error("--report " + tmp.str("r") + " --from-results " + kFixture +
                         " --devices cpu*4",
                     "--devices: --from-results renders saved results and measures nothing");
  expect_clean_error("--report " + tmp.str("r") + " --from-results " + kFixture + " --suite dp",
                     "--suite: --from-results renders saved results and measures nothing");
  expect_clean_error("--suite ops --trace-dir " + tmp.str("t"), "--suite ops takes --json only");
  expect_clean_error("--suite ops --devices cpu*2", "cpu*2");
  expect_clean_error("--report " + tmp.str("r") + " --link warp", "--link 'warp'");
  expect_clean_error("--report " + tmp.str("r") + " --from-results " + tmp.str("none"),
                     "results.jsonl");
  {
    std::ofstream bad(tmp.str("bad.jsonl"));
    bad << R"({"mode": "ddp", "devices": 2, "model": "cnn", "batch_per_device": 64})" << "\n";
  }
  expect_clean_error("--report " + tmp.str("r") + " --from-results " + kFixture + " --compare " +
                         tmp.str("bad.jsonl"),
                     "missing field 'samples_per_sec'");
}

// A results directory edited by hand or written by another tool: a field of the wrong type, or
// a measured point that is not [bytes, seconds], is named by file, line and field when it is
// read, before anything is written (an empty point crashed the report before).
TEST_CASE("replica-bench --from-results: a field of the wrong type is named, nothing is written") {
  test::TempDir tmp;
  auto copy_fixture = [&](const std::string& name) {
    const std::string dir = tmp.str(name);
    std::filesystem::create_directories(dir);
    for (const char* f : {"results.jsonl", "alpha_beta.json"})
      std::filesystem::copy_file(kFixture + "/" + f, dir + "/" + f);
    return dir;
  };
  auto edit_alpha_beta = [](const std::string& dir, const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j = nlohmann::json::parse(read_text(dir + "/alpha_beta.json"));
    f(j);
    std::ofstream(dir + "/alpha_beta.json") << j.dump();
  };
  auto edit_row = [](const std::string& dir, const std::string& field, const nlohmann::json& v) {
    auto rows = read_json_lines(dir + "/results.jsonl");
    rows.at(1)[field] = v;
    std::ofstream out(dir + "/results.jsonl");
    for (const auto& r : rows) out << r.dump() << "\n";
  };
  const struct {
    std::string name, expected;
    std::function<void(const std::string&)> spoil;
  } cases[] = {
      {"empty-point", "alpha_beta.json: 'dp_reduce': points[0] must be [bytes, seconds]",
       [&](const std::string& d) {
         edit_alpha_beta(d, [](nlohmann::json& j) {
           j["dp_reduce"]["points"][0] = nlohmann::json::array();
         });
       }},
      {"short-point", "points[1] must be [bytes, seconds]",
       [&](const std::string& d) {
         edit_alpha_beta(d, [](nlohmann::json& j) { j["dp_reduce"]["points"][1] = {16384}; });
       }},
      {"alpha-text", "'dp_broadcast': 'alpha_s' must be a number",
       [&](const std::string& d) {
         edit_alpha_beta(d, [](nlohmann::json& j) { j["dp_broadcast"]["alpha_s"] = "fast"; });
       }},
      {"phases-text", "results.jsonl:2: 'phase_ms' must be an object of numbers",
       [&](const std::string& d) { edit_row(d, "phase_ms", "slow"); }},
      {"devices-real", "results.jsonl:2: 'devices' must be a whole number",
       [&](const std::string& d) { edit_row(d, "devices", 2.5); }},
      {"peaks-null-entry", "results.jsonl:2: 'peak_memory_bytes' must be a list of numbers",
       [&](const std::string& d) { edit_row(d, "peak_memory_bytes", {1, nullptr}); }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const std::string dir = copy_fixture(c.name);
    c.spoil(dir);
    const std::string out = tmp.str(c.name + "-report");
    expect_clean_error("--report " + out + " --from-results " + dir, c.expected);
    CHECK((!std::filesystem::exists(out) || std::filesystem::is_empty(out)));
  }
}

// --json adds rows to a file that holds earlier runs: a write that fails (here a file-size limit,
// as a full disk would) leaves it as it was, not with half a row appended.
TEST_CASE("replica-bench --json: a failed write leaves the earlier rows intact") {
  test::TempDir tmp;
  const std::string path = tmp.str("rows.jsonl");
  const std::string old_rows = std::string(R"({"mode": "dp"})") + std::string(3900, ' ') + "\n";
  {
    std::ofstream f(path);
    f << old_rows;
  }
  const std::string cmd = kBench + " --suite ops --devices cpu --batch 8 --steps 2 --warmup 1 "
                                   "--threads-per-device 1 --json " + path;
  // 8 blocks of 512 bytes: the old rows fit, old and new together do not.
  auto r = test::run("sh -c \"trap '' XFSZ; ulimit -f 8; " + cmd + "\"", 120);
  INFO(r.output);
  CHECK(r.exit_code != 0);
  CHECK(r.output.find("replica-bench: error: cannot write '" + path + "'") != std::string::npos);
  CHECK(read_text(path) == old_rows);
  // With room, the new rows follow the old ones.
  r = test::run(cmd, 120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const std::string text = read_text(path);
  CHECK(text.rfind(old_rows, 0) == 0);
  CHECK(text.size() > old_rows.size());
}

// Two runs adding to one file: the second waits for the first. Here a shell holds the
// directory's lock with the file open for appending while the benchmark runs; without the lock
// the benchmark's rename would orphan the shell's row.
TEST_CASE("replica-bench --json: a run adding rows waits for another writer of the file") {
  test::TempDir tmp;
  const std::string path = tmp.str("rows.jsonl");
  {
    std::ofstream f(path);
    f << R"({"mode": "first"})" << "\n";
  }
  const std::string cmd = kBench + " --suite ops --devices cpu --batch 8 --steps 2 --warmup 1 "
                                   "--threads-per-device 1 --json " + path;
  {
    std::ofstream script(tmp.str("holder.sh"));
    // READY once the lock is held; the row goes in 5 s later, long after the benchmark (about
    // a second) reached its append.
    script << "flock " << tmp.path.string() << " sh -c 'exec 3>>" << path << "; touch "
           << tmp.str("READY")
           << R"(; sleep 5; printf "%s\n" "{\"mode\": \"held\"}" >&3')" << "\n";
  }
  auto r = test::run("sh -c \"sh " + tmp.str("holder.sh") + " & while [ ! -e " +
                         tmp.str("READY") + " ]; do sleep 0.05; done; " + cmd + "; wait\"",
                     120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const auto rows = read_json_lines(path);
  REQUIRE(rows.size() > 2);
  CHECK(rows[0]["mode"] == "first");
  CHECK(rows[1]["mode"] == "held");
  CHECK(rows.back()["engine"] == "replica");
}

// A rank that dies, and one that stops answering (its peers then wait until --timeout).
TEST_CASE("a dead or stuck DDP rank ends the benchmark with an error, not a hang") {
  for (const auto& [fault, timeout_s] : {std::pair<std::string, int>{"KILL", 60}, {"STALL", 3}}) {
    CAPTURE(fault);
    const auto r = run("env REPLICA_BENCH_" + fault + "_RANK=1 " + kBench +
                           " --suite ddp --devices cpu*2 --device-counts 2 --steps 3 --warmup 1 "
                           "--repeat 1 --batch 8 --timeout " + std::to_string(timeout_s),
                       90);
    INFO(r.output);
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("replica-bench: error: DDP on 2 ranks") != std::string::npos);
    if (fault == "KILL") {
      CHECK(r.output.find("DDP on 2 ranks failed") != std::string::npos);
      CHECK(r.output.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("tools/pytorch_bench.py says so when PyTorch is missing") {
  const std::string script = std::string(REPLICA_SOURCE_DIR) + "/tools/pytorch_bench.py";
  if (test::run("python3 -c 'import torch'").exit_code == 0) {
    MESSAGE("PyTorch is installed here: the missing-PyTorch message is not checked");
    return;
  }
  const auto r = test::run("python3 " + script + " --out /dev/null");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(test::count_lines(r.output) == 1);
  CHECK(r.output.find("pytorch_bench: error: PyTorch is not installed") != std::string::npos);
}
