// The CUDA runtime as the rest of the engine sees it: plain C++, no CUDA headers. The functions
// forward to the CUDA backend plugin (libreplica_cuda.so, built from engine/cuda/), which is
// loaded the first time a GPU is asked for (engine/plugin.h). Without an NVIDIA driver the
// plugin is never loaded: device_count() is 0. Errors throw replica::Error carrying file:line
// and the failing call.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "engine/device.h"

namespace replica {

struct CudaState;
struct ContextOptions;  // engine/context.h
class Backend;

namespace cudart {

int device_count();  // 0 when there is no driver, no GPU, or no CUDA backend; never throws
std::string device_name(int ordinal);
size_t device_total_memory(int ordinal);
int compute_capability(int ordinal);  // major * 10 + minor: 90 on an H100
std::string versions();  // "CUDA runtime X, driver Y, cuBLAS Z, cuDNN W" (what is linked)

void set_device(int ordinal);
void* malloc_device(int ordinal, size_t bytes);  // throws replica::Error on failure (OOM)
void free_device(int ordinal, void* ptr);
void* malloc_pinned(size_t bytes);
void free_pinned(void* ptr);

// A stream, with cuBLAS and cuDNN handles bound to it. One per DeviceContext.
// As `options` say (engine/context.h): determinism, precision (Tf32: GEMMs and convolutions may
// use TF32 tensor cores), how convolution algorithms are picked. `threads` is not used.
CudaState* create_state(const Device& device, const ContextOptions& options);
void destroy_state(CudaState* state);
void synchronize(CudaState* state);  // cudaStreamSynchronize on the context's stream

// Events order work across streams (and devices) without a host sync.
void* event_create(CudaState* state);  // on the state's device, timing disabled
void event_destroy(void* event);   // never throws
void event_record(CudaState* state, void* event);       // on the state's stream
void stream_wait_event(CudaState* state, void* event);  // the state's stream waits for it
void event_synchronize(void* event);  // the host waits for it

std::unique_ptr<Backend> make_backend();  // the CUDA kernels (engine/ops.h)
// CUDA Graphs (engine/step_graph.h): what the state's stream is given between capture_begin and
// capture_end is recorded, not run, and instantiated into an executable graph (`nodes` set to
// its node count). capture_end always ends the capture, and throws when it failed (what the
// stream was given that it cannot record, e.g. a host sync, is named).
void capture_begin(CudaState* state);
void* capture_end(CudaState* state, size_t* nodes);
void capture_abort(CudaState* state);  // ends a capture, keeping nothing; never throws
void graph_launch(CudaState* state, void* graph);  // enqueued on the state's stream
void graph_destroy(void* graph);                   // never throws

// Loads the plugin even where no driver is seen (tests, --list-devices). Empty when the CUDA
// backend is usable as far as this machine allows; else why not, in one line.
std::string load_problem();

}  // namespace cudart

// The table libreplica_cuda.so hands out: one pointer per function above.
struct CudaPluginApi {
  int (*device_count)();
  std::string (*device_name)(int);
  size_t (*device_total_memory)(int);
  int (*compute_capability)(int);
  std::string (*versions)();
  void (*set_device)(int);
  void* (*malloc_device)(int, size_t);
  void (*free_device)(int, void*);
  void* (*malloc_pinned)(size_t);
  void (*free_pinned)(void*);
  CudaState* (*create_state)(const Device&, const ContextOptions&);
  void (*destroy_state)(CudaState*);
  void (*synchronize)(CudaState*);
  void* (*event_create)(CudaState*);
  void (*event_destroy)(void*);
  void (*event_record)(CudaState*, void*);
  void (*stream_wait_event)(CudaState*, void*);
  void (*event_synchronize)(void*);
  std::unique_ptr<Backend> (*make_backend)();
  void (*capture_begin)(CudaState*);
  void* (*capture_end)(CudaState*, size_t*);
  void (*capture_abort)(CudaState*);
  void (*graph_launch)(CudaState*, void*);
  void (*graph_destroy)(void*);
};

}  // namespace replica
