#include "engine/context.h"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <tbb/global_control.h>

#include "engine/bf16_storage.h"
#include "engine/cudart.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "engine/ops.h"

namespace replica {

namespace {

// TBB lends arenas at most as many threads as a process-wide limit that defaults to the cores,
// so devices x threads beyond the cores silently got fewer threads than asked for (and TBB
// printed a warning mid-line). The limit follows the threads the live CPU contexts hold:
// oversubscription, when asked for, is real (replica-bench notes that devices then compete).
std::mutex g_thread_limit_mutex;
size_t g_threads_held = 0;
std::unique_ptr<tbb::global_control> g_thread_limit;

void hold_cpu_threads(int n) {
  std::lock_guard<std::mutex> lock(g_thread_limit_mutex);
  g_threads_held += size_t(n);
  // TBB's own default when no limit is set: the CPUs this process may run on (its affinity).
  const size_t limit =
      tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism);
  if (g_threads_held <= limit) return;
  g_thread_limit.reset();  // TBB takes the smallest of the live limits: replace, not add
  g_thread_limit = std::make_unique<tbb::global_control>(
      tbb::global_control::max_allowed_parallelism, g_threads_held);
}

void release_cpu_threads(int n) {
  std::lock_guard<std::mutex> lock(g_thread_limit_mutex);
  g_threads_held -= size_t(n);
}

// Tests lay CPU activations out NHWC (tests/test_channels_last.cpp).
bool channels_last_on_cpu() {
  return switches::kChannelsLastOnCpu.on();
}

}  // namespace

void check_cudnn_benchmark(bool benchmark, bool deterministic, const std::vector<Device>& devices) {
  if (!benchmark) return;
  REPLICA_USAGE_CHECK(!deterministic,
                      "--cudnn-benchmark times cuDNN's algorithms each run, so its pick can "
                      "change between runs: it cannot be combined with --deterministic");
  for (const Device& d : devices)
    REPLICA_USAGE_CHECK(d.is_cuda(), "{} has no cuDNN: --cudnn-benchmark needs a CUDA device",
                        d.str());
}

DeviceContext::DeviceContext(Device device, ContextOptions options)
    : device_(device), options_(options) {
  check_cudnn_benchmark(options.cudnn_benchmark, options.deterministic, {device});
  if (device.is_cpu()) {
    REPLICA_USAGE_CHECK(options.precision != Precision::Tf32,
                        "{} has no TF32: --precision tf32 needs a CUDA device", device.str());
    // Tests lay CPU activations out NHWC (REPLICA_CHANNELS_LAST_ON_CPU=1): every CPU op then
    // runs on NCHW copies, which proves the layout's plumbing through the layers bit for bit.
    REPLICA_USAGE_CHECK(!options.channels_last || channels_last_on_cpu(),
                        "{} has no cuDNN: --memory-format channels_last needs a CUDA device",
                        device.str());
    threads_ = options.threads > 0 ? options.threads : cpu_cores();
    check_cpu_threads("threads per device", threads_);
    arena_ = std::make_unique<tbb::task_arena>(threads_);
    allocator_ = std::make_unique<Allocator>(Allocator::Kind::Host, device);
    backend_ = make_bf16_storage_backend(make_cpu_backend());
    // Last, once nothing here can throw: a constructor that throws runs no destructor to give
    // the threads back (an arena is not initialised, so it spawns no threads, until first used).
    hold_cpu_threads(threads_);
  } else {
    REPLICA_USAGE_CHECK(device.index < cuda_device_count(), "GPU {} does not exist{}",
                        device.index, cuda_backend_note());
    threads_ = 1;
    if (options_.conv_api == ConvApi::Auto) options_.conv_api = conv_api_from_environment();
    cudart::set_device(device.index);
    allocator_ = std::make_unique<Allocator>(Allocator::Kind::CudaDevice, device);
    cuda_ = std::unique_ptr<CudaState, void (*)(CudaState*)>(
        cudart::create_state(device, options),
        cudart::destroy_state);
    backend_ = make_bf16_storage_backend(cudart::make_backend());
  }
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::Tf32:
      return "tf32";
    case Precision::Bf16:
      return "bf16";
    default:
      return "fp32";
  }
}

ConvApi parse_conv_api(const std::string& word) {
  if (word == "auto") return ConvApi::Auto;
  if (word == "legacy") return ConvApi::Legacy;
  REPLICA_USAGE_CHECK(word == "graph",
                      "unknown cuDNN interface '{}' in REPLICA_CUDNN_API (auto, legacy, graph)",
                      word);
  return ConvApi::Graph;
}

ConvApi conv_api_from_environment() {
  const char* word = std::getenv("REPLICA_CUDNN_API");
  return word && *word ? parse_conv_api(word) : ConvApi::Auto;  // set but empty: as unset
}

const char* conv_api_name(ConvApi api) {
  switch (api) {
    case ConvApi::Legacy:
      return "legacy";
    case ConvApi::Graph:
      return "graph";
    default:
      return "auto";
  }
}

bool devices_have_tf32(const std::vector<Device>& devices) {
  bool any = false;
  for (const Device& d : devices) {
    if (!d.is_cuda()) return false;
    if (cudart::compute_capability(d.index) < 80) return false;
    any = true;
  }
  return any;
}

Precision resolve_precision(const std::string& flag, const std::vector<Device>& devices) {
  if (flag == "fp32") return Precision::Fp32;
  if (flag == "auto") return devices_have_tf32(devices) ? Precision::Tf32 : Precision::Fp32;
  REPLICA_USAGE_CHECK(flag == "tf32" || flag == "bf16",
                      "unknown --precision '{}' (auto, fp32, tf32, bf16)", flag);
  const bool tf32 = flag == "tf32";
  for (const Device& d : devices) {
    // No device name: every DDP rank must give the same line, so the launcher prints it once.
    REPLICA_USAGE_CHECK(!tf32 || d.is_cuda(), "--precision tf32 needs CUDA devices (CPU devices "
                        "compute in fp32, or bf16 by rounding)");
    if (!d.is_cuda()) continue;
    const int cc = cudart::compute_capability(d.index);
    REPLICA_USAGE_CHECK(cc >= 80,
                        "--precision {} needs {} tensor cores (compute capability 8.0+): {} "
                        "({}) has {:.1f}", flag, tf32 ? "TF32" : "bf16", d.str(),
                        cudart::device_name(d.index), cc / 10.0);
  }
  return tf32 ? Precision::Tf32 : Precision::Bf16;
}

bool resolve_channels_last(const std::string& flag, Precision precision,
                           const std::vector<Device>& devices) {
  bool cuda = !devices.empty();
  for (const Device& d : devices) cuda &= d.is_cuda();
  if (flag == "auto") return cuda && precision == Precision::Bf16;
  if (flag == "nchw") return false;
  REPLICA_USAGE_CHECK(flag == "channels_last",
                      "unknown --memory-format '{}' (auto, nchw, channels_last)", flag);
  REPLICA_USAGE_CHECK(cuda, "--memory-format channels_last lays out cuDNN's operands: it needs "
                      "CUDA devices");
  return true;
}

DeviceContext::~DeviceContext() {
  if (cuda_) {
    try {
      cudart::synchronize(cuda_.get());
    } catch (...) {
    }
  }
  profiled_.reset();
  backend_.reset();
  if (arena_) release_cpu_threads(threads_);
}

void DeviceContext::set_op_profile(OpProfile* profile) {
  REPLICA_CHECK(!capturing_, "{}: ops cannot be timed while a step is captured", device_.str());
  profiled_ = profile ? make_profiling_backend(*backend_, *profile) : nullptr;
}

void DeviceContext::begin_capture(Backend* recorder) {
  REPLICA_CHECK(!capturing_, "{}: a step is already being captured", device_.str());
  capturing_ = true;
  recorder_ = recorder;
}

void DeviceContext::end_capture(bool captured) {
  capturing_ = false;
  recorder_ = nullptr;
  steps_captured_ += captured ? 1 : 0;
}

void DeviceContext::activate() const {
  if (device_.is_cuda()) cudart::set_device(device_.index);
}

Tensor to_host(DeviceContext& ctx, const Tensor& t) {
  Tensor h = Tensor::empty(host_allocator(), t.shape(), t.dtype());
  ctx.ops().copy(ctx, h, t);
  return h;
}

StreamEvent::~StreamEvent() { cudart::event_destroy(event_); }

void StreamEvent::record(DeviceContext& ctx) {
  if (!ctx.is_cuda()) return;
  if (!event_) event_ = cudart::event_create(ctx.cuda());
  cudart::event_record(ctx.cuda(), event_);
  recorded_ = true;
}

void StreamEvent::wait(DeviceContext& other) {
  if (!other.is_cuda() || !recorded_) return;
  cudart::stream_wait_event(other.cuda(), event_);
}

void StreamEvent::host_wait() {
  if (recorded_) cudart::event_synchronize(event_);
}

void DeviceContext::synchronize() {
  // The captured work has not run: a wait for it would read nothing, and breaks a CUDA capture.
  REPLICA_CHECK(!capturing_, "{}: a host sync inside a captured step (it must not wait for, "
                "nor read, what the step computes)", device_.str());
  if (cuda_) cudart::synchronize(cuda_.get());
}

}  // namespace replica
