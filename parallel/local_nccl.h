// LocalNccl: NCCL in single-process mode for DP on distinct GPUs — one communicator per device
// (ncclCommInitAll), collectives issued as one group call from a single thread, each device's
// part on that device's stream (so it orders after the backward that produced it, and before
// the optimizer step on device 0, without host syncs). Only for distinct GPUs: NCCL refuses
// two communicators on one GPU, so logical devices keep the copy-based reduction.
#pragma once
#include <memory>
#include <vector>

#include "engine/context.h"

namespace replica {

class LocalNccl {
 public:
  // Throws when this build has no NCCL or the devices are not distinct GPUs.
  explicit LocalNccl(const std::vector<DeviceContext*>& contexts);
  ~LocalNccl();
  LocalNccl(const LocalNccl&) = delete;
  LocalNccl& operator=(const LocalNccl&) = delete;

  // buffers[i] on device i; device 0's buffer receives the sum of buffers[0..active).
  void reduce_to_root(std::vector<Tensor>& buffers, int active);
  // buffers[i] <- buffers[0] on every device.
  void broadcast_from_root(std::vector<Tensor>& buffers);

  static bool usable(const std::vector<DeviceContext*>& contexts);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace replica
