#include "engine/trace.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/output_files.h"

namespace replica {

Tracer& Tracer::global() {
  static Tracer t;
  return t;
}

int64_t Tracer::now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
}

void Tracer::record(const std::string& track, const std::string& phase, int64_t start_us,
                    int64_t end_us) {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_[phase] += double(end_us - start_us);
  if (recording_) events_.push_back({track, phase, start_us, end_us});
}

void Tracer::record_device_span(const std::string& track, const std::string& phase,
                                int64_t start_us, int64_t end_us) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (recording_) events_.push_back({track, phase, start_us, end_us});
}

std::map<std::string, double> Tracer::phase_totals_us() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return totals_;
}

void Tracer::reset_totals() {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_.clear();
}

size_t Tracer::event_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::vector<Tracer::Event> Tracer::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

void Tracer::clear_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
}

nlohmann::json Tracer::chrome_events(int pid, const std::string& process_name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // One Chrome "thread" per track, named with metadata events.
  std::map<std::string, int> tids;
  for (const auto& e : events_) tids.emplace(e.track, 0);
  int next = 1;
  for (auto& [track, tid] : tids) tid = next++;
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
                    {"args", {{"name", process_name}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid},
                    {"args", {{"sort_index", pid}}}});
  for (const auto& [track, tid] : tids)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                      {"args", {{"name", track}}}});
  for (const auto& e : events_)
    events.push_back({{"name", e.phase}, {"cat", e.phase}, {"ph", "X"}, {"pid", pid},
                      {"tid", tids[e.track]}, {"ts", e.start}, {"dur", e.end - e.start}});
  return events;
}

void Tracer::write_chrome_json(const std::string& path, int pid,
                               const std::string& process_name) const {
  write_trace_file(path, chrome_events(pid, process_name));
}

void write_trace_file(const std::string& path, const nlohmann::json& events) {
  write_file_atomically(
      path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
}

TraceSpan::TraceSpan(std::string track, std::string phase, DeviceContext* ctx)
    : track_(std::move(track)), phase_(std::move(phase)), ctx_(ctx), start_(Tracer::now_us()) {}

TraceSpan::~TraceSpan() {
  Tracer& t = Tracer::global();
  // Not while the context captures a step: its work has not run, and a sync breaks the capture.
  if (ctx_ && t.sync_device() && ctx_->is_cuda() && !ctx_->capturing()) {
    try {
      ctx_->synchronize();
    } catch (...) {
    }
  }
  t.record(track_, phase_, start_, Tracer::now_us());
}

}  // namespace replica
