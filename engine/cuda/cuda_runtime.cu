// The CUDA runtime behind engine/cudart.h: device discovery, raw allocations, and the
// per-context state (non-blocking stream, cuBLAS and cuDNN handles bound to it).
// Runtime API only: the driver API (libcuda) is never linked. The plugin's entry point, at the
// end, hands these functions to engine/cudart.cpp.
#include <fmt/format.h>

#include <library_types.h>

#include "engine/cuda/cuda_backend.h"
#include "engine/cudart.h"
#include "engine/plugin_abi.h"

namespace replica {

namespace cuda_detail {

const char* cublas_status_string(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

void throw_cuda(const char* call, int code, const char* what, const char* file, int line) {
  throw Error(fmt::format("{} failed: {} (code {}) ({}:{})", call, what ? what : "?", code, file,
                          line));
}

}  // namespace cuda_detail

namespace {

// Makes `ordinal` current for the scope and restores the previous device afterwards, so helper
// calls (allocation from a releasing thread, say) never change the caller's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != ordinal) REPLICA_CUDA_CHECK(cudaSetDevice(ordinal));
    else previous_ = -1;  // nothing to restore
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

int query_device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. 35 (insufficient driver) or 100 (no device): zero GPUs
    return 0;
  }
  return n < 0 ? 0 : n;
}

}  // namespace

CudaState& cuda_state(const DeviceContext& ctx) {
  CudaState* s = ctx.cuda();
  REPLICA_CHECK(s != nullptr, "CUDA backend called with a context for {}, which has no CUDA state",
                ctx.device().str());
  return *s;
}

std::mutex& device_free_mutex() {
  static std::mutex m;
  return m;
}

// Named apart from cudart:: (the forwarders in libreplica_engine.so): a call inside the plugin
// must never bind to the forwarder of the same name.
namespace cuda {

int device_count() {
  static const int count = query_device_count();  // thread-safe, asked once per process
  return count;
}

std::string device_name(int ordinal) {
  cudaDeviceProp prop{};
  REPLICA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  return std::string(prop.name);
}

size_t device_total_memory(int ordinal) {
  cudaDeviceProp prop{};
  REPLICA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  return prop.totalGlobalMem;
}

int compute_capability(int ordinal) {
  int major = 0, minor = 0;
  REPLICA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
  REPLICA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  return major * 10 + minor;
}

std::string versions() {
  int runtime = 0, driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) (void)cudaGetLastError();
  if (cudaDriverGetVersion(&driver) != cudaSuccess) (void)cudaGetLastError();
  int bmaj = 0, bmin = 0, bpatch = 0;
  cublasGetProperty(MAJOR_VERSION, &bmaj);
  cublasGetProperty(MINOR_VERSION, &bmin);
  cublasGetProperty(PATCH_LEVEL, &bpatch);
  size_t dnn = cudnnGetVersion();  // major*10000 + minor*100 + patch since cuDNN 9
  auto cuda_ver = [](int v) {
    return v == 0 ? std::string("none") : fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
  };
  return fmt::format("CUDA runtime {}, driver {}, cuBLAS {}.{}.{}, cuDNN {}.{}.{}",
                     cuda_ver(runtime), cuda_ver(driver), bmaj, bmin, bpatch, dnn / 10000,
                     (dnn % 10000) / 100, dnn % 100);
}

void set_device(int ordinal) { REPLICA_CUDA_CHECK(cudaSetDevice(ordinal)); }

void* malloc_device(int ordinal, size_t bytes) {
  DeviceGuard guard(ordinal);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
    throw Error(fmt::format(
        "out of GPU memory on cuda:{}: cudaMalloc of {:.1f} MiB failed ({}); {:.1f} MiB free of "
        "{:.1f} MiB ({}:{})",
        ordinal, bytes / 1048576.0, cudaGetErrorString(err), free_b / 1048576.0,
        total_b / 1048576.0, __FILE__, __LINE__));
  }
  return p;
}

// Frees never throw: they run from destructors (allocator caches at exit), where an error (the
// runtime already unloading, say) can only be ignored.
void free_device(int ordinal, void* ptr) {
  if (!ptr) return;
  try {
    DeviceGuard guard(ordinal);
    std::lock_guard<std::mutex> lock(device_free_mutex());
    if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
  } catch (...) {
  }
}

void* malloc_pinned(size_t bytes) {
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(fmt::format("cudaHostAlloc of {:.1f} MiB pinned host memory failed: {} ({}:{})",
                            bytes / 1048576.0, cudaGetErrorString(err), __FILE__, __LINE__));
  }
  return p;
}

void free_pinned(void* ptr) {
  if (ptr && cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
}

namespace {
void release_state(CudaState* s) {
  if (!s) return;
  if (cudaSetDevice(s->ordinal) != cudaSuccess) (void)cudaGetLastError();
  if (s->stream && cudaStreamSynchronize(s->stream) != cudaSuccess) (void)cudaGetLastError();
  if (s->cudnn) cudnnDestroy(s->cudnn);
  if (s->cublas) cublasDestroy(s->cublas);
  if (s->stream && cudaStreamDestroy(s->stream) != cudaSuccess) (void)cudaGetLastError();
  delete s;
}
}  // namespace

CudaState* create_state(const Device& device, const ContextOptions& options) {
  REPLICA_CHECK(device.is_cuda(), "create_state: {} is not a CUDA device", device.str());
  const bool tf32 = options.precision == Precision::Tf32;
  auto* s = new CudaState();
  s->ordinal = device.index;
  s->deterministic = options.deterministic;
  s->tf32 = tf32;
  s->benchmark = options.cudnn_benchmark;
  try {
    REPLICA_CUDA_CHECK(cudaSetDevice(device.index));
    REPLICA_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    REPLICA_CUBLAS_CHECK(cublasCreate(&s->cublas));
    REPLICA_CUBLAS_CHECK(cublasSetStream(s->cublas, s->stream));
    // fp32: no tensor-op math, so GEMMs match the CPU (PyTorch: matmul.allow_tf32 = False).
    // tf32: cublasSgemm may round its inputs to TF32 (PyTorch: matmul.allow_tf32 = True).
    // Either way a bf16 GEMM sums in fp32 to the end: without the flag cuBLAS may add split-K
    // partial sums in bf16, which the CPU's bf16 (fp32 sums, one rounding) does not.
    const int math = (tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH) |
                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    REPLICA_CUBLAS_CHECK(cublasSetMathMode(s->cublas, static_cast<cublasMath_t>(math)));
    REPLICA_CUDNN_CHECK(cudnnCreate(&s->cudnn));
    REPLICA_CUDNN_CHECK(cudnnSetStream(s->cudnn, s->stream));
  } catch (...) {
    release_state(s);
    throw;
  }
  return s;
}

void destroy_state(CudaState* state) { release_state(state); }

void synchronize(CudaState* state) {
  if (!state) return;
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(state->stream));
}

// An event belongs to the device current when it is made, and can only be recorded on that
// device's streams: made under the state's device, whichever thread asks.
void* event_create(CudaState* state) {
  DeviceGuard guard(state->ordinal);
  cudaEvent_t e = nullptr;
  REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void event_destroy(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(CudaState* state, void* event) {
  REPLICA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), state->stream));
}

void stream_wait_event(CudaState* state, void* event) {
  REPLICA_CUDA_CHECK(cudaStreamWaitEvent(state->stream, static_cast<cudaEvent_t>(event), 0));
}

void event_synchronize(void* event) {
  REPLICA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

}  // namespace cuda
}  // namespace replica

extern "C" const void* replica_cuda_plugin(int abi) {
  using namespace replica;
  static const CudaPluginApi api = {
      cuda::device_count,  cuda::device_name,    cuda::device_total_memory,
      cuda::compute_capability,
      cuda::versions,      cuda::set_device,     cuda::malloc_device,
      cuda::free_device,   cuda::malloc_pinned,  cuda::free_pinned,
      cuda::create_state,  cuda::destroy_state,  cuda::synchronize,
      cuda::event_create,  cuda::event_destroy,  cuda::event_record,
      cuda::stream_wait_event, cuda::event_synchronize, cuda::make_backend,
      cuda::capture_begin, cuda::capture_end, cuda::capture_abort, cuda::graph_launch,
      cuda::graph_destroy};
  return abi == REPLICA_PLUGIN_ABI ? &api : nullptr;
}
