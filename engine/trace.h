// Tracing: cheap spans (track, phase, start, end) collected in memory and written as Chrome
// trace JSON (open in chrome://tracing or ui.perfetto.dev). Phase totals are kept even when
// event recording is off, so every run can report where its time went.
// On CUDA a span measures the host's view; when `sync_device` is set (with --trace), a span
// waits for its device before closing, so spans show device time at the cost of overlap.
// Collectives on a communication stream are timed by the GPU itself (device spans), so their
// overlap with the compute stream shows.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace replica {

class DeviceContext;

class Tracer {
 public:
  static Tracer& global();

  void set_recording(bool on) { recording_ = on; }
  bool recording() const { return recording_; }
  void set_sync_device(bool on) { sync_device_ = on; }
  bool sync_device() const { return sync_device_; }

  static int64_t now_us();
  void record(const std::string& track, const std::string& phase, int64_t start_us,
              int64_t end_us);
  // A span the GPU timed (engine/cuda/stream_timeline.h), in now_us() time: in the trace while
  // recording, but not in the phase totals, which are the host's view of every phase.
  void record_device_span(const std::string& track, const std::string& phase, int64_t start_us,
                          int64_t end_us);
  // Totals per phase (microseconds), summed over tracks, since the last reset.
  std::map<std::string, double> phase_totals_us() const;
  void reset_totals();
  // Every recorded span as Chrome trace events of process `pid` named `process_name`, a thread
  // per track. Timestamps are now_us() values, not shifted: traces of several processes on one
  // machine (DDP ranks) line up when their events are put into one file.
  nlohmann::json chrome_events(int pid = 1, const std::string& process_name = "replica") const;
  // Writes chrome_events() to a file. Throws replica::UsageError if it cannot be written.
  void write_chrome_json(const std::string& path, int pid = 1,
                         const std::string& process_name = "replica") const;
  size_t event_count() const;

  // A recorded span; times are now_us() values (steady clock, comparable across processes on
  // one machine).
  struct Event {
    std::string track, phase;
    int64_t start, end;
  };
  // A copy of the spans recorded so far, and dropping them (e.g. between measurement windows).
  std::vector<Event> events() const;
  void clear_events();

 private:
  mutable std::mutex mutex_;
  bool recording_ = false, sync_device_ = false;
  std::vector<Event> events_;
  std::map<std::string, double> totals_;
};

// Writes a Chrome trace file, {"traceEvents": events, "displayTimeUnit": "ms"}, atomically
// (FILE.tmp, then a rename). Throws replica::UsageError if it cannot be written.
void write_trace_file(const std::string& path, const nlohmann::json& events);

// RAII span on the global tracer. `ctx` (optional) is synchronised first when sync_device().
class TraceSpan {
 public:
  TraceSpan(std::string track, std::string phase, DeviceContext* ctx = nullptr);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  std::string track_, phase_;
  DeviceContext* ctx_;
  int64_t start_;
};

}  // namespace replica
