// StreamTimeline: trace spans timed by the GPU for work on one CUDA stream. Host-side spans show
// when the host enqueued work; with --trace a collective on a communication stream must show
// when the GPU ran it, to see it overlap the backward kernels on the compute stream. Around
// each piece of work a pair of timing events goes onto the stream itself; once both completed,
// the span enters the global Tracer (engine/trace.h) in host steady-clock microseconds, on its
// own track, as a device span (in the trace, not in the host's phase totals). GPU time maps to
// host time through an anchor event, recorded and waited for once, when the first span begins.
// Nothing is recorded while the tracer is not recording.
// Not thread-safe: its owner serialises the calls (the NCCL group holds its lock).
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace replica {

class StreamTimeline {
 public:
  explicit StreamTimeline(std::string track) : track_(std::move(track)) {}
  ~StreamTimeline();  // resolves what completed and releases the events; never throws
  StreamTimeline(const StreamTimeline&) = delete;
  StreamTimeline& operator=(const StreamTimeline&) = delete;

  // Before work is enqueued on `stream` (the device current): true when a span was started,
  // which end() must then close on the same stream.
  bool begin(cudaStream_t stream);
  void end(cudaStream_t stream, const char* phase);
  // Resolves the spans whose work completed, without waiting.
  void poll();
  // Waits for every open span's work and resolves it (a host sync: at the owner's synchronize).
  void flush();

 private:
  struct Pending {
    cudaEvent_t start, end;
    const char* phase;
  };
  cudaEvent_t take();
  void resolve(const Pending& p);

  std::string track_;
  cudaEvent_t anchor_ = nullptr;
  int64_t anchor_us_ = 0;
  cudaEvent_t open_ = nullptr;  // the start event of a span begun and not yet ended
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace replica
