// DeviceContext: everything one device needs to run work — its allocator, its kernels (Backend),
// on CPU a TBB arena with its share of the cores, on CUDA a stream and cuBLAS/cuDNN handles (the
// backend's scratch and cuDNN's workspace come from the allocator). One context per device (per
// logical/virtual device); used by one thread at a time.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <tbb/task_arena.h>

#include "engine/allocator.h"
#include "engine/device.h"
#include "engine/env_switch.h"
#include "engine/tensor.h"

namespace replica {

class Backend;
class OpProfile;
struct CudaState;  // stream, handles, math settings (engine/cuda/cuda_runtime.cu)

// How a device may round the inputs of matrix products and convolutions.
//   Fp32  strict IEEE fp32 with fp32 accumulation: what the CPU kernels do, what CPU-vs-CUDA
//         parity and the DP/DDP equivalence tests compare.
//   Tf32  GPU tensor cores (compute capability 8.0 and later): inputs rounded to TF32's 10-bit
//         mantissa, products accumulated in fp32; cuBLAS GEMMs and cuDNN convolutions only.
//         PyTorch's default for convolutions.
//   Bf16  mixed precision as PyTorch's autocast computes it: convolutions and linear layers take
//         their inputs, weights and incoming gradients rounded to bf16 (bf16_round, ops.h),
//         accumulate the products in fp32 and round their results (outputs, input gradients,
//         each step's weight gradient) to bf16; biases are added, and their gradients summed,
//         in fp32. GPUs: bf16 tensor cores (compute capability 8.0+); CPUs: the same rounding
//         around the fp32 kernels, for the numbers (it is not faster there).
// Bf16 also stores activations and their gradients in BF16 tensors, as autocast does (half the
// bytes to write, keep for backward and read again; engine/bf16_storage.h): every op computes
// in fp32 and rounds what it stores. In every mode the master weights, their gradients, the
// optimizer state, BatchNorm's statistics and the loss stay fp32 (bf16 needs no loss scaling:
// fp32's exponent range).
enum class Precision { Fp32, Tf32, Bf16 };
const char* precision_name(Precision p);  // "fp32", "tf32", "bf16"
// Whether every CUDA device in `devices` has TF32 tensor cores (false when there is none).
bool devices_have_tf32(const std::vector<Device>& devices);
// A --precision flag for these devices: "fp32"; "tf32" (CUDA devices with TF32 only); "bf16"
// (CUDA devices of compute capability 8.0+, and CPU devices); "auto" = tf32 where every device
// has it (PyTorch's default for convolutions), else fp32. UsageError for anything else.
Precision resolve_precision(const std::string& flag, const std::vector<Device>& devices);

// How a GPU's convolutions lay out their operands (--memory-format, PyTorch's words):
//   nchw           cuDNN reads and writes the engine's NCHW tensors where they are;
//   channels_last  operands are copied into NHWC (weights KRSC), in the pass that rounds them
//                  for bf16, and results transposed back: cuDNN's tensor-core kernels are
//                  written for NHWC (on an H100, ResNet-50's bf16 NCHW convolutions took 4.4x
//                  TF32's time, algorithms timed).
// Only convolutions whose channel counts are multiples of 8 (the shapes those kernels take),
// and a first layer's 1-7 input channels padded to 8 (engine/cuda/conv_padded.cu); everything
// else stays NCHW. "auto": channels_last in bf16 on CUDA devices, else nchw.
// UsageError for another word, or channels_last on CPU devices (they have no cuDNN).
bool resolve_channels_last(const std::string& flag, Precision precision,
                           const std::vector<Device>& devices);
// The resolved layout as the flag names it, for rows, metrics and ranks' command lines.
inline const char* memory_format_name(bool channels_last) {
  return channels_last ? "channels_last" : "nchw";
}

// --cudnn-benchmark with the devices and --deterministic it is given with: every device must be
// a GPU (CPUs have no cuDNN), and timing algorithms each run cannot be deterministic. Checked by
// each DeviceContext, and by a run's flags before any device is made (--print-config).
void check_cudnn_benchmark(bool benchmark, bool deterministic, const std::vector<Device>& devices);

// Which cuDNN interface runs a GPU's convolutions (engine/cuda/conv.cu and conv_graph.h):
//   Legacy  cudnnConvolutionForward and the backward calls, algorithms from cuDNN's *_v7
//           heuristics or, with cudnn_benchmark, its Find;
//   Graph   cuDNN's graph API: each direction of each convolution shape built once into an
//           execution plan and kept; an error where cuDNN offers no engine for one;
//   Auto    Graph, with Legacy for a convolution the graph API has no engine for. For bf16
//           data cuDNN 9's legacy calls choose and build an engine again at every backward call
//           (10.7 ms a call for ResNet-50 on an H100); in fp32 their *_v7 heuristics picked
//           engines that ran the seed recipe's ResNet-101 convolutions in 79 ms a step against
//           the graph API's 40 (H200, 2026-11-27), and ResNet-50's at the same speed.
// REPLICA_CUDNN_API=auto|graph|legacy in the environment sets it for CUDA contexts left at Auto
// (ranks inherit it from the launcher), so one build can measure both interfaces.
enum class ConvApi { Auto, Legacy, Graph };
ConvApi parse_conv_api(const std::string& word);  // "auto" | "legacy" | "graph", else UsageError
const char* conv_api_name(ConvApi api);
ConvApi conv_api_from_environment();  // REPLICA_CUDNN_API's word; Auto when unset or empty

struct ContextOptions {
  int threads = 0;             // CPU: threads in this device's arena (0 = all cores)
  bool deterministic = false;  // CUDA: deterministic algorithms only (CPU always is)
  Precision precision = Precision::Fp32;
  // CUDA: pick each convolution's algorithms by timing them (cuDNN's Find, as PyTorch's
  // torch.backends.cudnn.benchmark), once per shape, instead of cuDNN's heuristics. The pick
  // can change from run to run, so not with `deterministic`; CUDA devices only.
  bool cudnn_benchmark = false;
  // CUDA: convolutions on NHWC copies of their operands (resolve_channels_last).
  bool channels_last = false;
  ConvApi conv_api = ConvApi::Auto;  // CUDA: the cuDNN interface of convolutions
};

class DeviceContext {
 public:
  DeviceContext(Device device, ContextOptions options = {});
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  const Device& device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  Allocator& allocator() { return *allocator_; }
  Backend& ops() { return recorder_ ? *recorder_ : profiled_ ? *profiled_ : *backend_; }
  // Times every op alone into `profile` from now on (engine/op_profile.h); nullptr stops it.
  // Not while another thread runs ops on this context.
  void set_op_profile(OpProfile* profile);
  bool profiling() const { return profiled_ != nullptr; }
  // Whether a StepGraph (engine/step_graph.h) is being captured here: ops are recorded, not
  // run, and synchronize() throws. begin_capture/end_capture are the StepGraph's: `recorder`
  // takes the ops on CPU devices (null on CUDA ones, whose stream records them).
  bool capturing() const { return capturing_; }
  void begin_capture(Backend* recorder);
  void end_capture(bool captured);
  // Steps captured here so far (a capture abandoned on an error does not count). Memory a
  // graph replays into stays its own: the allocator's private pool (engine/allocator.h).
  int steps_captured() const { return steps_captured_; }
  int threads() const { return threads_; }
  bool deterministic() const { return options_.deterministic; }
  Precision precision() const { return options_.precision; }
  bool cudnn_benchmark() const { return options_.cudnn_benchmark; }
  bool channels_last() const { return options_.channels_last; }
  // Whether a convolution of C input and K output channels runs NHWC here, and so writes a
  // channels_last output (engine/tensor.h): with channels_last, where both are multiples of 8,
  // the shapes cuDNN's tensor-core kernels take, or where a first layer's 1-7 channels are
  // padded to 8 for them (engine/cuda/conv_padded.cu). A ResNet's stem then hands its output on
  // NHWC: its BatchNorm and max-pool read it there, and neither pass has a transpose.
  // The padding is off by default (conv_padded.cu says why): REPLICA_PAD_CHANNELS=1 in the
  // environment turns it on; without it those few channels stay unpadded and the layer NCHW.
  bool nhwc_convolution(int64_t C, int64_t K) const {
    return options_.channels_last && K % 8 == 0 && (C % 8 == 0 || (C < 8 && pads_channels()));
  }
  static bool pads_channels() { return switches::kPadChannels.on(); }
  ConvApi conv_api() const { return options_.conv_api; }
  CudaState* cuda() const { return cuda_.get(); }

  Tensor alloc(const Shape& shape, DType dtype = DType::F32, bool channels_last = false) {
    return Tensor::empty(*allocator_, shape, dtype, channels_last);
  }
  // A tensor of `like`'s shape, dtype and layout (an op's output, a gradient).
  Tensor alloc_as(const Tensor& like) {
    return Tensor::empty(*allocator_, like.shape(), like.dtype(), like.channels_last());
  }
  // Makes this device current for the calling thread (cudaSetDevice); a no-op on CPU.
  void activate() const;
  // Runs f inside this device's TBB arena on CPU, so parallel kernels use only its cores.
  template <class F>
  void run(F&& f) {
    activate();
#ifdef REPLICA_SERIAL_KERNELS
    f();
#else
    if (arena_) arena_->execute(std::forward<F>(f));
    else f();
#endif
  }
  tbb::task_arena* arena() { return arena_.get(); }
  // Waits for all work enqueued on this device (a host sync: never inside an iteration).
  void synchronize();

 private:
  Device device_;
  ContextOptions options_;
  int threads_ = 1;
  std::unique_ptr<Allocator> allocator_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> profiled_;  // backend_ timed op by op (set_op_profile)
  Backend* recorder_ = nullptr;        // CPU: records ops while a StepGraph is captured
  bool capturing_ = false;
  int steps_captured_ = 0;
  std::unique_ptr<tbb::task_arena> arena_;
  std::unique_ptr<CudaState, void (*)(CudaState*)> cuda_{nullptr, nullptr};
};

// A host tensor of t's shape and dtype (NCHW order), t's values copied into it on ctx's stream:
// enqueued, so read it after ctx.synchronize().
Tensor to_host(DeviceContext& ctx, const Tensor& t);

// An ordering point on a device's stream: work enqueued on another context after wait() runs
// after everything enqueued on the recording context before record(). CPU work is synchronous,
// so on CPU both are no-ops.
class StreamEvent {
 public:
  StreamEvent() = default;
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  void record(DeviceContext& ctx);
  void wait(DeviceContext& other);
  // The host blocks until the recorded work has run (a host sync: never in the iteration).
  void host_wait();

 private:
  void* event_ = nullptr;
  bool recorded_ = false;
};

}  // namespace replica
