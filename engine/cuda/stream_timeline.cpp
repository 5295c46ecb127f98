#include "engine/cuda/stream_timeline.h"

#include "engine/cuda/cuda_check.h"
#include "engine/trace.h"

namespace replica {

StreamTimeline::~StreamTimeline() {
  poll();
  drop();
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

void StreamTimeline::anchor(cudaStream_t stream) {
  if (!anchor_) REPLICA_CUDA_CHECK(cudaEventCreate(&anchor_));
  REPLICA_CUDA_CHECK(cudaEventRecord(anchor_, stream));
  REPLICA_CUDA_CHECK(cudaEventSynchronize(anchor_));
  anchor_us_ = Tracer::now_us();
}

bool StreamTimeline::begin(cudaStream_t stream) {
  if (!anchor_ || open_ || !Tracer::global().recording()) return false;
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
  float offset_ms = 0, length_ms = 0;
  REPLICA_CUDA_CHECK(cudaEventElapsedTime(&offset_ms, anchor_, p.start));
  REPLICA_CUDA_CHECK(cudaEventElapsedTime(&length_ms, p.start, p.end));
  const int64_t start = anchor_us_ + int64_t(double(offset_ms) * 1000.0);
  Tracer::global().record_device_span(track_, p.phase, start,
                                      start + int64_t(double(length_ms) * 1000.0));
  free_.push_back(p.start);
  free_.push_back(p.end);
}

void StreamTimeline::poll() noexcept {
  try {
    while (!pending_.empty()) {
      const cudaError_t q = cudaEventQuery(pending_.front().end);
      if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();  // "not yet" is no error: the next launch check must not see it
        return;
      }
      REPLICA_CUDA_CHECK(q);
      resolve(pending_.front());
      pending_.pop_front();
    }
  } catch (...) {
    drop();
  }
}

void StreamTimeline::flush() {
  while (!pending_.empty()) {
    REPLICA_CUDA_CHECK(cudaEventSynchronize(pending_.front().end));
    resolve(pending_.front());
    pending_.pop_front();
  }
}

void StreamTimeline::drop() noexcept {
  for (const Pending& p : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  pending_.clear();
}

}  // namespace replica
