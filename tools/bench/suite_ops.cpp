// The "ops" suite: where one device's training step spends its time, op by op (conv2d_forward,
// batchnorm_backward, adam_step, ...). One device, preloaded batches, warm-up, a timed window
// of ordinary steps (the real ms/step), then the same number of steps with every op timed
// alone (engine/op_profile.h: the device synchronised around each op). The table gives each
// op's calls and milliseconds per step and its share of the profiled step; the profiled step
// is slower than the real one by what overlap and synchronisation cost, printed beside it.
// What it is for: holding a model's op mix against PyTorch's profiler on the same model and
// batch, and seeing which op a change should go after. Under an op, its parts (OpProfile's: a
// convolution's cuDNN calls and the copies that stage its operands, the F32 copies of the bf16
// storage layer) are printed indented, with their share of the op; the rest of the op's time
// is what it does besides (a bias, checks, launches).
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "engine/device.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "tools/bench/environment.h"
#include "tools/bench/harness.h"
#include "tools/bench/options.h"
#include "tools/bench/rows.h"

namespace replica::bench {

namespace {

using OpList = std::vector<std::pair<std::string, OpStats>>;

// The ops (or an op's parts), slowest first.
template <typename Map>
OpList slowest_first(const Map& stats) {
  OpList sorted(stats.begin(), stats.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  return sorted;
}

// An ordinary window of steps (the real ms/step), then the same steps again with every op timed
// into `profile`; returns the two ms/step.
std::pair<double, double> time_window(Stepper& stepper, DeviceContext& ctx, OpProfile& profile,
                                      const BenchOptions& o) {
  const int64_t steps = o.steps.value();
  stepper.seconds(std::max<int64_t>(o.warmup.value(), 1));
  const double real_ms = stepper.seconds(steps) * 1e3 / double(steps);
  ctx.set_op_profile(&profile);
  double profiled_ms = 0;
  try {
    profiled_ms = stepper.seconds(steps) * 1e3 / double(steps);
  } catch (...) {
    ctx.set_op_profile(nullptr);  // `profile` goes before the engine
    throw;
  }
  ctx.set_op_profile(nullptr);
  return {real_ms, profiled_ms};
}

using PartsByOp = std::map<std::string, std::map<std::string, OpStats>>;

// One op's line and its parts' lines beneath it; returns its fields for the JSON row.
nlohmann::json print_op(const std::string& key, const OpStats& s, const PartsByOp& parts,
                        double total_s, double steps, int width) {
  const double ms = s.seconds * 1e3 / steps, share = total_s > 0 ? s.seconds / total_s : 0;
  const double gb_per_s = s.seconds > 0 ? s.tensor_bytes / s.seconds / 1e9 : 0.0;
  std::printf("%-*s %10.1f %10.3f %7.1f%% %10.1f %9.1f\n", width, key.c_str(),
              double(s.calls) / steps, ms, 100 * share,
              s.calls ? s.seconds * 1e6 / double(s.calls) : 0.0, gb_per_s);
  const size_t space = key.find(' ');  // by shape, the key is "op [shape] [shape] ..."
  nlohmann::json row = {{"op", key.substr(0, space)}, {"calls_per_step", double(s.calls) / steps},
                        {"ms_per_step", ms}, {"share", share}, {"tensor_gb_per_s", gb_per_s}};
  if (space != std::string::npos) row["shapes"] = key.substr(space + 1);
  if (auto it = parts.find(key); it != parts.end()) {
    for (const auto& [part, ps] : slowest_first(it->second)) {
      const double part_ms = ps.seconds * 1e3 / steps;
      std::printf("  %-*s %10.1f %10.3f %7.1f%% of the op\n", width - 2, part.c_str(),
                  double(ps.calls) / steps, part_ms,
                  s.seconds > 0 ? 100 * ps.seconds / s.seconds : 0.0);
      row["parts_ms_per_step"][part] = part_ms;
    }
  }
  return row;
}

}  // namespace

int run_ops_suite(const BenchOptions& o) {
  validate_common(o);
  const std::string spec = !o.devices.empty() ? o.devices : cuda_device_count() > 0 ? "cuda:0"
                                                                                      : "cpu";
  const Device device = parse_devices(spec, /*allow_multi=*/false).at(0);
  RunOptions run;
  run.model = o.model;
  run.input_shape = resolve_input_shape(o);
  run.batch_per_device = o.batch;
  run.seed = o.seed;
  run.threads_per_device = o.threads_per_device.value_or(0);  // CPU: 0 = every core
  run.precision = resolve_precision(o.precision, {device});
  run.cudnn_benchmark = o.cudnn_benchmark;
  run.channels_last = resolve_channels_last(o.memory_format, run.precision, {device});
  auto engine = make_single_device_engine(device, engine_options(run));
  const Preloaded pre = preload_batches(run.input_shape, o.batch, o.seed, 4, engine.get());

  Stepper stepper{*engine, pre.batches, {}};
  OpProfile profile(o.by_shape);
  const auto [real_ms, profiled_ms] = time_window(stepper, *engine->contexts().at(0), profile, o);

  const OpList ops = slowest_first(profile.ops());
  double total_s = 0;
  for (const auto& [name, stats] : ops) total_s += stats.seconds;
  const std::string shape = fmt::format("{}", fmt::join(run.input_shape, "x"));
  std::printf("replica-bench: suite ops, %s on %s (%s%s), %s, batch %lld, %lld steps\n",
              o.model.c_str(), device.str().c_str(), precision_name(run.precision),
              run.channels_last ? ", channels_last" : "", shape.c_str(), (long long)o.batch,
              (long long)o.steps.value());
  const nlohmann::json variables = tuning_variables();
  announce_variables(variables);
  int width = 28;  // by shape, as wide as the widest key
  for (const auto& [key, s] : ops) width = std::max(width, int(key.size()));
  std::printf("%-*s %10s %10s %8s %10s %9s\n", width, o.by_shape ? "op and tensor shapes" : "op",
              "calls/step", "ms/step", "share", "us/call", "GB/s");
  const nlohmann::json run_fields = {
      {"suite", "ops"}, {"engine", "replica"}, {"model", o.model}, {"input_shape", shape},
      {"batch", o.batch}, {"device", device.str()}, {"precision", precision_name(run.precision)},
      {"memory_format", memory_format_name(run.channels_last)}, {"step_ms", real_ms},
      {"profiled_step_ms", profiled_ms}, {"variables", variables}};
  const PartsByOp parts = profile.parts();
  std::vector<nlohmann::json> rows;
  for (const auto& [key, s] : ops) {
    nlohmann::json row = run_fields;
    row.update(print_op(key, s, parts, total_s, double(o.steps.value()), width));
    rows.push_back(std::move(row));
  }
  std::printf("ops %.3f ms of a profiled step of %.3f ms; an ordinary step takes %.3f ms (the "
              "difference: overlap and a synchronisation per op%s)\n",
              total_s * 1e3 / double(o.steps.value()), profiled_ms, real_ms,
              o.by_shape ? ", and formatting the shapes" : "");
  std::printf("GB/s: the bytes of an op's tensors, each once, over its time: a floor on the "
              "memory it moved (held against the device's bandwidth for the memory-bound ops)\n");
  if (!o.json.empty()) append_rows(o.json, rows);
  return 0;
}

}  // namespace replica::bench
