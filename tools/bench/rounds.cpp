// The dp/ddp suites in rounds: every configuration measured once per round, in turn.
#include <cstdio>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "tools/bench/suites.h"
#include "tools/bench/trace_export.h"

namespace replica::bench {

void run_suites(const SuiteOptions& o, const std::vector<std::string>& suites,
                const ModelFacts& facts, std::vector<nlohmann::json>& rows) {
  const int rounds = o.run.repeat;
  const bool tracing = !o.trace_dir.empty();
  std::map<std::pair<std::string, int>, std::vector<Measurement>> acc;  // (suite, n) -> ranks
  for (int round = 0; round < rounds; ++round) {
    if (!o.quiet) {
      std::printf("round %d/%d:", round + 1, rounds);
      std::fflush(stdout);
    }
    for (const auto& suite : suites)
      for (int n : o.counts) {
        RunOptions run = o.run;
        run.repeat = 1;
        const bool last = round + 1 == rounds;
        run.trace_steps = last && tracing ? o.run.trace_steps : 0;
        std::vector<Measurement> ms;
        try {
          ms = suite == "dp" ? measure_dp(o, n, run) : measure_ddp(o, n, run);
        } catch (...) {
          if (!o.quiet) std::printf("  %s %d failed\n", suite.c_str(), n);  // the error: stderr
          throw;
        }
        auto& total = acc[{suite, n}];
        total.resize(ms.size());
        for (size_t r = 0; r < ms.size(); ++r) merge(total[r], ms[r]);
        if (!o.quiet) {
          double slowest = 0;
          for (const auto& m : ms) slowest = std::max(slowest, m.window_seconds.back());
          std::printf("  %s %d: %.0f", suite.c_str(), n,
                      double(n * run.batch_per_device * run.steps) / slowest);
          std::fflush(stdout);
        }
      }
    if (!o.quiet) std::printf(" samples/s\n");
  }

  for (const auto& suite : suites)
    for (int n : o.counts) {
      Config c;
      c.mode = suite;
      c.devices.assign(o.devices.begin(), o.devices.begin() + n);
      c.run = o.run;
      c.reduce = o.reduce;
      c.backend = ddp_backend(o, n);
      const auto& ranks = acc.at({suite, n});
      nlohmann::json row = make_row(c, facts, ranks, o.env);
      if (tracing) {
        const std::string name = fmt::format("trace-{}-{}dev.json", suite, n);
        std::vector<TraceProcess> processes;
        if (suite == "dp") {
          processes.push_back({fmt::format("DP process ({} devices)", n), ranks[0].trace});
        } else {
          for (int r = 0; r < n; ++r)
            processes.push_back({fmt::format("rank {} ({})", r, c.devices[r].str()), ranks[r].trace});
        }
        write_chrome_trace((std::filesystem::path(o.trace_dir) / name).string(), processes);
        row["trace"] = name;
      }
      rows.push_back(row);
    }
}

}  // namespace replica::bench
