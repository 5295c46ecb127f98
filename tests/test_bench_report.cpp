// replica-bench's report arithmetic on fixed inputs with hand-computed results (efficiency,
// bytes per step, algbw/busbw factors, the alpha-beta fit, the projection and its error), the
// engines' byte counts against the formulas, and the program itself: a short DP/DDP run with
// traces, a report rendered from a committed fixture with PyTorch rows beside it or over a
// declared link, bad input, a dead DDP rank, and the PyTorch script's message when PyTorch is
// missing.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "engine/error.h"
#include "parallel/engines/dp_engine.h"
#include "tools/bench/harness.h"
#include "tools/bench/link.h"
#include "tools/bench/projection.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"

using namespace replica;
using namespace replica::bench;
using doctest::Approx;

namespace {

const std::string kBench = test::bin("replica-bench");
const std::string kFixture = std::string(REPLICA_SOURCE_DIR) + "/tests/data/bench";
constexpr int64_t kCnnParams = 111100;  // 520 + 10,020 + 100,050 + 510

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// A short `--suite ops` run on one CPU device with `flags` added: its JSON rows, its output in
// `output`. The run must succeed.
std::vector<nlohmann::json> ops_rows(const std::string& flags, std::string* output) {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --suite ops --devices cpu --batch 8 --warmup 1 "
                                    "--threads-per-device 1 --json " +
                               tmp.str("ops.jsonl") + " " + flags,
                           120);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  *output = r.output;
  return read_lines(tmp.str("ops.jsonl"));
}

void expect_clean_error(const std::string& args, const std::string& must_contain) {
  test::expect_clean_error("replica-bench", args, must_contain);
}

}  // namespace

TEST_CASE("speed-up and efficiency are against one device of the same mode") {
  CHECK(speedup(1800, 1000) == Approx(1.8));
  CHECK(efficiency(1800, 1000, 2) == Approx(0.9));
  CHECK(efficiency(3000, 1000, 4) == Approx(0.75));
  CHECK(efficiency(1000, 1000, 1) == Approx(1.0));
  CHECK(efficiency(5, 0, 2) == 0.0);  // no baseline: no number, not a division by zero
}

TEST_CASE("bytes per step follow the gradient size") {
  const int64_t s = 4 * kCnnParams;  // 444,400 B
  CHECK(dp_comm_bytes(kCnnParams, 1) == 0);
  CHECK(dp_comm_bytes(kCnnParams, 2) == 444400);
  CHECK(dp_comm_bytes(kCnnParams, 4) == 3 * s);
  CHECK(ddp_comm_bytes(kCnnParams, 1) == 0);
  CHECK(ddp_comm_bytes(kCnnParams, 2) == s);
  CHECK(ddp_comm_bytes(kCnnParams, 8) == s);
  CHECK(ring_wire_bytes(s, 2) == Approx(444400));
  CHECK(ring_wire_bytes(s, 4) == Approx(666600));  // 2 * 3/4 * S
}

TEST_CASE("algbw and busbw use nccl-tests' factors") {
  CHECK(bus_factor(Collective::AllReduce, 2) == Approx(1.0));
  CHECK(bus_factor(Collective::AllReduce, 4) == Approx(1.5));
  CHECK(bus_factor(Collective::AllReduce, 8) == Approx(1.75));
  CHECK(bus_factor(Collective::Reduce, 8) == 1.0);
  CHECK(bus_factor(Collective::Broadcast, 8) == 1.0);
  CHECK(algbw_gbps(444400, 1e-3) == Approx(0.4444));
  CHECK(busbw_gbps(Collective::AllReduce, 4, 444400, 1e-3) == Approx(0.6666));
  CHECK(busbw_gbps(Collective::Reduce, 4, 444400, 1e-3) == Approx(0.4444));
  CHECK(algbw_gbps(1, 0) == 0.0);
}

TEST_CASE("alpha-beta fit") {
  SUBCASE("points on a line give the line back") {
    // t = 100 us + S / (1 GB/s)
    const std::vector<double> bytes = {1e4, 1e5, 1e6};
    std::vector<double> t;
    for (double b : bytes) t.push_back(1e-4 + b / 1e9);
    const AlphaBeta f = fit_alpha_beta(bytes, t);
    CHECK(f.alpha_s == Approx(1e-4).epsilon(1e-9));
    CHECK(f.beta_bytes_per_s == Approx(1e9).epsilon(1e-9));
    CHECK(f.seconds(2e6) == Approx(2.1e-3));
  }
  SUBCASE("a negative intercept is clamped to zero latency") {
    // (1000 B, 0.5 us), (2000 B, 1.5 us): the free line has intercept -0.5 us. Through the
    // origin, weights 1/t^2: c = sum(w S t) / sum(w S^2) = (10/3 e9) / (52/9 e18) = 0.5769e-9.
    const AlphaBeta f = fit_alpha_beta({1000, 2000}, {0.5e-6, 1.5e-6});
    CHECK(f.alpha_s == 0.0);
    CHECK(f.beta_bytes_per_s == Approx(26.0 / 15.0 * 1e9));
  }
  SUBCASE("not enough information is an error") {
    CHECK_THROWS_AS(fit_alpha_beta({1000}, {1e-6}), std::invalid_argument);
    CHECK_THROWS_AS(fit_alpha_beta({1000, 1000}, {1e-6, 2e-6}), std::invalid_argument);
    CHECK_THROWS_AS(fit_alpha_beta({1000, 2000}, {1e-6, 0}), std::invalid_argument);
  }
  SUBCASE("a ring all-reduce splits into per-message latency and per-link bandwidth") {
    const AlphaBeta two = ring_alpha_beta({2e-4, 1e9}, 2);  // 2(n-1) = 2 messages, factor 1
    CHECK(two.alpha_s == Approx(1e-4));
    CHECK(two.beta_bytes_per_s == Approx(1e9));
    const AlphaBeta four = ring_alpha_beta({2e-4, 1e9}, 4);  // 6 messages, factor 1.5
    CHECK(four.alpha_s == Approx(2e-4 / 6));
    CHECK(four.beta_bytes_per_s == Approx(1.5e9));
    CHECK(ring_allreduce_seconds(four, 4, 4e6, 1) == Approx(2e-4 + 4e6 / 1e9));
  }
}

TEST_CASE("projection on fixed inputs") {
  // T1 = 10 ms, Tb = 6 ms, b = 32, S = 4 MB in K = 2 buckets, the last 1 MB: w = 0.75.
  const ComputeInputs compute{10e-3, 6e-3, 32};
  const GradientInputs grad{4e6, 2, 1e6};
  CHECK(overlappable_fraction(grad) == Approx(0.75));

  SUBCASE("DDP: ring all-reduce, partly hidden behind backward") {
    const DdpModel m{compute, grad, {50e-6, 1e9}};
    // n = 8: C = 2*2*7*50 us + (14/8) * 4 MB / 1 GB/s = 1.4 ms + 7 ms = 8.4 ms;
    // hidden = min(0.75 * 8.4, 6) = 6 ms; T = 10 + 8.4 - 6 = 12.4 ms.
    const Projected p8 = project_ddp(m, 8);
    CHECK(p8.comm_s == Approx(8.4e-3));
    CHECK(p8.hidden_s == Approx(6e-3));
    CHECK(p8.step_s == Approx(12.4e-3));
    CHECK(p8.samples_per_sec == Approx(8 * 32 / 12.4e-3));  // 20,645.2
    CHECK(p8.efficiency == Approx(10.0 / 12.4));              // 80.6%
    // n = 2: C = 0.2 + 4 = 4.2 ms, hidden 3.15 ms, T = 11.05 ms.
    CHECK(project_ddp(m, 2).step_s == Approx(11.05e-3));
    CHECK(project_ddp(m, 1).step_s == Approx(10e-3));
    CHECK(project_ddp(m, 1).efficiency == Approx(1.0));
  }
  SUBCASE("DP: reduce into and broadcast out of device 0") {
    const DpModel m{compute, grad, {1e-6, 10e9}, {2e-6, 20e9}};
    // n = 4: R = 3 (2 * 1 us + 0.4 ms) = 1.206 ms, hidden 0.75 R = 0.9045 ms,
    // B = 3 (2 us + 0.2 ms) = 0.606 ms; T = 10 + 1.206 - 0.9045 + 0.606 = 10.9075 ms.
    const Projected p4 = project_dp(m, 4);
    CHECK(p4.hidden_s == Approx(0.9045e-3));
    CHECK(p4.comm_s == Approx(1.812e-3));
    CHECK(p4.step_s == Approx(10.9075e-3));
    CHECK(p4.samples_per_sec == Approx(128 / 10.9075e-3));  // 11,735.0
    CHECK(p4.efficiency == Approx(10.0 / 10.9075));
  }
  SUBCASE("DP on separate GPUs: NCCL's reduce and broadcast pipeline along a chain") {
    DpModel m{compute, grad, {1e-6, 10e9}, {2e-6, 20e9}};
    m.pipelined = true;
    // n = 4: R = 2 * 3 * 1 us + 4 MB / 10 GB/s = 0.406 ms, hidden 0.75 R = 0.3045 ms,
    // B = 3 * 2 us + 4 MB / 20 GB/s = 0.206 ms; T = 10 + 0.406 - 0.3045 + 0.206 = 10.3075 ms.
    const Projected p4 = project_dp(m, 4);
    CHECK(p4.hidden_s == Approx(0.3045e-3));
    CHECK(p4.comm_s == Approx(0.612e-3));
    CHECK(p4.step_s == Approx(10.3075e-3));
    CHECK(project_dp(m, 1).step_s == Approx(10e-3));
  }
  CHECK(relative_error(110, 100) == Approx(0.1));
  CHECK(relative_error(90, 100) == Approx(-0.1));
}

TEST_CASE("declared links: the published figures per direction, or GB/s given by hand") {
  CHECK(parse_link("nvlink4").bytes_per_s == Approx(450e9));
  CHECK(parse_link("NVLink3").bytes_per_s == Approx(300e9));
  CHECK(parse_link("pcie4").bytes_per_s == Approx(31.5e9));
  CHECK(parse_link("pcie5").bytes_per_s == Approx(63e9));
  CHECK(parse_link("pcie5").published.find("128b/130b") != std::string::npos);
  CHECK(parse_link("25").bytes_per_s == Approx(25e9));
  CHECK(parse_link("12.5GB/s").bytes_per_s == Approx(12.5e9));
  CHECK(parse_link("12.5 GB/s").name == "12.5 GB/s");
  for (const char* bad : {"nvlink9", "0", "-3", "fast", "", "1e9", "nan", "25 MB/s"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_link(bad), UsageError);
  }
  try {
    parse_link("nvlink9");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("nvlink4") != std::string::npos);
  }
}

TEST_CASE("median of repeated measurements") {
  CHECK(median({}) == 0);
  CHECK(median({3, 1, 2}) == 2);
  CHECK(median({4, 1, 3, 2}) == Approx(2.5));
}

TEST_CASE("device counts: powers of two and the largest") {
  CHECK(device_counts_up_to(1) == std::vector<int>{1});
  CHECK(device_counts_up_to(2) == std::vector<int>{1, 2});
  CHECK(device_counts_up_to(6) == std::vector<int>{1, 2, 4, 6});
  CHECK(device_counts_up_to(8) == std::vector<int>{1, 2, 4, 8});
}

TEST_CASE("phase times count overlapping spans of one track once") {
  const std::vector<Tracer::Event> events = {
      {"cpu:0", "backward", 0, 10}, {"cpu:0", "backward", 5, 15},  // nested: 15 us
      {"cpu:1", "backward", 20, 30}, {"comm", "reduce", 8, 12}};
  const TrackPhaseMs ms = per_step_ms(events, 1);
  CHECK(ms.at("cpu:0").at("backward") == Approx(0.015));
  CHECK(ms.at("cpu:1").at("backward") == Approx(0.010));
  CHECK(ms.at("*").at("backward") == Approx(0.025));  // wall time some device was in backward
  CHECK(ms.at("comm").at("reduce") == Approx(0.004));
  CHECK(per_step_ms(events, 5).at("cpu:0").at("backward") == Approx(0.003));
}

TEST_CASE("rounds merge: windows add up, phase times average, peaks are the maximum") {
  Measurement a, b;
  a.window_seconds = {1.0};
  a.steps_per_window = b.steps_per_window = 10;
  a.track_ms["cpu:0"]["backward"] = 4.0;
  a.peak_memory = {100, 50};
  b.window_seconds = {3.0};
  b.track_ms["cpu:0"]["backward"] = 6.0;
  b.track_ms["comm"]["reduce"] = 1.0;
  b.peak_memory = {90, 70};
  Measurement total;
  merge(total, a);
  merge(total, b);
  CHECK(total.window_seconds == std::vector<double>{1.0, 3.0});
  CHECK(total.track_ms["cpu:0"]["backward"] == Approx(5.0));
  CHECK(total.track_ms["comm"]["reduce"] == Approx(0.5));  // absent in a round: 0 there
  CHECK(total.peak_memory == std::vector<size_t>{100, 70});
}

TEST_CASE("the engines count the bytes the formulas give") {
  const ModelFacts cnn = model_facts("cnn", {1, 28, 28});
  CHECK(cnn.params == kCnnParams);
  CHECK(cnn.bucket_bytes == std::vector<int64_t>{4 * kCnnParams});  // one bucket below 1 MB
  // torchvision's resnet18 with 10 classes: 11,689,512 - 513,000 + 5,130.
  const ModelFacts r18 = model_facts("resnet18", {3, 224, 224});
  CHECK(r18.params == 11181642);
  CHECK(r18.bucket_bytes.front() <= (1 << 20));
  int64_t sum = 0;
  for (int64_t b : r18.bucket_bytes) sum += b;
  CHECK(sum == 4 * r18.params);

  EngineOptions eo;
  eo.threads_per_device = 1;
  auto dp = make_dp_engine(parse_devices("cpu*2"), eo);
  const Preloaded pre = preload_batches({1, 28, 28}, 4, 0, 1, dp.get());
  CHECK_FALSE(pre.resident);  // CPU devices use host memory in place
  dp->train_step(pre.batches[0]);
  dp->synchronize();
  CHECK(dp->comm_bytes_per_step() == dp_comm_bytes(kCnnParams, 2));
}

TEST_CASE("replica-bench: DP and DDP rows, traces and CSV from a short run") {
  test::TempDir tmp;
  // REPLICA_COMMIT names the commit of a build that has no git history with it. The variables
  // that tune a run are recorded with its rows (REPLICA_RESIDUAL_SUM=conv is the default).
  const auto r = test::run("env REPLICA_COMMIT=0123abcd REPLICA_RESIDUAL_SUM=conv NCCL_ALGO=Ring " +
                               kBench +
                               " --suite dp,ddp --devices cpu*2 --steps 3 --warmup 1 "
                                    "--repeat 1 --batch 8 --threads-per-device 1 --json " +
                               tmp.str("rows.jsonl") + " --csv " + tmp.str("rows.csv") +
                               " --trace-dir " + tmp.str("traces"),
                           240);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("replica-bench: environment: ") != std::string::npos);
  CHECK(r.output.find("NCCL_ALGO=Ring") != std::string::npos);
  const auto rows = read_lines(tmp.str("rows.jsonl"));
  REQUIRE(rows.size() == 4);
  for (const auto& row : rows) {
    for (const auto& f : required_fields()) CHECK(row.contains(f));
    const int n = row["devices"];
    CHECK(row["comm_bytes"] == (row["mode"] == "dp" ? dp_comm_bytes(kCnnParams, n)
                                                    : ddp_comm_bytes(kCnnParams, n)));
    CHECK(row["comm_bytes_match"] == true);
    CHECK(row["peak_memory_bytes"].size() == size_t(n));
    REQUIRE(row["peak_held_bytes"].size() == size_t(n));
    REQUIRE(row["forward_kept_bytes"].size() == size_t(n));
    for (int d = 0; d < n; ++d) {
      CHECK(row["peak_held_bytes"][d].get<double>() >= row["peak_memory_bytes"][d].get<double>());
      CHECK(row["forward_kept_bytes"][d].get<double>() > 0);
      // Every device and rank runs the forward on --batch 8 samples: the same activations.
      CHECK(row["forward_kept_bytes"][d] == rows[0]["forward_kept_bytes"][0]);
    }
    CHECK(row["data"] == "synthetic, preloaded in host memory (loader not timed)");
    CHECK(row["samples_per_sec"].get<double>() > 0);
    CHECK(row["efficiency"].is_number());
    CHECK(row["env"]["cores"].is_number());
    CHECK(row["env"]["commit"] == "0123abcd");
    CHECK(row["env"]["variables"]["REPLICA_RESIDUAL_SUM"] == "conv");
    CHECK(row["env"]["variables"]["NCCL_ALGO"] == "Ring");
    CHECK_FALSE(row["env"]["variables"].contains("REPLICA_COMMIT"));  // the commit, as such
    CHECK(row["phase_ms"].contains("backward"));
    if (n == 2) CHECK(row["busbw_gbps"].get<double>() > 0);
    CHECK(row["precision"] == "fp32");  // CPU devices
    CHECK(row["comm_timing"] == "host");  // Gloo: the communication thread's busy time
  }
  const std::string csv = read_file(tmp.str("rows.csv"));
  CHECK(test::count_lines(csv) == 5);
  CHECK(csv.substr(0, csv.find('\n'))
            .find(",peak_memory_dev0_bytes,peak_memory_dev1_bytes,peak_held_dev0_bytes,"
                  "peak_held_dev1_bytes,forward_kept_dev0_bytes,forward_kept_dev1_bytes") !=
        std::string::npos);
  // A track per device and one for the communication thread.
  const auto dp_trace = read_file(tmp.str("traces/trace-dp-2dev.json"));
  for (const char* track : {"\"cpu:0\"", "\"cpu:1\"", "\"comm\"", "\"reduce\"", "\"backward\""})
    CHECK(dp_trace.find(track) != std::string::npos);
  const auto ddp_trace = read_file(tmp.str("traces/trace-ddp-2dev.json"));
  for (const char* track : {"\"rank0 cpu:0\"", "\"rank1 cpu:1\"", "\"comm\"", "\"allreduce\"",
                            "rank 1 (cpu:1)"})
    CHECK(ddp_trace.find(track) != std::string::npos);
}

TEST_CASE("replica-bench --report renders saved results with PyTorch rows beside them") {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --report " + tmp.str("out") + " --from-results " +
                           kFixture + " --compare " + kFixture + "/pytorch_sample.jsonl");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const std::string md = read_file(tmp.str("out/report.md"));
  INFO(md);
  CHECK(md.find("Side by side with PyTorch") != std::string::npos);
  CHECK(md.find("| ddp | cnn | 1x28x28 | fp32 | 2 | 64 | 2700.0 | pytorch | 2100.0 | 1.29x | "
                "87.5% |") != std::string::npos);
  CHECK(md.find("| pytorch | ddp (gloo) | cnn | 1x28x28 | fp32 | 2 |") != std::string::npos);
  // Rows saved before held bytes and kept bytes were reported show none.
  CHECK(md.find("| replica dp | 2 | 5.18 MB | 5.18 MB | 0 B | - | - |") != std::string::npos);
  // Rows of different backends still pair up, and the mode column names both: replica's DDP
  // rows over Gloo here, PyTorch's over NCCL.
  std::filesystem::create_directories(tmp.path / "mixed-in");
  for (const char* f : {"alpha_beta.json", "results.jsonl"})
    std::filesystem::copy_file(kFixture + "/" + f, tmp.path / "mixed-in" / f);
  {
    std::ofstream ours(tmp.str("mixed-in/results.jsonl"), std::ios::trunc), theirs(
        tmp.str("pytorch_nccl.jsonl"));
    for (auto row : read_lines(kFixture + "/results.jsonl")) {
      if (row["mode"] == "ddp") row["backend"] = "gloo";
      ours << row.dump() << "\n";
    }
    // pytorch_bench.py writes JSON null for what a row has not (a DP row's backend, a
    // one-device row's bus bandwidth): read as absent.
    for (auto row : read_lines(kFixture + "/pytorch_sample.jsonl")) {
      row["backend"] = row["mode"] == "dp" ? nlohmann::json(nullptr) : nlohmann::json("nccl");
      row["busbw_gbps"] = nullptr;
      theirs << row.dump() << "\n";
      if (row["devices"] == 2) {  // and a DP row, whose backend is null
        row["mode"] = "dp";
        row["backend"] = nullptr;
        row["samples_per_sec"] = 2000.0;
        theirs << row.dump() << "\n";
      }
    }
  }
  const auto mixed = test::run(kBench + " --report " + tmp.str("mixed") + " --from-results " +
                               tmp.str("mixed-in") + " --compare " + tmp.str("pytorch_nccl.jsonl"));
  REQUIRE_MESSAGE(mixed.exit_code == 0, mixed.output);
  CHECK(read_file(tmp.str("mixed/report.md"))
            .find("| ddp (replica gloo, pytorch nccl) | cnn | 1x28x28 | fp32 | 2 | 64 | 2700.0 | "
                  "pytorch | 2100.0 | 1.29x |") != std::string::npos);
  CHECK(read_file(tmp.str("mixed/report.md"))
            .find("| dp | cnn | 1x28x28 | fp32 | 2 | 64 | 2800.0 | pytorch | 2000.0 | 1.40x |") !=
        std::string::npos);
  // Efficiency 2800 / (2 x 1500); bytes equal to the formula.
  CHECK(md.find("| replica | dp | cnn | 1x28x28 | fp32 | 2 | 128 | 2800.0 | 1.87x | 93.3% |") !=
        std::string::npos);
  CHECK(md.find("| replica dp | 2 | reduce | 444,400 | 444,400 | yes |") != std::string::npos);
  // The projection's error where it was measured, from the fixture's inputs by hand:
  // DDP T(2) = 64/1480 s + 2 x 50 us + 444,400 B / 1 GB/s = 43.788 ms -> 2923.2 samples/s.
  CHECK(md.find("| 2 | 2700.0 | 2923.2 | +8.3% |") != std::string::npos);
  // DP T(2) = 64/1500 s + 2 x (0.1 us + 444,400 B / 20 GB/s) = 42.711 ms -> 2996.9 samples/s.
  CHECK(md.find("| 2 | 2800.0 | 2996.9 | +7.0% |") != std::string::npos);
  CHECK(md.find("| 8 (projection) |") != std::string::npos);
  CHECK(md.find("| 64 (projection) |") != std::string::npos);
  for (const char* f : {"results.jsonl", "results.csv", "projection.json", "compare.jsonl"})
    CHECK(test::fs::exists(tmp.path / "out" / f));
  const auto projection = nlohmann::json::parse(read_file(tmp.str("out/projection.json")));
  REQUIRE(projection.size() == 1);
  CHECK(projection[0]["ddp"]["inputs"]["S_bytes"] == Approx(444400));

  // A report directory renders again, PyTorch's rows included.
  const auto again =
      test::run(kBench + " --report " + tmp.str("again") + " --from-results " + tmp.str("out"));
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  CHECK(read_file(tmp.str("again/report.md")).find("| 2 | 2700.0 | 2923.2 | +8.3% |") !=
        std::string::npos);
  CHECK(read_file(tmp.str("again/report.md")).find("Side by side with PyTorch") !=
        std::string::npos);
}

// A report is written into a staging directory swapped in at the end: a failure part way (here a
// 6 KiB file-size limit, as a full disk: results.jsonl and projection.json fit, report.md does
// not) leaves the old report whole, not half old and half new.
TEST_CASE("replica-bench --report: a failed run leaves the old report whole; traces stay") {
  test::TempDir tmp;
  const std::string out = tmp.str("out");
  test::fs::create_directories(out);
  std::ofstream(tmp.str("out/notes.txt")) << "mine";  // not the report's: it stays
  auto r = test::run(kBench + " --report " + out + " --from-results " + kFixture);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  {
    std::ofstream trace(tmp.str("out/trace-dp-2dev.json"));
    trace << "{}";
  }
  std::map<std::string, std::string> before;
  for (const auto& e : test::fs::directory_iterator(out))
    before[e.path().filename().string()] = test::read_text(e.path().string());
  r = test::run("sh -c \"trap '' XFSZ; ulimit -f 12; " + kBench + " --report " + out +
                " --from-results " + kFixture + " --compare " + kFixture +
                "/pytorch_sample.jsonl\"");
  INFO(r.output);
  CHECK(r.exit_code != 0);
  std::map<std::string, std::string> after;
  for (const auto& e : test::fs::directory_iterator(out))
    after[e.path().filename().string()] = test::read_text(e.path().string());
  CHECK(after == before);  // (a staging directory would show up here too)
  // Rendered again in place: the traces stay, the report is new.
  r = test::run(kBench + " --report " + out + " --from-results " + out + " --compare " + kFixture +
                "/pytorch_sample.jsonl");
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::read_text(tmp.str("out/trace-dp-2dev.json")) == "{}");
  CHECK(read_file(tmp.str("out/report.md")).find("Side by side with PyTorch") != std::string::npos);
  CHECK(test::fs::exists(tmp.path / "out" / "compare.jsonl"));
  // Rendered without --compare: the earlier report's PyTorch rows go with it.
  r = test::run(kBench + " --report " + out + " --from-results " + kFixture);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK_FALSE(test::fs::exists(tmp.path / "out" / "compare.jsonl"));
  CHECK(test::read_text(tmp.str("out/notes.txt")) == "mine");
  // A failed run into directories that did not exist leaves none of them behind.
  r = test::run(kBench + " --report " + tmp.str("new/report") + " --from-results " +
                tmp.str("missing"));
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("cannot read results file") != std::string::npos);
  CHECK_FALSE(test::fs::exists(tmp.path / "new"));
  CHECK(tmp.entries() == 1);
}

TEST_CASE("replica-bench --report --link projects to separate GPUs over the declared link") {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --report " + tmp.str("out") + " --from-results " +
                           kFixture + " --link nvlink4");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto projection = nlohmann::json::parse(read_file(tmp.str("out/projection.json")));
  REQUIRE(projection.size() == 1);
  const auto& g = projection[0];
  CHECK(g["link"]["name"] == "nvlink4");
  // The bandwidths are the link's; the latencies stay the measured ones (the fixture's 50 us).
  CHECK(g["ddp"]["inputs"]["ring"]["beta_gbps"] == Approx(450));
  CHECK(g["ddp"]["inputs"]["ring"]["alpha_us"] == Approx(50));
  CHECK(g["dp"]["inputs"]["reduce"]["beta_gbps"] == Approx(450));
  CHECK(g["dp"]["inputs"]["broadcast"]["beta_gbps"] == Approx(450));
  CHECK(g["dp"]["formula"].get<std::string>().find("K (n-1) alpha_r + S / beta_r") !=
        std::string::npos);
  const std::string md = read_file(tmp.str("out/report.md"));
  INFO(md);
  CHECK(md.find("declared link: nvlink4**, 450.0 GB/s per direction") != std::string::npos);
  CHECK(md.find("No error table") != std::string::npos);
  CHECK(md.find("| 2 | 2700.0 | 2923.2 | +8.3% |") == std::string::npos);
  // DDP T(2) = 64/1480 s + 2 x 50 us + 444,400 B / 450 GB/s = 43.344 ms.
  CHECK(md.find("| 2 (projection) | 43.34 |") != std::string::npos);
}

TEST_CASE("replica-bench --suite loader: the input pipeline's rate per thread count") {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --suite loader --input-shape 3x32x32 --batch 8 --warmup 1 "
                                    "--steps 3 --repeat 1 --threads 1,2 --json " +
                           tmp.str("loader.jsonl"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("suite loader, synthetic (seed 0): 32 x 3x32x32") != std::string::npos);
  const auto rows = read_lines(tmp.str("loader.jsonl"));
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

TEST_CASE("replica-bench --report: another engine's row meets replica's at equal precision only") {
  test::TempDir tmp;
  nlohmann::json bf16;
  for (const auto& row : read_lines(kFixture + "/pytorch_sample.jsonl"))
    if (row["mode"] == "ddp" && row["devices"] == 2) bf16 = row;
  REQUIRE(bf16.is_object());
  nlohmann::json nhwc = bf16;
  bf16["precision"] = "bf16";
  bf16["samples_per_sec"] = 5000.0;
  nhwc["memory_format"] = "channels_last";  // fp32, as replica's rows, but on NHWC operands
  nhwc["samples_per_sec"] = 6000.0;
  {
    std::ofstream out(tmp.str("bf16.jsonl"));
    out << bf16.dump() << "\n" << nhwc.dump() << "\n";
  }
  const auto r = test::run(kBench + " --report " + tmp.str("out") + " --from-results " +
                           kFixture + " --compare " + tmp.str("bf16.jsonl"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const std::string md = read_file(tmp.str("out/report.md"));
  INFO(md);
  // replica's rows ran in fp32: no partner, no ratio.
  CHECK(md.find("| ddp | cnn | 1x28x28 | bf16 | 2 | 64 | - | pytorch | 5000.0 | - |") !=
        std::string::npos);
  CHECK(md.find("| ddp | cnn | 1x28x28 | fp32, channels_last | 2 | 64 | - | pytorch | 6000.0 | "
                "- |") != std::string::npos);
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
  CHECK(test::read_text(path) == old_rows);
  // With room, the new rows follow the old ones.
  r = test::run(cmd, 120);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const std::string text = test::read_text(path);
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
  const auto rows = read_lines(path);
  REQUIRE(rows.size() > 2);
  CHECK(rows[0]["mode"] == "first");
  CHECK(rows[1]["mode"] == "held");
  CHECK(rows.back()["engine"] == "replica");
}

TEST_CASE("a dead DDP rank ends the benchmark with an error, not a hang") {
  const auto r = test::run("env REPLICA_BENCH_KILL_RANK=1 " + kBench +
                               " --suite ddp --devices cpu*2 --device-counts 2 --steps 3 "
                               "--warmup 1 --repeat 1 --batch 8 --timeout 60",
                           90);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("replica-bench: error: DDP on 2 ranks failed") != std::string::npos);
  CHECK(r.output.find("rank 1") != std::string::npos);
}

TEST_CASE("a stuck DDP rank ends the benchmark with an error after --timeout") {
  const auto r = test::run("env REPLICA_BENCH_STALL_RANK=1 " + kBench +
                               " --suite ddp --devices cpu*2 --device-counts 2 --steps 3 "
                               "--warmup 1 --repeat 1 --batch 8 --timeout 3",
                           90);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("replica-bench: error: DDP on 2 ranks") != std::string::npos);
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
