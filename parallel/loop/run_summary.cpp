#include "parallel/loop/run_summary.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/error.h"
#include "engine/output_files.h"

namespace replica {

namespace {

// The order phases happen in within a step (DP and DDP); unknown phases sort after these.
const std::vector<std::string> kPipelineOrder = {
    "data_wait", "prefetch", "h2d", "batch_gather", "scatter", "forward", "gather_loss",
    "scatter_grad", "backward", "reduce", "wait_reduce", "allreduce", "wait_allreduce",
    "finalize", "step", "broadcast", "broadcast_buffers"};

int pipeline_rank(const std::string& phase) {
  auto it = std::find(kPipelineOrder.begin(), kPipelineOrder.end(), phase);
  return int(it - kPipelineOrder.begin());
}

std::vector<std::string> in_pipeline_order(const nlohmann::json& phase_ms) {
  std::vector<std::string> names;
  for (auto& [phase, ms] : phase_ms.items()) names.push_back(phase);
  std::stable_sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return pipeline_rank(a) < pipeline_rank(b);
  });
  return names;
}

std::string fmt_or_dash(const nlohmann::json& j, const char* key, const char* format_spec) {
  if (!j.contains(key) || !j[key].is_number()) return "-";
  return fmt::format(fmt::runtime(format_spec), j[key].get<double>());
}

}  // namespace

nlohmann::json phase_ms_per_step(const PhaseTotals& now, const PhaseTotals& before,
                                 int64_t steps) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [phase, us] : now) {
    if (phase == "evaluate" || phase == "checkpoint") continue;
    auto it = before.find(phase);
    const double delta = us - (it == before.end() ? 0.0 : it->second);
    out[phase] = steps > 0 ? delta / 1e3 / double(steps) : 0.0;
  }
  return out;
}

nlohmann::json phase_shares(const nlohmann::json& phase_ms) {
  double sum = 0;
  for (auto& [phase, ms] : phase_ms.items()) sum += ms.get<double>();
  nlohmann::json out = nlohmann::json::object();
  for (auto& [phase, ms] : phase_ms.items()) out[phase] = sum > 0 ? ms.get<double>() / sum : 0.0;
  return out;
}

std::string phase_line(const nlohmann::json& phase_ms) {
  const nlohmann::json share = phase_shares(phase_ms);
  std::string line;
  for (const auto& phase : in_pipeline_order(phase_ms))
    line += fmt::format("  {} {:.1f} ms ({:.0f}%)", phase, phase_ms[phase].get<double>(),
                        100 * share[phase].get<double>());
  return line;
}

std::string epoch_table(const nlohmann::json& epochs, const std::string& scope) {
  // Phase columns: forward, backward and step always (the same columns run after run), and any
  // other phase with at least 2% of the phase time in some epoch. The last column is the wall
  // time of a step: phases on different threads (a device's backward and the communication
  // thread's reduce) overlap, so the columns need not add up to it.
  nlohmann::json all = nlohmann::json::object();
  for (const auto& e : epochs) {
    if (!e.contains("phase_ms_per_step")) continue;
    const nlohmann::json shares = phase_shares(e["phase_ms_per_step"]);
    for (auto it = shares.begin(); it != shares.end(); ++it)
      if (it->get<double>() >= 0.02 || it.key() == "forward" || it.key() == "backward" ||
          it.key() == "step")
        all[it.key()] = 0.0;
  }
  const std::vector<std::string> columns = in_pipeline_order(all);
  std::string out = fmt::format("{:>5} {:>10} {:>9} {:>8} {:>9} {:>8}", "epoch", "train loss",
                                "test loss", "test acc", "samples/s", "time");
  for (const auto& c : columns) out += fmt::format(" {:>{}}", c, std::max<size_t>(c.size(), 7));
  out += fmt::format(" {:>9}\n", "wall/step");
  for (const auto& e : epochs) {
    out += fmt::format("{:>5} {:>10} {:>9} {:>8} {:>9} {:>8}", e.value("epoch", 0),
                       fmt_or_dash(e, "train_loss", "{:.4f}"), fmt_or_dash(e, "test_loss", "{:.4f}"),
                       fmt_or_dash(e, "test_accuracy", "{:.4f}"),
                       fmt_or_dash(e, "samples_per_sec", "{:.0f}"),
                       fmt_duration(e.value("seconds", 0.0)));
    const nlohmann::json ms = e.value("phase_ms_per_step", nlohmann::json::object());
    for (const auto& c : columns)
      out += fmt::format(" {:>{}.1f}", ms.contains(c) ? ms[c].get<double>() : 0.0,
                         std::max<size_t>(c.size(), 7));
    const int64_t steps = e.value("steps", int64_t(0));
    out += steps > 0 ? fmt::format(" {:>9.1f}\n", e.value("ms_per_step", 0.0))
                     : fmt::format(" {:>9}\n", "-");
  }
  out += "phase columns: milliseconds per step, " + scope +
         ";\nphases on different threads overlap: wall/step is a step's real time";
  for (const auto& e : epochs)
    if (e.contains("first_step_seconds"))
      out += fmt::format(";\nsamples/s and the columns per step leave out the run's first step "
                         "({:.2f} s: it allocates memory and warms caches)",
                         e["first_step_seconds"].get<double>());
  return out;
}

std::string fmt_duration(double seconds) {
  // Unknown, or past any clock's use (a run of --epochs 10^18): no digits.
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1e12) return "--:--";
  int64_t s = int64_t(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

void write_json_file(const std::string& path, const nlohmann::json& value) {
  write_file_atomically(path, value.dump(2) + "\n");
}

}  // namespace replica
