// replica-bench's rows and reports as a user runs them: a short DP/DDP run with its traces and
// CSV, a report rendered from a committed fixture with PyTorch rows beside it (at equal
// precision only) or over a declared link, and a failed run that leaves the old report whole.
// (Arithmetic: test_bench_math.cpp; the other suites and failures: test_bench_suites.cpp.)
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_helpers.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"

using namespace replica;
using namespace replica::bench;
using namespace test;
using doctest::Approx;

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
  const auto rows = read_json_lines(tmp.str("rows.jsonl"));
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
    // Two ranks on one machine all-reduce through shared memory (one rank has no collectives).
    if (row["mode"] == "ddp") CHECK(row["backend"] == (n == 2 ? "gloo-shm" : "gloo"));
  }
  const std::string csv = read_text(tmp.str("rows.csv"));
  CHECK(test::count_lines(csv) == 5);
  CHECK(csv.substr(0, csv.find('\n'))
            .find(",peak_memory_dev0_bytes,peak_memory_dev1_bytes,peak_held_dev0_bytes,"
                  "peak_held_dev1_bytes,forward_kept_dev0_bytes,forward_kept_dev1_bytes") !=
        std::string::npos);
  // A track per device and one for the communication thread.
  const auto dp_trace = read_text(tmp.str("traces/trace-dp-2dev.json"));
  for (const char* track : {"\"cpu:0\"", "\"cpu:1\"", "\"comm\"", "\"reduce\"", "\"backward\""})
    CHECK(dp_trace.find(track) != std::string::npos);
  const auto ddp_trace = read_text(tmp.str("traces/trace-ddp-2dev.json"));
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
  const std::string md = read_text(tmp.str("out/report.md"));
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
    for (auto row : read_json_lines(kFixture + "/results.jsonl")) {
      if (row["mode"] == "ddp") row["backend"] = "gloo";
      ours << row.dump() << "\n";
    }
    // pytorch_bench.py writes JSON null for what a row has not (a DP row's backend, a
    // one-device row's bus bandwidth): read as absent.
    for (auto row : read_json_lines(kFixture + "/pytorch_sample.jsonl")) {
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
  CHECK(read_text(tmp.str("mixed/report.md"))
            .find("| ddp (replica gloo, pytorch nccl) | cnn | 1x28x28 | fp32 | 2 | 64 | 2700.0 | "
                  "pytorch | 2100.0 | 1.29x |") != std::string::npos);
  CHECK(read_text(tmp.str("mixed/report.md"))
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
  const auto projection = nlohmann::json::parse(read_text(tmp.str("out/projection.json")));
  REQUIRE(projection.size() == 1);
  CHECK(projection[0]["ddp"]["inputs"]["S_bytes"] == Approx(444400));

  // A report directory renders again, PyTorch's rows included.
  const auto again =
      test::run(kBench + " --report " + tmp.str("again") + " --from-results " + tmp.str("out"));
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  CHECK(read_text(tmp.str("again/report.md")).find("| 2 | 2700.0 | 2923.2 | +8.3% |") !=
        std::string::npos);
  CHECK(read_text(tmp.str("again/report.md")).find("Side by side with PyTorch") !=
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
    before[e.path().filename().string()] = read_text(e.path().string());
  r = test::run("sh -c \"trap '' XFSZ; ulimit -f 12; " + kBench + " --report " + out +
                " --from-results " + kFixture + " --compare " + kFixture +
                "/pytorch_sample.jsonl\"");
  INFO(r.output);
  CHECK(r.exit_code != 0);
  std::map<std::string, std::string> after;
  for (const auto& e : test::fs::directory_iterator(out))
    after[e.path().filename().string()] = read_text(e.path().string());
  CHECK(after == before);  // (a staging directory would show up here too)
  // Rendered again in place: the traces stay, the report is new.
  r = test::run(kBench + " --report " + out + " --from-results " + out + " --compare " + kFixture +
                "/pytorch_sample.jsonl");
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(read_text(tmp.str("out/trace-dp-2dev.json")) == "{}");
  CHECK(read_text(tmp.str("out/report.md")).find("Side by side with PyTorch") != std::string::npos);
  CHECK(test::fs::exists(tmp.path / "out" / "compare.jsonl"));
  // Rendered without --compare: the earlier report's PyTorch rows go with it.
  r = test::run(kBench + " --report " + out + " --from-results " + kFixture);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK_FALSE(test::fs::exists(tmp.path / "out" / "compare.jsonl"));
  CHECK(read_text(tmp.str("out/notes.txt")) == "mine");
  // A failed run into directories that did not exist leaves none of them behind.
  r = test::run(kBench + " --report " + tmp.str("new/report") + " --from-results " +
                tmp.str("missing"));
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("missing/results.jsonl: no such file") != std::string::npos);
  CHECK_FALSE(test::fs::exists(tmp.path / "new"));
  CHECK(tmp.entries() == 1);
}

TEST_CASE("replica-bench --report --link projects to separate GPUs over the declared link") {
  test::TempDir tmp;
  const auto r = test::run(kBench + " --report " + tmp.str("out") + " --from-results " +
                           kFixture + " --link nvlink4");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto projection = nlohmann::json::parse(read_text(tmp.str("out/projection.json")));
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
  const std::string md = read_text(tmp.str("out/report.md"));
  INFO(md);
  CHECK(md.find("declared link: nvlink4**, 450.0 GB/s per direction") != std::string::npos);
  CHECK(md.find("No error table") != std::string::npos);
  CHECK(md.find("| 2 | 2700.0 | 2923.2 | +8.3% |") == std::string::npos);
  // DDP T(2) = 64/1480 s + 2 x 50 us + 444,400 B / 450 GB/s = 43.344 ms.
  CHECK(md.find("| 2 (projection) | 43.34 |") != std::string::npos);
}

TEST_CASE("replica-bench --report: another engine's row meets replica's at equal precision only") {
  test::TempDir tmp;
  nlohmann::json bf16;
  for (const auto& row : read_json_lines(kFixture + "/pytorch_sample.jsonl"))
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
  const std::string md = read_text(tmp.str("out/report.md"));
  INFO(md);
  // replica's rows ran in fp32: no partner, no ratio.
  CHECK(md.find("| ddp | cnn | 1x28x28 | bf16 | 2 | 64 | - | pytorch | 5000.0 | - |") !=
        std::string::npos);
  CHECK(md.find("| ddp | cnn | 1x28x28 | fp32, channels_last | 2 | 64 | - | pytorch | 6000.0 | "
                "- |") != std::string::npos);
  // And the report says so under the table, rather than leaving two rows of dashes.
  CHECK(md.find("2 of the other engine's 2 rows have no replica row") != std::string::npos);
}
