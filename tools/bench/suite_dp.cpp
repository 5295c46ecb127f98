// The DP suite: make_dp_engine over the first n devices, in this process, for every count.
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "parallel/dp_engine.h"
#include "tools/bench/suites.h"
#include "tools/bench/trace_export.h"

namespace replica::bench {

void run_dp_suite(const SuiteOptions& o, const ModelFacts& facts,
                  std::vector<nlohmann::json>& rows) {
  for (int n : o.counts) {
    Config c;
    c.mode = "dp";
    c.devices.assign(o.devices.begin(), o.devices.begin() + n);
    c.run = o.run;
    c.reduce = o.reduce;
    if (!o.trace_dir.empty() && c.run.trace_steps == 0) c.run.trace_steps = 5;
    if (!o.quiet) {
      std::printf("dp   %2d device%s  %s ... ", n, n == 1 ? " " : "s", o.run.model.c_str());
      std::fflush(stdout);
    }
    EngineOptions eo;
    eo.model = c.run.model;
    eo.input_shape = c.run.input_shape;
    eo.num_classes = 10;
    eo.seed = c.run.seed;
    eo.threads_per_device = c.run.threads_per_device;
    DpOptions dp;
    dp.strategy = parse_reduce_strategy(c.reduce);
    Measurement m;
    try {
      auto engine = make_dp_engine(c.devices, eo, dp);
      const auto batches =
          preload_batches(c.run.input_shape, n * c.run.batch_per_device, c.run.seed, 4);
      m = measure(*engine, batches, c.run);
    } catch (...) {
      if (!o.quiet) std::printf("failed\n");  // the error itself goes to stderr
      throw;
    }
    nlohmann::json row = make_row(c, facts, {m}, o.env);
    if (!o.trace_dir.empty()) {
      const std::string name = fmt::format("trace-dp-{}dev.json", n);
      write_chrome_trace((std::filesystem::path(o.trace_dir) / name).string(),
                         {{fmt::format("DP process ({} devices)", n), m.trace}});
      row["trace"] = name;
    }
    if (!o.quiet) {
      std::printf("%8.1f samples/s\n", row["samples_per_sec"].get<double>());
      std::fflush(stdout);
    }
    rows.push_back(row);
  }
}

}  // namespace replica::bench
