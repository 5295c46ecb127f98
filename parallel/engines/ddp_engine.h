// The DDP engine: this process's share of a distributed job (one device per process).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "parallel/comm/process_group.h"
#include "parallel/engines/train_engine.h"

namespace replica {

class Store;

struct DdpOptions {
  int rank = 0, world_size = 1;
  std::shared_ptr<Store> store;  // null when world_size == 1
  CommBackend backend = CommBackend::Gloo;
  std::string host = "127.0.0.1";  // interface Gloo binds to
  size_t first_bucket_bytes = size_t(1) << 20;
  size_t bucket_bytes = size_t(25) << 20;
  std::chrono::milliseconds timeout{300000};
  // Gradient accumulation: each local batch runs as K micro-batches; the first K-1 backward
  // passes run under no_sync (nothing communicated), the last all-reduces the accumulated sum.
  int accumulate = 1;
};

// Parameters and buffers are broadcast from rank 0 when the engine is built; every train_step
// takes this rank's LOCAL batch; gradients are averaged over ranks in buckets during backward.
std::unique_ptr<TrainEngine> make_ddp_engine(const Device& device, const EngineOptions& options,
                                             const DdpOptions& ddp);

}  // namespace replica
