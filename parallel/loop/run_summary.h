// What a training run reports: per-step phase times (from the tracer's totals), the per-epoch
// summary table printed at the end of a run, and JSON files written atomically.
#pragma once
#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace replica {

using PhaseTotals = std::map<std::string, double>;  // phase -> microseconds (Tracer totals)

// Milliseconds per step of each training phase between two snapshots of the tracer's totals
// (summed over devices and threads; evaluation and checkpoint writing are not training phases).
nlohmann::json phase_ms_per_step(const PhaseTotals& now, const PhaseTotals& before, int64_t steps);

// Each phase's share of the sum of phase_ms.
nlohmann::json phase_shares(const nlohmann::json& phase_ms);

// "  backward 15.8 ms (63%)  forward 8.7 ms (35%) ...", in pipeline order.
std::string phase_line(const nlohmann::json& phase_ms);

// The table of epochs (each as in the metrics JSON's "epoch_summaries"): loss, test loss and
// accuracy, samples/s, wall time, and milliseconds per step of the main phases; `scope` says
// whose phases they are ("summed over devices and threads", "rank 0").
std::string epoch_table(const nlohmann::json& epochs, const std::string& scope);

// "m:ss" or "h:mm:ss"; "--:--" when unknown.
std::string fmt_duration(double seconds);

// Writes FILE.tmp, then renames it over FILE: readers never see half a file.
void write_json_file(const std::string& path, const nlohmann::json& value);

}  // namespace replica
