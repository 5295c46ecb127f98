// LocalNccl: NCCL in single-process mode for DP on distinct GPUs — one communicator per device
// (ncclCommInitAll), collectives issued as one group call from a single thread, each device's
// part on that device's stream (so it orders after the backward that produced it, and before
// the optimizer step on device 0, without host syncs). Only for distinct GPUs: NCCL refuses
// two communicators on one GPU, so logical devices keep the copy-based reduction.
// The implementation lives in the NCCL plugin (local_nccl.cpp, libreplica_nccl.so).
#pragma once
#include <memory>
#include <vector>

#include "engine/context.h"

namespace replica {

class LocalNccl {
 public:
  virtual ~LocalNccl() = default;

  // buffers[i] on device i; device 0's buffer receives the sum of buffers[0..active).
  virtual void reduce_to_root(std::vector<Tensor>& buffers, int active) = 0;
  // buffers[i] <- buffers[0] on every device.
  virtual void broadcast_from_root(std::vector<Tensor>& buffers) = 0;

  // Two or more distinct GPUs, and an NCCL plugin that loads.
  static bool usable(const std::vector<DeviceContext*>& contexts);
  // Throws when not usable(); errors name the GPU and the NCCL call that failed.
  static std::unique_ptr<LocalNccl> create(const std::vector<DeviceContext*>& contexts);
};

}  // namespace replica
