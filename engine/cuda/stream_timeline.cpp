#include "engine/cuda/stream_timeline.h"

#include "engine/cuda/cuda_check.h"
#include "engine/trace.h"

namespace replica {

StreamTimeline::~StreamTimeline() {
  try {
    poll();
  } catch (...) {
  }
  for (const Pending& p : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
  if (open_) cudaEventDestroy(open_);
  if (anchor_) cudaEventDestroy(anchor_);
}

cudaEvent_t StreamTimeline::take() {
  if (!free_.empty()) {
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  REPLICA_CUDA_CHECK(cudaEventCreate(&e));  // timing enabled
  return e;
}

bool StreamTimeline::begin(cudaStream_t stream) {
  if (!Tracer::global().recording() || open_) return false;
  if (!anchor_) {
    // GPU time zero of this timeline: recorded, waited for, and stamped with the host clock.
    REPLICA_CUDA_CHECK(cudaEventCreate(&anchor_));
    REPLICA_CUDA_CHECK(cudaEventRecord(anchor_, stream));
    REPLICA_CUDA_CHECK(cudaEventSynchronize(anchor_));
    anchor_us_ = Tracer::now_us();
  }
  open_ = take();
  REPLICA_CUDA_CHECK(cudaEventRecord(open_, stream));
  return true;
}

void StreamTimeline::end(cudaStream_t stream, const char* phase) {
  if (!open_) return;
  cudaEvent_t done = take();
  REPLICA_CUDA_CHECK(cudaEventRecord(done, stream));
  pending_.push_back({open_, done, phase});
  open_ = nullptr;
}

void StreamTimeline::resolve(const Pending& p) {
  float start_ms = 0, end_ms = 0;
  REPLICA_CUDA_CHECK(cudaEventElapsedTime(&start_ms, anchor_, p.start));
  REPLICA_CUDA_CHECK(cudaEventElapsedTime(&end_ms, anchor_, p.end));
  Tracer::global().record_device_span(track_, p.phase,
                                      anchor_us_ + int64_t(double(start_ms) * 1000.0),
                                      anchor_us_ + int64_t(double(end_ms) * 1000.0));
  free_.push_back(p.start);
  free_.push_back(p.end);
}

void StreamTimeline::poll() {
  while (!pending_.empty()) {
    const cudaError_t q = cudaEventQuery(pending_.front().end);
    if (q == cudaErrorNotReady) return;
    REPLICA_CUDA_CHECK(q);
    resolve(pending_.front());
    pending_.pop_front();
  }
}

void StreamTimeline::flush() {
  while (!pending_.empty()) {
    REPLICA_CUDA_CHECK(cudaEventSynchronize(pending_.front().end));
    resolve(pending_.front());
    pending_.pop_front();
  }
}

}  // namespace replica
