// The DDP engine: this process's share of a distributed job (one device per process).
#pragma once
#include <memory>

#include "parallel/comm/process_group.h"
#include "parallel/engines/train_engine.h"

namespace replica {

struct DdpOptions {
  size_t first_bucket_bytes = size_t(1) << 20;
  size_t bucket_bytes = size_t(25) << 20;
  // Gradient accumulation: each local batch runs as K micro-batches; the first K-1 backward
  // passes run under no_sync (nothing communicated), the last all-reduces the accumulated sum.
  int accumulate = 1;
};

// The engine of one rank: a context for `device` made as `options` say (threads, precision,
// ...), the process group `group` describes on it (make_process_group; a group of one is a job
// of one), and the engine over both. Parameters and buffers are broadcast from rank 0 when the
// engine is built; every train_step takes this rank's LOCAL batch; gradients are averaged over
// the group's ranks in buckets during backward.
std::unique_ptr<TrainEngine> make_ddp_engine(const Device& device, const GroupOptions& group,
                                             const EngineOptions& options, const DdpOptions& ddp);

}  // namespace replica
