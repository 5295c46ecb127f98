// Chrome trace files (chrome://tracing, ui.perfetto.dev) from tracer spans of one or more
// processes: one Chrome process per replica process (a DDP rank, or the DP process), one thread
// row per track (a device, the communication thread "comm", the host).
#pragma once
#include <string>
#include <vector>

#include "engine/trace.h"

namespace replica::bench {

struct TraceProcess {
  std::string name;  // "DP process (cpu*2)", "rank 1 (cpu:1)"
  std::vector<Tracer::Event> events;
};

// Times become microseconds since the earliest span of all processes (they share the machine's
// steady clock). Throws replica::UsageError when the file cannot be written.
void write_chrome_trace(const std::string& path, const std::vector<TraceProcess>& processes);

}  // namespace replica::bench
