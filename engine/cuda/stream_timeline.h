// StreamTimeline: trace spans timed by the GPU for work on one CUDA stream. Host-side spans show
// when the host enqueued work; with --trace a collective on a communication stream must show
// when the GPU ran it, to see it overlap the backward kernels on the compute stream. Around
// each piece of work a pair of timing events goes onto the stream itself; once both completed,
// the span enters the global Tracer (engine/trace.h) in host steady-clock microseconds, on its
// own track, as a device span (in the trace, not in the host's phase totals). A span's length
// is the GPU's own (end - start); its place maps to host time through an anchor event recorded
// on the idle stream and waited for: at the owner's start (anchor()) and again after every
// flush(), so the mapping never drifts far nor loses float precision over a long run.
// Nothing is recorded while the tracer is not recording, or before the first anchor.
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

  // Stamps GPU time on `stream` with the host clock. Call it only while the stream is idle
  // (it waits for the stream): after creating it, and after flush().
  void anchor(cudaStream_t stream);
  // Before work is enqueued on `stream` (the device current): true when a span was started,
  // which end() must then close on the same stream.
  bool begin(cudaStream_t stream);
  void end(cudaStream_t stream, const char* phase);
  // Resolves the spans whose work completed, without waiting. Never throws: on a CUDA error
  // the pending spans are dropped (the error shows where the owner checks its stream).
  void poll() noexcept;
  // Waits for every pending span's work and resolves it (a host sync: at the owner's
  // synchronize, once its stream is known to be idle).
  void flush();
  // Forgets the pending spans (their work may never finish: an aborted communicator).
  void drop() noexcept;

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
