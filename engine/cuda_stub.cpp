// The CUDA runtime interface for builds without the CUDA backend: zero GPUs, and a clear
// error for anything that would need one.
#include "engine/cuda/cudart.h"
#include "engine/error.h"
#include "engine/ops.h"

namespace replica {
namespace cudart {

namespace {
[[noreturn]] void no_cuda() { throw Error("this build of replica has no CUDA backend"); }
}  // namespace

int device_count() { return 0; }
std::string device_name(int) { no_cuda(); }
size_t device_total_memory(int) { no_cuda(); }
std::string versions() { return "no CUDA backend"; }
void set_device(int) { no_cuda(); }
void* malloc_device(int, size_t) { no_cuda(); }
void free_device(int, void*) {}
void* malloc_pinned(size_t) { no_cuda(); }
void free_pinned(void*) {}
CudaState* create_state(const Device&, bool) { no_cuda(); }
void destroy_state(CudaState*) {}
void synchronize(CudaState*) {}
void* event_create() { no_cuda(); }
void event_destroy(void*) {}
void event_record(CudaState*, void*) { no_cuda(); }
void stream_wait_event(CudaState*, void*) { no_cuda(); }

}  // namespace cudart

std::unique_ptr<Backend> make_cuda_backend() { throw Error("this build of replica has no CUDA backend"); }

}  // namespace replica
