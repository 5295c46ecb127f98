// replica-bench: training throughput, and DP-vs-DDP scaling reports.
//   replica-bench                                   single: one device per thread count vs sgemm
//   replica-bench --suite dp,ddp --json out.jsonl   DP and DDP on 1, 2, 4, ... N devices
//   replica-bench --report out                      both suites, plots, traces, projection: out/report.md
//   replica-bench --report out --compare pytorch.jsonl   PyTorch's rows beside replica's
//   replica-bench --report out --link nvlink4       project to separate GPUs joined by NVLink 4
//   replica-bench --suite loader --input-shape 3x224x224   can the input pipeline feed a GPU?
//   replica-bench --suite ops --model resnet50 --batch 64   one device's step, op by op
// Suites: tools/bench/suite_single.cpp, suite_dp.cpp, suite_ddp.cpp; the report arithmetic:
// tools/bench/report_math.h.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/ranges.h>

#include "cli/gpu_flags.h"
#include "cli/program.h"
#include "engine/output_files.h"
#include "tools/bench/link.h"
#include "tools/bench/options.h"

using namespace replica;
using namespace replica::bench;

namespace {

// What to measure: the suite, the model and its batch, the timing windows.
void declare_workload(CLI::App& app, BenchOptions& o) {
  app.add_option("--suite", o.suite,
                 "single (one device per thread count, vs sgemm) | loader (the input "
                 "pipeline's samples/s) | ops (one device's step, op by op) | dp | ddp | dp,ddp "
                 "(default: single; dp,ddp with --report)");
  app.add_option("--model", o.model, "cnn | resnet18 | resnet34 | resnet50 | ...")
      ->capture_default_str();
  app.add_option("--input-shape", o.input_shape,
                 "CxHxW (default 1x28x28 for cnn, 3x224x224 for ResNets and image folders)");
  app.add_option("--data", o.data,
                 "loader: an image folder (DIR/train/<class>/*.jpg) decoded and cropped, "
                 "instead of synthetic samples");
  app.add_option("--batch,--batch-per-device", o.batch,
                 "single: the batch; dp/ddp: samples per device per step (weak scaling)")
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "single, loader: comma list of CPU thread counts (default: 1,all cores)");
  app.add_option("--warmup", o.warmup,
                 "untimed steps first (default: single 5, loader 2 batches; dp/ddp about 1 s of "
                 "steps, 2..10)");
  app.add_option("--steps", o.steps,
                 "timed steps per window (default: single 50, loader 20 batches; dp/ddp about 5 s "
                 "of one device's steps, 3..100)");
  app.add_option("--repeat", o.repeat,
                 "single: timed windows; dp/ddp: rounds, each measuring every configuration "
                 "once in turn; the median is reported (default: single 1, loader and dp/ddp 3)");
  app.add_option("--sgemm-seconds", o.sgemm_seconds,
                 "single: seconds per sgemm ceiling measurement")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed for weights and synthetic data")->capture_default_str();
  group_options(app, "What to measure");
}

// Where and how it runs: devices, threads, collectives, numerics.
void declare_devices(CLI::App& app, BenchOptions& o) {
  app.add_option("--devices", o.devices,
                 "dp/ddp: the largest device set: cpu*N (default: one per core), cuda, cuda:0,1, "
                 "cuda:0*N (logical devices sharing GPU 0: labelled, not a scaling measurement)");
  app.add_option("--device-counts", o.device_counts,
                 "dp/ddp: comma list of device counts (default: 1,2,4,...,N)");
  app.add_option("--threads-per-device", o.threads_per_device,
                 "dp/ddp: CPU threads per device (default: cores / largest count)");
  app.add_option("--reduce", o.reduce, "DP gradient reduction: root | tree")->capture_default_str();
  app.add_option("--backend", o.backend, "DDP collectives: auto | gloo | nccl")
      ->capture_default_str();
  add_math_flags(app, "dp/ddp/ops: ", o.precision, o.cudnn_benchmark, o.memory_format);
  add_cuda_graphs_flag(app, "dp on one device: ", o.cuda_graphs);
  app.add_flag("--by-shape", o.by_shape,
               "ops: split each op's time by the shapes of its tensors (which layer is slow)");
  app.add_option("--timeout", o.timeout_s,
                 "DDP: seconds for rendezvous and each collective; ranks that make no "
                 "progress for this long are stopped")
      ->capture_default_str();
  group_options(app, "Devices and settings");
}

// What is written: rows, traces, the report and what it is compared with.
void declare_outputs(CLI::App& app, BenchOptions& o) {
  app.add_option("--json", o.json, "append one JSON object per configuration to FILE");
  app.add_option("--csv", o.csv, "dp/ddp: write the rows as CSV to FILE");
  app.add_option("--trace-dir", o.trace_dir,
                 "dp/ddp: write a Chrome trace per configuration into DIR");
  app.add_option("--trace-steps", o.trace_steps, "steps in each traced window (default 5)");
  app.add_option("--report", o.report_dir,
                 "run dp and ddp and write DIR/report.md with plots, traces and a projection");
  app.add_option("--compare", o.compare,
                 "--report: JSON-lines rows of another engine (tools/pytorch_bench.py) to show "
                 "beside replica's (repeatable)");
  app.add_option("--from-results", o.from_results,
                 "--report: render from DIR's saved results.jsonl/alpha_beta.json, measure "
                 "nothing");
  app.add_option("--link", o.link,
                 "--report: project to separate GPUs joined by this link instead of the measured "
                 "bandwidth: nvlink3 | nvlink4 | pcie4 | pcie5 | GB/s per direction");
  app.add_flag("--skip-alpha-beta", o.skip_alpha_beta,
               "--report: do not measure the communication primitives (the projection then "
               "uses the measured 2-device runs)");
  group_options(app, "Outputs and reports");
}

// A flag the run would ignore is an error, not a silent no-op (as replica-train's mode flags):
// each flag below is read by the suites named, and --from-results measures nothing, so the
// flags that shape a measurement are refused beside it.
void check_flags_apply(const CLI::App& app, const BenchOptions& o) {
  if (!o.worker.empty()) return;  // a rank worker gets the flags its launcher chose
  struct Owner {
    const char* flag;
    std::vector<std::string> suites;
    bool measures;  // shapes a measurement (meaningless with --from-results)
  };
  const std::vector<std::string> parallel = {"dp", "ddp"};
  const std::vector<Owner> owners = {
      {"--suite", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--model", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--input-shape", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--batch", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--warmup", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--steps", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--repeat", {"single", "loader", "dp", "ddp"}, true},
      {"--seed", {"single", "loader", "ops", "dp", "ddp"}, true},
      {"--threads", {"single", "loader"}, true},
      {"--sgemm-seconds", {"single"}, true},
      {"--data", {"loader"}, true},
      {"--by-shape", {"ops"}, true},
      {"--devices", {"ops", "dp", "ddp"}, true},
      {"--threads-per-device", {"ops", "dp", "ddp"}, true},
      {"--precision", {"single", "loader", "ops", "dp", "ddp"}, true},  // each suite says
      {"--cudnn-benchmark", {"single", "loader", "ops", "dp", "ddp"}, true},  // which values
      {"--memory-format", {"single", "loader", "ops", "dp", "ddp"}, true},  // it takes
      {"--device-counts", parallel, true},
      {"--reduce", {"dp"}, true},
      {"--backend", {"ddp"}, true},
      {"--cuda-graphs", parallel, true},
      {"--timeout", {"ddp"}, true},
      {"--trace-steps", parallel, true},
      {"--skip-alpha-beta", parallel, true},
      {"--trace-dir", parallel, true},
  };
  std::set<std::string> suites;
  for (size_t start = 0;;) {
    const size_t at = o.suite.find(',', start);
    const std::string s = o.suite.substr(start, at == std::string::npos ? at : at - start);
    REPLICA_USAGE_CHECK(s == "single" || s == "loader" || s == "ops" || s == "dp" || s == "ddp",
                        "--suite '{}': expected single, loader, ops, dp, ddp or dp,ddp", o.suite);
    suites.insert(s);
    if (at == std::string::npos) break;
    start = at + 1;
  }
  for (const Owner& f : owners) {
    if (app.count(f.flag) == 0) continue;
    bool applies = false;
    for (const auto& s : suites)
      applies |= std::find(f.suites.begin(), f.suites.end(), s) != f.suites.end();
    REPLICA_USAGE_CHECK(applies, "{} is read by --suite {} only (this run: --suite {})", f.flag,
                        fmt::format("{}", fmt::join(f.suites, ", ")), o.suite);
    REPLICA_USAGE_CHECK(!f.measures || o.from_results.empty(),
                        "{}: --from-results renders saved results and measures nothing, so it "
                        "would be ignored",
                        f.flag);
  }
  REPLICA_USAGE_CHECK(!o.skip_alpha_beta || !o.report_dir.empty(),
                      "--skip-alpha-beta needs --report DIR");
  REPLICA_USAGE_CHECK(app.count("--trace-steps") == 0 || !o.report_dir.empty() ||
                          !o.trace_dir.empty(),
                      "--trace-steps needs --trace-dir DIR or --report DIR");
}

// Fills in the defaults that depend on the suite, checks the flags together (outputs before
// minutes of measuring) and runs the suite.
int run_suite(const CLI::App& app, BenchOptions& o, int argc, char** argv) {
  o.command_line = "replica-bench";
  for (int i = 1; i < argc; ++i) o.command_line += std::string(" ") + argv[i];
  if (o.suite.empty()) o.suite = (!o.report_dir.empty() || !o.worker.empty()) ? "dp,ddp" : "single";
  const bool single = o.suite == "single";
  REPLICA_USAGE_CHECK(!single || (o.report_dir.empty() && o.worker.empty()),
                      "--report runs the dp and ddp suites, not 'single'");
  REPLICA_USAGE_CHECK(!single || (o.csv.empty() && o.trace_dir.empty()),
                      "--csv and --trace-dir belong to the dp and ddp suites");
  // Outputs are checked before minutes of measuring, not when the results are written.
  check_output_file("--json", o.json);
  check_output_file("--csv", o.csv);
  check_outputs_apart({{"--json", o.json}, {"--csv", o.csv}}, {}, {});
  check_output_dir("--trace-dir", o.trace_dir);
  check_output_dir("--report", o.report_dir);
  REPLICA_USAGE_CHECK(o.compare.empty() || !o.report_dir.empty(), "--compare needs --report DIR");
  REPLICA_USAGE_CHECK(o.link.empty() || !o.report_dir.empty(), "--link needs --report DIR");
  REPLICA_USAGE_CHECK(!o.by_shape || o.suite == "ops", "--by-shape belongs to --suite ops");
  REPLICA_USAGE_CHECK(o.from_results.empty() || !o.report_dir.empty(),
                      "--from-results needs --report DIR");
  if (!o.link.empty()) parse_link(o.link);  // a wrong name fails now, not after the runs
  for (const auto& f : o.compare) {
    std::error_code ec;
    const auto st = std::filesystem::status(f, ec);
    REPLICA_USAGE_CHECK(std::filesystem::exists(st), "--compare '{}': no such file", f);
    REPLICA_USAGE_CHECK(std::filesystem::is_regular_file(st),
                        "--compare '{}': {}; give a file of JSON-lines rows", f,
                        std::filesystem::is_directory(st) ? "is a directory"
                                                          : "not a regular file");
  }
  // The suites that measure one thing in this process: --json only, their own defaults.
  struct OneShot {
    const char* name;
    int64_t warmup, steps;
    int repeat;
    int (*run)(const BenchOptions&);
  };
  for (const OneShot& s : {OneShot{"loader", 2, 20, 3, run_loader_suite},
                           OneShot{"ops", 3, 10, 1, run_ops_suite}}) {
    if (o.suite != s.name) continue;
    REPLICA_USAGE_CHECK(o.report_dir.empty() && o.worker.empty() && o.csv.empty() &&
                            o.trace_dir.empty(),
                        "--suite {} takes --json only (no --report, --csv, --trace-dir)", s.name);
    check_flags_apply(app, o);
    o.warmup = o.warmup.value_or(s.warmup);
    o.steps = o.steps.value_or(s.steps);
    o.repeat = o.repeat.value_or(s.repeat);
    return s.run(o);
  }
  check_flags_apply(app, o);
  if (single) {  // dp/ddp: chosen from a measured step time
    o.warmup = o.warmup.value_or(5);
    o.steps = o.steps.value_or(50);
  }
  o.repeat = o.repeat.value_or(single ? 1 : 3);
  if (!o.worker.empty()) return run_worker(o);
  return single ? run_single_suite(o) : run_parallel_suites(o);
}

int run(int argc, char** argv) {
  BenchOptions o;
  CLI::App app{
      "replica-bench: training throughput (suite single) and DP-vs-DDP scaling reports "
      "(suites dp, ddp; --report DIR)"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  declare_workload(app, o);
  declare_devices(app, o);
  declare_outputs(app, o);
  auto* hidden = app.add_option_group("");  // DDP rank workers: this program re-executed
  hidden->add_option("--worker", o.worker);
  hidden->add_option("--worker-out", o.worker_out);
  if (auto code = parse_cli(app, argc, argv)) return *code;
  return run_suite(app, o, argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-bench", [&] { return run(argc, argv); });
}
