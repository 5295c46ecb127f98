// replica-dp-vs-ddp's table: two replica-train runs' metrics (--metrics-json), DP's and DDP's,
// side by side, with what the difference means. Every figure is read through RunMetrics, so a
// figure missing from a run is one line naming the run and the figure, not half a table.
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/error.h"

namespace replica {

// One run's metrics (replica-train's --metrics-json) as the table reads them. A figure the
// metrics lack is an Error naming the run and the figure: a run that trained no step writes
// null for its loss, which the table met with nlohmann's "type must be number, but is null".
struct RunMetrics {
  std::string name;  // "DP" or "DDP"
  nlohmann::json m;

  Error missing(const std::string& key) const {
    return Error(fmt::format("the {} run (replica-train --mode {}) reported no {}, so the runs "
                             "cannot be compared",
                             name, name == "DP" ? "dp" : "ddp", key));
  }
  const nlohmann::json& field(const std::string& key) const {
    const auto it = m.find(key);
    if (it == m.end() || it->is_null()) throw missing(key);
    return *it;
  }
  double number(const std::string& key) const {
    const nlohmann::json& v = field(key);
    if (!v.is_number()) throw missing(key);
    return v.get<double>();
  }
  std::string text(const std::string& key) const {
    const nlohmann::json& v = field(key);
    if (!v.is_string()) throw missing(key);
    return v.get<std::string>();
  }
  // A figure per device (rank): at least one, each a number.
  std::vector<double> per_device(const std::string& key) const {
    const nlohmann::json& v = field(key);
    if (!v.is_array() || v.empty()) throw missing(key);
    std::vector<double> out;
    for (const auto& x : v) {
      if (!x.is_number()) throw missing(key);
      out.push_back(x.get<double>());
    }
    return out;
  }
  bool boolean(const std::string& key) const {
    const nlohmann::json& v = field(key);
    if (!v.is_boolean()) throw missing(key);
    return v.get<bool>();
  }
  bool evaluated() const { return m.contains("test_accuracy"); }  // not with --no-eval

  // Milliseconds per step of the named phases; a phase the run does not have counts 0. DP
  // records device phases on every device's track and sums them; `per_device` divides those by
  // the device count, so a DP figure reads like DDP's (rank 0's own device).
  double phase(std::initializer_list<const char*> names, bool per_device = false) const {
    const nlohmann::json& phases = field("phase_ms_per_step");
    if (!phases.is_object()) throw missing("phase_ms_per_step");
    double ms = 0;
    for (const char* n : names) {
      if (!phases.contains(n)) continue;
      if (!phases[n].is_number()) throw missing(fmt::format("phase_ms_per_step.{}", n));
      ms += phases[n].get<double>();
    }
    if (per_device && text("mode") == "dp")
      ms /= double(std::max<size_t>(1, field("devices").size()));
    return ms;
  }
};

// The table: throughput, accuracy, where each step's time went, what was sent and the memory it
// took, then what the difference means. `asked_steps`: --steps, which the header sets against
// the steps the runs took.
std::string comparison(const RunMetrics& dp, const RunMetrics& ddp, int64_t asked_steps);

}  // namespace replica
