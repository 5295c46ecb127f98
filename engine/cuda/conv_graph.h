// One direction of one convolution through cuDNN's graph (backend) API: the operation graph is
// described once, an engine chosen for it once, and the finalized execution plan kept; each call
// then only binds its buffers (a variant pack) and executes the plan.
//
// Why beside the legacy entry points (conv.cu): cuDNN 9 implements cudnnConvolutionForward and
// the backward calls on top of this API, and for bf16 NCHW backward it chooses and builds an
// engine again at every call: on an H100, 10.7 ms per backward call of ResNet-50 and 27
// "not supported" engine attempts logged per call (bench/results/2026-11-25-h100-second-run.md).
// A plan built once costs nothing per call. Private to engine/cuda.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/cuda/cuda_check.h"

namespace replica {

enum class ConvDirection { Forward, BackwardData, BackwardFilter };
const char* conv_direction_name(ConvDirection d);  // "forward", "backward data", ...

// What one plan computes. Dimensions are logical NCHW (filters KCRS) in every layout; `nhwc`
// says the memory is NHWC (filters KRSC), as conv.cu stages it for channels_last.
struct ConvGraphSpec {
  ConvDirection direction = ConvDirection::Forward;
  int64_t N = 0, C = 0, H = 0, W = 0, K = 0, R = 0, P = 0, Q = 0;
  int stride = 1, padding = 0;
  bool bf16 = false;  // bf16 data with fp32 accumulation (else fp32 data)
  bool nhwc = false;
  float beta = 0.f;   // 0: the result overwrites its buffer; 1: it is added to it
};

// Which engines may run it, as the legacy path's algorithm choice allows (conv.cu).
struct ConvEngineRules {
  bool tensor_ops = false;     // fp32 data may be rounded to TF32 on tensor cores (else never)
  bool deterministic = false;  // engines cuDNN marks non-deterministic are refused
  size_t max_workspace = 0;    // bytes
};

// The three buffers of a call, named by their shapes whatever the direction reads or writes:
// forward reads x and w and writes y; backward data reads w and y (dy), writes x (dx); backward
// filter reads x and y (dy), writes w (dw).
struct ConvBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* y = nullptr;
};

// --cudnn-benchmark: candidate plans are timed on these buffers (the written one a scratch copy
// the caller provides, so an accumulating result is not disturbed) on `stream`, with workspace
// from `workspace(bytes)`.
struct ConvPlanTiming {
  cudaStream_t stream = nullptr;
  ConvBuffers buffers;
  std::function<void*(size_t)> workspace;
};

class ConvGraph {
 public:
  // The plan of the first acceptable engine in the heuristics' order (cuDNN's mode A, then its
  // fallback list; in each, precompiled engines before those compiled at run time), or with
  // `timing` the fastest of the first few acceptable ones. Null, with `why` set, when cuDNN
  // offers no acceptable engine; throws replica::Error when cuDNN rejects the graph itself.
  static std::unique_ptr<ConvGraph> build(cudnnHandle_t handle, const ConvGraphSpec& spec,
                                          const ConvEngineRules& rules,
                                          const ConvPlanTiming* timing, std::string* why);
  // cuDNN's own checks of the graph `spec` describes (shapes, strides, types, the operation),
  // which need no GPU; throws replica::Error naming what cuDNN rejected.
  static void check(const ConvGraphSpec& spec);
  ~ConvGraph();
  ConvGraph(const ConvGraph&) = delete;
  ConvGraph& operator=(const ConvGraph&) = delete;

  size_t workspace_bytes() const { return workspace_; }
  // Whether the plan may run on these buffers: it was built for 16-byte aligned ones.
  static bool aligned(const ConvBuffers& b);
  // Enqueues the plan on the handle's stream; throws replica::Error on failure.
  void run(cudnnHandle_t handle, const ConvBuffers& b, void* workspace) const;

 private:
  ConvGraph(cudnnBackendDescriptor_t plan, size_t workspace) : plan_(plan), workspace_(workspace) {}
  cudnnBackendDescriptor_t plan_;
  size_t workspace_;
};

}  // namespace replica
