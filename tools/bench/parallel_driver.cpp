// The dp/ddp suites and --report: resolve devices and defaults for this machine, measure the
// communication primitives, run the suites, then write rows (JSON lines, CSV), the projection,
// the plots and report.md.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/error.h"
#include "engine/output_files.h"
#include "engine/staged_directory.h"
#include "parallel/engines/captured_step.h"
#include "parallel/loop/run_summary.h"
#include "parallel/rendezvous/launcher.h"
#include "tools/bench/alpha_beta.h"
#include "tools/bench/environment.h"
#include "tools/bench/options.h"
#include "tools/bench/plots.h"
#include "tools/bench/projection.h"
#include "tools/bench/report_math.h"
#include "tools/bench/report_md.h"
#include "tools/bench/report_tables.h"
#include "tools/bench/results_reader.h"
#include "tools/bench/suites.h"

namespace replica::bench {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Devices, counts, threads and run options of the dp/ddp suites on this machine.
SuiteOptions resolve(const BenchOptions& o) {
  validate_common(o);
  SuiteOptions s;
  s.device_spec = !o.devices.empty() ? o.devices
                  : cuda_device_count() > 0 ? std::string("cuda")
                                            : fmt::format("cpu*{}", cpu_cores());
  s.devices = parse_devices(s.device_spec, true);
  // Before any configuration runs, not as the first DDP run's failure after a round of others.
  if (o.backend == "nccl" && o.suite.find("ddp") != std::string::npos)
    check_nccl_usable(s.devices[0]);
  const int most = int(s.devices.size());
  if (o.device_counts.empty()) {
    s.counts = device_counts_up_to(most);
  } else {
    REPLICA_USAGE_CHECK(o.device_counts.find_first_not_of("0123456789,") == std::string::npos,
                        "--device-counts '{}': expected a comma list like 1,2,4", o.device_counts);
    for (int64_t n : parse_positive_list(o.device_counts, ',', "--device-counts")) {
      REPLICA_USAGE_CHECK(n <= most, "--device-counts {}: --devices {} has only {} device{}", n,
                          s.device_spec, most, most == 1 ? "" : "s");
      if (std::find(s.counts.begin(), s.counts.end(), int(n)) == s.counts.end())
        s.counts.push_back(int(n));
    }
    std::sort(s.counts.begin(), s.counts.end());
  }
  const int largest = s.counts.back();
  s.run.model = o.model;
  s.run.input_shape = resolve_input_shape(o);
  s.run.batch_per_device = o.batch;
  // Not given: measure() chooses them from a measured step time.
  if (o.warmup) s.run.warmup = *o.warmup;
  if (o.steps) s.run.steps = *o.steps;
  s.run.repeat = o.repeat.value();
  s.run.seed = o.seed;
  s.run.precision = resolve_precision(o.precision, s.devices);
  s.run.cudnn_benchmark = o.cudnn_benchmark;
  s.run.channels_last = resolve_channels_last(o.memory_format, s.run.precision, s.devices);
  s.run.cuda_graphs = o.cuda_graphs;
  if (o.cuda_graphs)
    check_cuda_graphs({s.devices.begin(), s.devices.begin() + largest},
                      o.suite == "dp" ? "dp" : "ddp");
  s.run.threads_per_device = o.threads_per_device.value_or(
      s.devices[0].is_cuda() ? 1 : std::max(1, cpu_cores() / largest));
  if (s.devices[0].is_cpu() && largest * s.run.threads_per_device > cpu_cores())
    std::fprintf(stderr,
                 "replica-bench: note: %d devices x %d threads is more than the %d cores here: "
                 "devices will compete for cores\n",
                 largest, s.run.threads_per_device, cpu_cores());
  s.reduce = o.reduce;
  s.backend = o.backend;
  s.timeout_s = o.timeout_s;
  s.trace_dir = !o.report_dir.empty() ? o.report_dir : o.trace_dir;
  // The traced window's steps, 5 where traces are written; a rank worker writes none, and traces
  // the steps its launcher passes (worker_arguments), if any.
  s.run.trace_steps = o.trace_steps.value_or(s.trace_dir.empty() ? 0 : 5);
  s.self_exe = current_executable();
  return s;
}

std::vector<std::string> suites_of(const std::string& suite) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = suite.find(',', start);
    const std::string s = suite.substr(start, at == std::string::npos ? at : at - start);
    REPLICA_USAGE_CHECK(s == "dp" || s == "ddp",
                        "--suite '{}': expected single, loader, ops, dp, ddp or dp,ddp", suite);
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return out;
}

void print_table(const std::vector<json>& rows) {
  std::printf("\n%-5s %7s %11s %8s %10s %9s %12s %8s %9s %11s %11s\n", "mode", "devices",
              "samples/s", "speedup", "efficiency", "ms/step", "bytes/step", "formula", "busbw",
              "peak dev0", "held dev0");
  for (const auto& r : rows) {
    auto num = [&](const char* k) { return r[k].is_number() ? r[k].get<double>() : -1.0; };
    std::printf("%-5s %7d %11.1f %8s %10s %9.2f %12lld %8s %9s %11s %11s\n",
                r["mode"].get<std::string>().c_str(), r["devices"].get<int>(),
                num("samples_per_sec"),
                num("speedup") < 0 ? "-" : fmt::format("{:.2f}x", num("speedup")).c_str(),
                num("efficiency") < 0 ? "-"
                                      : fmt::format("{:.1f}%", 100 * num("efficiency")).c_str(),
                num("ms_per_step"), (long long)r["comm_bytes"].get<int64_t>(),
                r.value("comm_bytes_match", false) ? "equal" : "DIFFERS",
                num("busbw_gbps") < 0 ? "-" : fmt::format("{:.3f}GB/s", num("busbw_gbps")).c_str(),
                device0_bytes(r, "peak_memory_bytes").c_str(),
                device0_bytes(r, "peak_held_bytes").c_str());
  }
  std::printf("weak scaling: batch per device fixed; efficiency = speedup / devices; busbw: "
              "nccl-tests' bus bandwidth of the reduce (DP) / all-reduce (DDP); peak: bytes in "
              "use (PyTorch's max_memory_allocated), held: in use plus cached (its "
              "max_memory_reserved).\n");
}

}  // namespace

int run_worker(const BenchOptions& o) {
  SuiteOptions s = resolve(o);
  s.quiet = true;
  return run_rank_worker(o.worker, s, o.worker_out);
}

namespace {

// What a run of the suites (or a saved report directory) gives the table and the report.
struct Measured {
  std::vector<json> rows;
  json alpha_beta;  // null when not measured
  json env;
};

// Runs the suites: the alpha-beta sweep first when a report wants it, then every configuration
// in rounds; the environment records how much of the machine others took meanwhile.
Measured measure(const BenchOptions& o) {
  Measured m;
  SuiteOptions s = resolve(o);
  const auto suites = suites_of(o.suite);
  const CpuSnapshot cpu_start = cpu_snapshot();
  m.env = environment();
  m.env["device_spec"] = s.device_spec;
  s.env = m.env;
  const ModelFacts facts = model_facts(s.run.model, s.run.input_shape);
  if (!o.steps || !o.warmup) {
    // Windows of about 5 s and 1 s of warm-up at one device's step rate: stable medians for
    // small models, bounded time for big ones.
    const double t = probe_step_seconds(s.devices[0], s.run);
    s.run.steps = o.steps.value_or(std::clamp<int64_t>(std::llround(5.0 / t), 3, 100));
    s.run.warmup = o.warmup.value_or(std::clamp<int64_t>(std::llround(1.0 / t), 2, 10));
  }
  std::printf("replica-bench: %s on %s (counts %s), %s %s, %lld per device, %d thread%s per "
              "device; %d rounds of %lld warm-up + %lld timed steps per configuration\n",
              o.suite.c_str(), s.device_spec.c_str(),
              fmt::format("{}", fmt::join(s.counts, ",")).c_str(), s.run.model.c_str(),
              fmt::format("{}", fmt::join(s.run.input_shape, "x")).c_str(),
              (long long)s.run.batch_per_device, s.run.threads_per_device,
              s.run.threads_per_device == 1 ? "" : "s", s.run.repeat, (long long)s.run.warmup,
              (long long)s.run.steps);
  announce_variables(m.env["variables"]);
  std::fflush(stdout);
  if (!o.report_dir.empty() && !o.skip_alpha_beta && s.counts.back() >= 2 &&
      s.devices.size() >= 2) {
    std::printf("alpha-beta of the communication primitives ... ");
    std::fflush(stdout);
    m.alpha_beta = json::object();
    const auto sizes = sweep_sizes(double(facts.params) * 4);
    if (std::find(suites.begin(), suites.end(), "dp") != suites.end())
      m.alpha_beta.update(measure_dp_primitives(s.devices, s.run.threads_per_device, sizes));
    if (std::find(suites.begin(), suites.end(), "ddp") != suites.end())
      m.alpha_beta["ddp_allreduce"] = measure_ddp_allreduce(s, sizes);
    std::printf("done\n");
  }
  run_suites(s, suites, facts, m.rows);
  // How much of the machine other processes took meanwhile: the measurements' caveat.
  m.env["others_cpu_share"] = others_cpu_share(cpu_start, cpu_snapshot(), cpu_cores());
  for (auto& r : m.rows) r["env"] = m.env;
  return m;
}

// The report directory: results, measurements, projection, plots and report.md. Other engines'
// rows come from --compare, else from a re-rendered directory's compare.jsonl.
PlotOutcome write_report_dir(const BenchOptions& o, StagedDirectory& out, const Measured& m,
                             std::vector<json> compare, std::vector<std::string> compare_files,
                             double elapsed_s) {
  const fs::path dir = out.path();
  if (o.compare.empty() && !o.from_results.empty() &&
      fs::exists(fs::path(o.from_results) / "compare.jsonl") &&
      fs::file_size(fs::path(o.from_results) / "compare.jsonl") > 0) {
    compare = read_rows((fs::path(o.from_results) / "compare.jsonl").string());
    compare_files.push_back("compare.jsonl");
  }
  add_scaling(compare);
  std::optional<Link> link;
  if (!o.link.empty()) link = parse_link(o.link);
  const json projection = build_projection(m.rows, m.alpha_beta, link ? &*link : nullptr);
  // Everything is read by now, so rewriting the files of a re-rendered directory is safe.
  write_rows((dir / "results.jsonl").string(), m.rows);
  write_csv((dir / "results.csv").string(), m.rows);
  write_json_file((dir / "alpha_beta.json").string(),
                  m.alpha_beta.is_null() ? json::object() : m.alpha_beta);
  write_json_file((dir / "projection.json").string(), projection);
  if (compare.empty()) out.drop("compare.jsonl");  // an earlier report's rows are not this one's
  else write_rows((dir / "compare.jsonl").string(), compare);

  ReportInputs in;
  in.dir = dir.string();
  in.rows = m.rows;
  in.compare = compare;
  in.compare_files = compare_files;
  in.alpha_beta = m.alpha_beta;
  in.projection = projection;
  in.env = m.env;
  const PlotOutcome plots = draw_plots(dir.string(), current_executable());
  in.plots = plots.files;
  in.plot_note = plots.note;
  in.command = o.command_line;
  in.elapsed_s = elapsed_s;
  write_report(in);
  return plots;
}

}  // namespace

int run_parallel_suites(const BenchOptions& given) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool report = !given.report_dir.empty();
  REPLICA_USAGE_CHECK(given.from_results.empty() || report, "--from-results needs --report DIR");
  BenchOptions o = given;
  if (!o.trace_dir.empty() && !report) {
    std::error_code ec;
    fs::create_directories(o.trace_dir, ec);
    REPLICA_USAGE_CHECK(!ec && fs::is_directory(o.trace_dir), "cannot create directory '{}'",
                        o.trace_dir);
  }
  // The report is written into a staging directory and moved into place at the end: a full
  // disk or a Ctrl-C leaves the old report whole, never half old and half new.
  std::optional<StagedDirectory> staged;
  if (report) {
    staged.emplace(o.report_dir);
    o.report_dir = staged->path();
  }
  // Other engines' rows first: a bad file fails now, not after minutes of measuring.
  std::vector<json> compare;
  for (const auto& f : o.compare) {
    auto more = read_rows(f);
    for (auto& r : more)
      if (r.value("engine", "replica") == "replica") r["engine"] = "other";
    compare.insert(compare.end(), more.begin(), more.end());
  }
  Measured m;
  if (o.from_results.empty()) {
    m = measure(o);
  } else {
    m.rows = read_rows((fs::path(o.from_results) / "results.jsonl").string());
    m.alpha_beta = read_alpha_beta((fs::path(o.from_results) / "alpha_beta.json").string());
    m.env = m.rows[0].value("env", json());
  }
  add_scaling(m.rows);
  print_table(m.rows);
  if (!o.json.empty()) append_rows(o.json, m.rows);
  if (!o.csv.empty()) write_csv(o.csv, m.rows);
  if (!report) return 0;
  const double elapsed_s =
      o.from_results.empty()
          ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
          : 0.0;
  const PlotOutcome plots =
      write_report_dir(o, *staged, m, std::move(compare), o.compare, elapsed_s);
  staged->commit();
  std::printf("report: %s (%zu plot%s%s)\n",
              (fs::path(given.report_dir) / "report.md").c_str(), plots.files.size(),
              plots.files.size() == 1 ? "" : "s",
              plots.note.empty() ? "" : (": " + plots.note).c_str());
  return 0;
}

}  // namespace replica::bench
