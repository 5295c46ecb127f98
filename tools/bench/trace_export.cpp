#include "tools/bench/trace_export.h"

#include <cstdio>
#include <fstream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "engine/error.h"

namespace replica::bench {

namespace {

// Devices first, then the communication thread, then the host (the order a reader scans).
int track_rank(const std::string& track) {
  if (track == "comm") return 1;
  if (track == "host") return 2;
  return 0;
}

}  // namespace

void write_chrome_trace(const std::string& path, const std::vector<TraceProcess>& processes) {
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const auto& p : processes)
    for (const auto& e : p.events) origin = std::min(origin, e.start);
  if (origin == std::numeric_limits<int64_t>::max()) origin = 0;

  nlohmann::json events = nlohmann::json::array();
  for (size_t pi = 0; pi < processes.size(); ++pi) {
    const auto& p = processes[pi];
    const int pid = int(pi) + 1;
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
                      {"args", {{"name", p.name}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid},
                      {"args", {{"sort_index", pid}}}});
    std::map<std::pair<int, std::string>, int> order;  // (rank, track) -> tid
    for (const auto& e : p.events) order.emplace(std::make_pair(track_rank(e.track), e.track), 0);
    int next = 1;
    std::map<std::string, int> tid;
    for (auto& [key, t] : order) {
      t = next++;
      tid[key.second] = t;
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", t},
                        {"args", {{"name", key.second}}}});
      events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", t},
                        {"args", {{"sort_index", t}}}});
    }
    for (const auto& e : p.events)
      events.push_back({{"name", e.phase}, {"cat", e.phase}, {"ph", "X"}, {"pid", pid},
                        {"tid", tid[e.track]}, {"ts", e.start - origin},
                        {"dur", e.end - e.start}});
  }
  write_trace_file(path, events);
}

}  // namespace replica::bench
