// Drawing the report's plots with tools/bench_plot.py (matplotlib). Missing Python or matplotlib
// is not an error: the report then says why it has tables only.
#pragma once
#include <string>
#include <vector>

namespace replica::bench {

struct PlotOutcome {
  std::vector<std::string> files;  // image files written into the directory
  std::string note;                // non-empty when no plots could be drawn: why
};

// Runs the plot script on dir (it reads results.jsonl, projection.json, compare.jsonl there).
// The interpreter: $REPLICA_PYTHON, else the first of /usr/bin/python3 and python3 that imports
// matplotlib; the script: $REPLICA_BENCH_PLOT, else tools/bench_plot.py of the source tree.
PlotOutcome draw_plots(const std::string& dir, const std::string& self_exe);

}  // namespace replica::bench
