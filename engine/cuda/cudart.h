// The CUDA runtime as the rest of the engine sees it: plain C++, no CUDA headers, so CPU-only
// builds compile the same callers against engine/cuda_stub.cpp. Errors throw replica::Error
// carrying file:line and the failing call.
#pragma once
#include <cstddef>
#include <string>

#include "engine/device.h"

namespace replica {

struct CudaState;

namespace cudart {

int device_count();  // 0 when there is no driver, no GPU, or no CUDA backend; never throws
std::string device_name(int ordinal);
size_t device_total_memory(int ordinal);
std::string versions();  // "CUDA runtime X, driver Y, cuBLAS Z, cuDNN W" (what is linked)

void set_device(int ordinal);
void* malloc_device(int ordinal, size_t bytes);  // throws replica::Error on failure (OOM)
void free_device(int ordinal, void* ptr);
void* malloc_pinned(size_t bytes);
void free_pinned(void* ptr);

// Stream, cuBLAS and cuDNN handles (bound to the stream), workspace. One per DeviceContext.
CudaState* create_state(const Device& device, bool deterministic);
void destroy_state(CudaState* state);
void synchronize(CudaState* state);  // cudaStreamSynchronize on the context's stream

// Events order work across streams (and devices) without a host sync.
void* event_create();              // timing disabled
void event_destroy(void* event);   // never throws
void event_record(CudaState* state, void* event);       // on the state's stream
void stream_wait_event(CudaState* state, void* event);  // the state's stream waits for it

}  // namespace cudart
}  // namespace replica
