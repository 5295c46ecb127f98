#include "tools/bench/plots.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#ifndef REPLICA_SOURCE_DIR
#define REPLICA_SOURCE_DIR ""
#endif

namespace replica::bench {

namespace {

namespace fs = std::filesystem;

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

bool imports_matplotlib(const std::string& python) {
  const std::string cmd = quote(python) + " -c 'import matplotlib' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

std::string find_python() {
  if (const char* p = std::getenv("REPLICA_PYTHON")) return imports_matplotlib(p) ? p : "";
  for (const char* p : {"/usr/bin/python3", "python3"})
    if (imports_matplotlib(p)) return p;
  return "";
}

std::string find_script(const std::string& self_exe) {
  if (const char* p = std::getenv("REPLICA_BENCH_PLOT")) return p;
  std::vector<fs::path> candidates;
  if (!std::string(REPLICA_SOURCE_DIR).empty())
    candidates.push_back(fs::path(REPLICA_SOURCE_DIR) / "tools" / "bench_plot.py");
  // build/bin/replica-bench -> tools/bench_plot.py of the tree the build lives in
  candidates.push_back(fs::path(self_exe).parent_path() / ".." / ".." / "tools" / "bench_plot.py");
  for (const auto& c : candidates)
    if (fs::exists(c)) return c.string();
  return "";
}

}  // namespace

PlotOutcome draw_plots(const std::string& dir, const std::string& self_exe) {
  PlotOutcome out;
  const std::string script = find_script(self_exe);
  if (script.empty()) {
    out.note = "tools/bench_plot.py was not found (set REPLICA_BENCH_PLOT); tables only";
    return out;
  }
  const std::string python = find_python();
  if (python.empty()) {
    out.note = "Python 3 with matplotlib was not found (install python3-matplotlib, e.g. with "
               "tools/setup.sh, or set REPLICA_PYTHON); tables only";
    return out;
  }
  const std::string cmd = quote(python) + " " + quote(script) + " " + quote(dir) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    out.note = "could not start " + python;
    return out;
  }
  char buf[1024];
  std::string last;
  while (fgets(buf, sizeof buf, p)) {
    std::string line = buf;
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (line.rfind("wrote ", 0) == 0) out.files.push_back(line.substr(6));
    else if (!line.empty()) last = line;
  }
  const int status = pclose(p);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    out.note = fmt::format("the plot script failed ({}); tables only", last.empty() ? "no output" : last);
  return out;
}

}  // namespace replica::bench
