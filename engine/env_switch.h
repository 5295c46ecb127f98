// On/off switches in the environment (REPLICA_CUDA_SLICED_SUMS, REPLICA_PAD_CHANNELS, ...): the
// knobs that turn one change off to time it against the old way in one run, and the debug
// checks. They are read by one rule, so that each does not speak its own dialect: unset or
// empty is the switch's default, "1" turns it on, "0" off, and any other word is a usage error
// that names the variable. A typo (REPLICA_PAD_CHANNELS=false, =off) then stops the run with one
// line instead of quietly timing the default. Callers read a switch where they use it, not once
// at start-up, where a test turns it for one case.
//
// Every switch is declared once below, with its default, so a program can check them all when it
// starts (cli/program.h): a GPU-only switch set wrongly on a CPU run, or a misspelled name
// (REPLICA_PAD_CHANNEL=0), is refused before anything runs.
#pragma once
#include <cstdlib>
#include <cstring>

#include "engine/error.h"

namespace replica {

class EnvSwitch {
 public:
  constexpr EnvSwitch(const char* name, bool unset) : name_(name), unset_(unset) {}
  const char* name() const { return name_; }

  // Reads the variable now: its default when unset or empty.
  bool on() const {
    const char* v = std::getenv(name_);
    if (v == nullptr || *v == '\0') return unset_;
    if (std::strcmp(v, "1") == 0) return true;
    if (std::strcmp(v, "0") == 0) return false;
    throw UsageError(fmt::format("{}='{}': expected 1 (on) or 0 (off)", name_, v));
  }

 private:
  const char* name_;
  bool unset_;
};

namespace switches {
// cuDNN: rank the graph API's engines by cuDNN's heuristics (as PyTorch), not measured order.
inline constexpr EnvSwitch kCudnnHeuristicOrder{"REPLICA_CUDNN_HEURISTIC_ORDER", false};
inline constexpr EnvSwitch kCudnnLog{"REPLICA_CUDNN_LOG", false};  // a line per cuDNN plan
// CUDA: per-channel sums in slices (the one-block passes off), and 64-bit indexing forced.
inline constexpr EnvSwitch kCudaSlicedSums{"REPLICA_CUDA_SLICED_SUMS", false};
inline constexpr EnvSwitch kCudaWideIndex{"REPLICA_CUDA_WIDE_INDEX", false};
// cuDNN NHWC convolutions of fewer than 8 channels (the stem's 3) run on operands padded to 8.
// Off by default until the checks built for it pass on a GPU (engine/cuda/conv_padded.cu says
// why).
inline constexpr EnvSwitch kPadChannels{"REPLICA_PAD_CHANNELS", false};
// What only GPUs do, forced on CPU devices to test it there: NHWC operands, staged batches.
inline constexpr EnvSwitch kChannelsLastOnCpu{"REPLICA_CHANNELS_LAST_ON_CPU", false};
inline constexpr EnvSwitch kPrefetchOnCpu{"REPLICA_PREFETCH_ON_CPU", false};
// DDP: every rank checks its parameters are bit-identical to rank 0's after each step.
inline constexpr EnvSwitch kDdpCheckSync{"REPLICA_DDP_CHECK_SYNC", false};
// Gloo groups whose ranks share a machine all-reduce through shared memory (0: Gloo's TCP).
inline constexpr EnvSwitch kShmAllreduce{"REPLICA_SHM_ALLREDUCE", true};
// Convolutions on planes smaller than their kernel multiply the plane matrix
// (engine/conv_geometry.h) instead of im2col's columns (CPU) or cuDNN's kernels (CUDA: the
// seed recipe's fp32 step 1.53x on an H200, 2026-11-29).
inline constexpr EnvSwitch kPlaneMatrix{"REPLICA_PLANE_MATRIX", true};
inline constexpr EnvSwitch kCudaPlaneMatrix{"REPLICA_CUDA_PLANE_MATRIX", true};
// CPU: stride-1 convolutions with few output channels run the direct convolution
// (engine/cpu/direct_conv.h) instead of im2col + GEMM.
inline constexpr EnvSwitch kDirectConv{"REPLICA_DIRECT_CONV", true};
// CPU: max pooling over 2x2 tiles and over 3x3 windows at stride 2 in vectors
// (engine/cpu/max_pool_rows.h), not element-wise.
inline constexpr EnvSwitch kMaxPool2x2{"REPLICA_MAX_POOL_2X2", true};
inline constexpr EnvSwitch kMaxPool3x3{"REPLICA_MAX_POOL_3X3", true};
// CPU: batch norm on planes of up to 4 positions 8 channels to a vector (engine/cpu/norm_lanes.h).
inline constexpr EnvSwitch kNormLanes{"REPLICA_NORM_LANES", true};

inline constexpr const EnvSwitch* kAll[] = {
    &kCudnnHeuristicOrder, &kCudnnLog,          &kCudaSlicedSums, &kCudaWideIndex,
    &kPadChannels,         &kChannelsLastOnCpu, &kPrefetchOnCpu,  &kDdpCheckSync,
    &kShmAllreduce,        &kPlaneMatrix,       &kCudaPlaneMatrix, &kDirectConv,
    &kMaxPool2x2,          &kMaxPool3x3,        &kNormLanes};
// The variables a run reads that take a word rather than 1 or 0: a name one letter from these
// is a typo too.
inline constexpr const char* kChoices[] = {"REPLICA_CUDNN_API", "REPLICA_RESIDUAL_SUM"};

// REPLICA_RESIDUAL_SUM: "conv" (or unset, or empty) adds a residual block's input gradient in
// its body's first convolution, "add" in an add of its own (layers/resnet.h). Read by ResNets
// only, so checked too when a program starts: a CNN's run would never see its typo.
inline bool residual_sum_in_conv() {
  const char* v = std::getenv("REPLICA_RESIDUAL_SUM");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "conv") == 0) return true;
  if (std::strcmp(v, "add") == 0) return false;
  throw UsageError(fmt::format("REPLICA_RESIDUAL_SUM='{}': expected conv or add", v));
}
}  // namespace switches

}  // namespace replica
