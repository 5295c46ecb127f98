// engine/cudart.h for the host side: each function forwards to the CUDA backend plugin's table.
// The plugin is loaded on the first call that needs a GPU; device_count() first looks for the
// NVIDIA driver's device nodes, so a machine without a driver never loads cuBLAS or cuDNN.
#include "engine/cudart.h"

#include <unistd.h>

#include "engine/error.h"
#include "engine/ops.h"
#include "engine/plugin.h"
#include "engine/plugin_abi.h"

namespace replica {

namespace {

const char* kPlugin = "replica_cuda";

// The driver's device nodes (Linux; /dev/dxg under WSL). Without them cudaGetDeviceCount could
// only say "no driver", at the price of loading the whole GPU stack.
bool driver_present() {
  for (const char* node : {"/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg"})
    if (access(node, F_OK) == 0) return true;
  return false;
}

struct Loaded {
  const CudaPluginApi* api = nullptr;
  std::string problem;  // why api is null
};

const Loaded& loaded() {
  static const Loaded l = [] {
    Loaded r;
    r.api = static_cast<const CudaPluginApi*>(Plugin::get(kPlugin).table(REPLICA_PLUGIN_ABI,
                                                                          &r.problem));
    return r;
  }();
  return l;
}

// The table, or an Error saying why CUDA cannot be used.
const CudaPluginApi& api() {
  const Loaded& l = loaded();
  if (!l.api) throw Error(fmt::format("the CUDA backend {}", l.problem));
  return *l.api;
}

}  // namespace

namespace cudart {

int device_count() {
  static const int count = [] {
    if (!driver_present()) return 0;
    const Loaded& l = loaded();
    return l.api ? l.api->device_count() : 0;
  }();
  return count;
}

std::string load_problem() { return loaded().problem; }

std::string device_name(int ordinal) { return api().device_name(ordinal); }
size_t device_total_memory(int ordinal) { return api().device_total_memory(ordinal); }
int compute_capability(int ordinal) { return api().compute_capability(ordinal); }
std::string versions() {
  const Loaded& l = loaded();
  return l.api ? l.api->versions() : "CUDA backend " + l.problem;
}
void set_device(int ordinal) { api().set_device(ordinal); }
void* malloc_device(int ordinal, size_t bytes) { return api().malloc_device(ordinal, bytes); }
void* malloc_pinned(size_t bytes) { return api().malloc_pinned(bytes); }
CudaState* create_state(const Device& device, const ContextOptions& options) {
  return api().create_state(device, options);
}
void* event_create(CudaState* state) { return api().event_create(state); }
void event_record(CudaState* state, void* event) { api().event_record(state, event); }
void stream_wait_event(CudaState* state, void* event) { api().stream_wait_event(state, event); }
void event_synchronize(void* event) { api().event_synchronize(event); }
std::unique_ptr<Backend> make_backend() { return api().make_backend(); }
void capture_begin(CudaState* state) { api().capture_begin(state); }
void* capture_end(CudaState* state, size_t* nodes) { return api().capture_end(state, nodes); }
void graph_launch(CudaState* state, void* graph) { api().graph_launch(state, graph); }

// Releases run from destructors and only ever receive what the plugin handed out: without a
// plugin there is nothing to release.
void free_device(int ordinal, void* ptr) {
  if (ptr && loaded().api) loaded().api->free_device(ordinal, ptr);
}
void free_pinned(void* ptr) {
  if (ptr && loaded().api) loaded().api->free_pinned(ptr);
}
void destroy_state(CudaState* state) {
  if (state && loaded().api) loaded().api->destroy_state(state);
}
void synchronize(CudaState* state) {
  if (state) api().synchronize(state);
}
void event_destroy(void* event) {
  if (event && loaded().api) loaded().api->event_destroy(event);
}
void capture_abort(CudaState* state) {
  if (state && loaded().api) loaded().api->capture_abort(state);
}
void graph_destroy(void* graph) {
  if (graph && loaded().api) loaded().api->graph_destroy(graph);
}

}  // namespace cudart

std::string cuda_backend_note() {
  if (!driver_present()) return " (no NVIDIA driver on this machine)";
  const Loaded& l = loaded();
  if (!l.api) return fmt::format(" (the CUDA backend {})", l.problem);
  return "";
}

}  // namespace replica
