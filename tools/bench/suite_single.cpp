// The "single" suite: training throughput of one CPU device per thread count, against the
// measured sgemm ceiling of the same machine (OpenBLAS, one thread per call).
//
// What is timed: --warmup untimed steps, then --steps optimizer steps with no host sync in
// between; one synchronize() and one loss readback at the end. Batches are synthetic and
// PRELOADED (a few batches prepared before timing, cycled), so the loader thread does not
// compete with the compute threads for the cores: this is the engine's step rate.
// Training FLOPs are counted as 3x the forward FLOPs (forward, data gradients, weight gradients).
#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "engine/cpu/cpu_backend.h"
#include "engine/device.h"
#include "engine/error.h"
#include "parallel/engines/train_engine.h"
#include "tools/bench/environment.h"
#include "tools/bench/harness.h"
#include "tools/bench/options.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"

namespace replica::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct GemmShape {
  int64_t m, n, k;
  std::string name() const { return fmt::format("{}x{}x{}", m, n, k); }
};
// Square (the library's best case) and conv-like (the CNN's conv2 as im2col GEMM: 20 filters,
// 20x20 outputs, 20*5*5 = 500 reduction).
const std::vector<GemmShape> kGemmShapes = {{512, 512, 512}, {20, 400, 500}};

struct Result {  // one configuration = one table row = one JSON line
  nlohmann::json j;
};

// CPU seconds this process used so far (all threads, user + system).
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// GFLOP/s of `threads` threads, each calling sgemm (one thread per call) on its own matrices
// concurrently inside one task_arena, for about `seconds`.
double sgemm_gflops(const GemmShape& g, int threads, double seconds) {
  cpu::pin_blas_to_one_thread();
  tbb::task_arena arena(threads);
  std::atomic<int64_t> calls{0};
  double elapsed = 0;
  arena.execute([&] {
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::duration<double>(seconds);
    tbb::parallel_for(0, threads, 1, [&](int) {
      std::vector<float> a(g.m * g.k, 0.5f), b(g.k * g.n, 0.25f), c(g.m * g.n, 0.f);
      cpu::sgemm(false, false, g.m, g.n, g.k, 1.f, a.data(), g.k, b.data(), g.n, 0.f, c.data(),
                 g.n);  // untimed-ish first call: page faults, library init
      int64_t mine = 0;
      while (Clock::now() < deadline) {
        cpu::sgemm(false, false, g.m, g.n, g.k, 1.f, a.data(), g.k, b.data(), g.n, 0.f,
                   c.data(), g.n);
        ++mine;
      }
      calls += mine;
    }, tbb::simple_partitioner());
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  });
  return 2.0 * g.m * g.n * g.k * double(calls.load()) / elapsed / 1e9;
}

// The single-device suite: one CPU engine per thread count.
void suite_single(const BenchOptions& o, const Shape& shape, const std::vector<int64_t>& threads,
                  std::vector<Result>& results) {
  const int64_t warmup = o.warmup.value(), steps = o.steps.value();
  const int repeat = o.repeat.value();
  const Preloaded pre = preload_batches(shape, o.batch, o.seed, 4);  // CPU: host memory
  const std::vector<Batch>& batches = pre.batches;
  const Device device{DeviceType::CPU, 0, 0};
  for (int64_t t : threads) {
    EngineOptions eo;
    eo.model = o.model;
    eo.input_shape = shape;
    eo.num_classes = 10;
    eo.seed = o.seed;
    eo.threads_per_device = int(t);
    auto engine = make_single_device_engine(device, eo);
    size_t next = 0;
    for (int64_t s = 0; s < warmup; ++s) engine->train_step(batches[next++ % batches.size()]);
    engine->synchronize();
    std::vector<double> seconds, cpu_share;
    float loss = 0;
    for (int r = 0; r < repeat; ++r) {
      const double cpu0 = process_cpu_seconds();
      const auto t0 = Clock::now();
      for (int64_t s = 0; s < steps; ++s) engine->train_step(batches[next++ % batches.size()]);
      engine->synchronize();
      seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      // Below 1: the threads did not get their cores (other load on the machine).
      cpu_share.push_back((process_cpu_seconds() - cpu0) / (seconds.back() * double(t)));
      loss = engine->last_loss();  // once per timed window, after its clock stopped
      REPLICA_CHECK(std::isfinite(loss), "loss is {} after {} steps", loss, next);
    }
    std::vector<double> sps;
    for (double s : seconds) sps.push_back(double(steps * o.batch) / s);
    const double med = median(sps);
    const double macs = engine->forward_macs_per_sample();
    nlohmann::json j = {
        {"suite", o.suite},
        {"mode", engine->mode()},
        {"model", o.model},
        {"input_shape", fmt::format("{}", fmt::join(shape, "x"))},
        {"device", device.str()},
        {"threads", engine->primary().threads()},
        {"batch", o.batch},
        {"warmup_steps", warmup},
        {"timed_steps", steps},
        {"repeats", repeat},
        {"data", preloaded_data_name({device})},
        {"samples_per_sec", med},
        {"samples_per_sec_runs", sps},
        {"ms_per_step", 1e3 * o.batch / med},
        {"forward_gflop_per_sample", 2 * macs / 1e9},
        {"train_gflops", 3 * 2 * macs * med / 1e9},
        {"train_flops_note", "training counted as 3x forward FLOPs"},
        {"final_loss", loss},
        {"cpu_share", median(cpu_share)},
    };
    results.push_back({j});
  }
}

// threads -> GFLOP/s per kGemmShapes entry: the median of o.repeat windows each, printed as
// each thread count is done.
std::map<int64_t, std::vector<double>> sgemm_ceiling(const BenchOptions& o,
                                                     const std::vector<int64_t>& threads) {
  std::map<int64_t, std::vector<double>> ceiling;
  for (int64_t t : threads) {
    if (ceiling.count(t)) continue;
    std::string line = fmt::format("  {} thread{}:", t, t == 1 ? " " : "s");
    for (const auto& g : kGemmShapes) {
      std::vector<double> runs;
      for (int r = 0; r < o.repeat.value(); ++r)
        runs.push_back(sgemm_gflops(g, int(t), o.sgemm_seconds));
      ceiling[t].push_back(median(runs));
      line += fmt::format("  {} {:7.1f} GFLOP/s", g.name(), ceiling[t].back());
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  return ceiling;
}

// Checks the flags that make no sense for this suite and returns the thread counts to time
// (default: 1 and every core).
std::vector<int64_t> checked_thread_counts(const BenchOptions& o, int cores) {
  validate_common(o);
  REPLICA_USAGE_CHECK(
      resolve_precision(o.precision, {Device{DeviceType::CPU, 0, 0}}) == Precision::Fp32,
      "--suite single measures CPU threads in fp32; --precision {} is for dp, ddp and ops",
      o.precision);
  REPLICA_USAGE_CHECK(!o.cudnn_benchmark,
                      "--suite single measures CPU threads; --cudnn-benchmark is for dp, ddp and "
                      "ops on GPUs");
  REPLICA_USAGE_CHECK(o.memory_format == "auto",
                      "--suite single measures CPU threads; --memory-format is for dp, ddp and "
                      "ops on GPUs");
  REPLICA_USAGE_CHECK(o.sgemm_seconds > 0 && o.sgemm_seconds <= 60,
                      "--sgemm-seconds must be in (0, 60], got {}", o.sgemm_seconds);
  if (o.threads.empty()) {
    std::vector<int64_t> threads = {1};
    if (cores > 1) threads.push_back(cores);
    return threads;
  }
  REPLICA_USAGE_CHECK(o.threads.find_first_not_of("0123456789,") == std::string::npos,
                      "--threads '{}': expected a comma list like 1,2", o.threads);
  const std::vector<int64_t> threads = parse_positive_list(o.threads, ',', "--threads");
  for (int64_t t : threads) check_cpu_threads("--threads", t);
  return threads;
}

}  // namespace

int run_single_suite(const BenchOptions& o) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  const std::vector<int64_t> threads = checked_thread_counts(o, cores);
  const Shape shape = resolve_input_shape(o);
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);

  // 1. The sgemm ceiling for every thread count, measured in this run.
  std::printf("replica-bench: suite %s, %d cores, load average %.2f %.2f %.2f\n",
              o.suite.c_str(), cores, load[0], load[1], load[2]);
  const nlohmann::json variables = tuning_variables();
  announce_variables(variables);
  std::printf("sgemm ceiling (OpenBLAS, %s, one thread per call; t threads call it concurrently "
              "in one task_arena; median of %d x %.1f s):\n",
              blas_kernels().c_str(), o.repeat.value(), o.sgemm_seconds);
  std::map<int64_t, std::vector<double>> ceiling = sgemm_ceiling(o, threads);

  // 2. The suite.
  std::vector<Result> results;
  suite_single(o, shape, threads, results);

  // 3. Ratios measured in this run, the table, the JSON lines.
  double base_sps = 0;
  for (const auto& r : results)
    if (r.j["threads"] == 1) base_sps = r.j["samples_per_sec"];
  std::printf("\n%-9s %-10s %-6s %5s %5s %11s %9s %10s %10s %9s %8s %5s\n", "model", "input",
              "device", "thr", "batch", "samples/s", "ms/step", "fwd GFLOP", "train GF/s",
              "% sgemm", "speedup", "cpu");
  for (auto& r : results) {
    auto& j = r.j;
    const int64_t t = j["threads"];
    const double sps = j["samples_per_sec"], gf = j["train_gflops"];
    const auto& c = ceiling.count(t) ? ceiling[t] : std::vector<double>{0, 0};
    j["load_avg_1m"] = load[0];
    j["variables"] = variables;
    j["sgemm_peak_gflops"] = c[0];
    j["sgemm_peak_shape"] = kGemmShapes[0].name();
    j["sgemm_conv_like_gflops"] = c[1];
    j["sgemm_conv_like_shape"] = kGemmShapes[1].name();
    j["fraction_of_sgemm_peak"] = c[0] > 0 ? gf / c[0] : 0.0;
    j["speedup_vs_1_thread"] = base_sps > 0 ? nlohmann::json(sps / base_sps) : nullptr;
    std::printf("%-9s %-10s %-6s %5lld %5lld %11.1f %9.2f %10.4f %10.1f %8.1f%% %8s %4.0f%%\n",
                std::string(j["model"]).c_str(), std::string(j["input_shape"]).c_str(),
                std::string(j["device"]).c_str(), (long long)t, (long long)o.batch, sps,
                double(j["ms_per_step"]), double(j["forward_gflop_per_sample"]), gf,
                100 * double(j["fraction_of_sgemm_peak"]),
                base_sps > 0 ? fmt::format("{:.2f}x", sps / base_sps).c_str() : "-",
                100 * double(j["cpu_share"]));
  }
  if (!o.json.empty()) {
    std::vector<nlohmann::json> rows;
    for (const auto& r : results) rows.push_back(r.j);
    append_rows(o.json, rows);
  }
  std::printf(
      "train GF/s counts training as 3x the forward FLOPs (forward + data and weight grads).\n"
      "%% sgemm: train GF/s over the %s sgemm ceiling at the same thread count, this run.\n"
      "speedup: vs 1 thread, this run. cpu: CPU time / (wall x threads) while timed; well below\n"
      "100%% means other load took the cores. Batches: synthetic, preloaded (loader not timed);\n"
      "median of %d window%s of %lld steps after %lld warmup steps.\n",
      kGemmShapes[0].name().c_str(), o.repeat.value(), o.repeat == 1 ? "" : "s",
      (long long)o.steps.value(), (long long)o.warmup.value());
  return 0;
}

}  // namespace replica::bench
