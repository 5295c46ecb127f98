// report.md: the tables, formulas, projection and links of a scaling report, next to the plots
// tools/bench_plot.py drew (or a note saying why there are none).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace replica::bench {

struct ReportInputs {
  std::string dir;                           // report.md is written here
  std::vector<nlohmann::json> rows;          // replica's rows (scaling filled in)
  std::vector<nlohmann::json> compare;       // rows of other engines (PyTorch), scaling filled in
  std::vector<std::string> compare_files;    // where they came from
  nlohmann::json alpha_beta;                 // alpha_beta.h's measurements (may be null)
  nlohmann::json projection;                 // build_projection()
  nlohmann::json env;                        // environment()
  std::vector<std::string> plots;            // image files written into dir
  std::string plot_note;                     // non-empty: why plots are missing
  std::string command;                       // how the report was made
  double elapsed_s = 0;                      // 0: rendered from saved results
};

// Writes dir/report.md. Throws UsageError when it cannot be written.
void write_report(const ReportInputs& in);

}  // namespace replica::bench
