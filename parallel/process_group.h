// ProcessGroup: collectives across the ranks of a DDP job, one process per device.
//   gloo  CPU tensors (and GPU tensors staged through pinned host memory, for ranks that share
//         a GPU); ring all-reduce (measured ~10x faster than Gloo's generic allreduce here).
//   nccl  one GPU per rank; collectives run on the context's stream, no host sync.
// Every collective is synchronous for the calling thread (the DDP reducer calls them from its
// communication thread) and fails with replica::Error after the group's timeout, naming the
// operation, instead of hanging.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "engine/context.h"

namespace replica {

class Store;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual std::string backend() const = 0;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // t <- sum over ranks of t (in place), bit-identical on every rank. t lives on ctx's device.
  // `persistent`: t's memory is reused in the same role every step on every rank (gradient
  // buckets), so per-buffer setup may be cached.
  virtual void allreduce_sum(DeviceContext& ctx, Tensor& t, bool persistent = false) = 0;
  // t <- root's t.
  virtual void broadcast(DeviceContext& ctx, Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // Waits until collectives enqueued on ctx's stream have finished, failing after the timeout
  // (NCCL; Gloo collectives are already complete when they return).
  virtual void synchronize(DeviceContext& ctx) {}

 protected:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank_, size_;
};

// A group of one: every collective is the identity (DDP with world size 1).
std::unique_ptr<ProcessGroup> make_single_process_group();

// Gloo over TCP, rendezvous through `store`, interface address `host` (e.g. MASTER_ADDR's
// interface or 127.0.0.1). Throws when this build lacks Gloo.
std::unique_ptr<ProcessGroup> make_gloo_group(int rank, int size, Store& store,
                                              const std::string& host,
                                              std::chrono::milliseconds timeout);

// NCCL, one GPU per rank; the unique id travels through `store`. Throws without NCCL.
std::unique_ptr<ProcessGroup> make_nccl_group(int rank, int size, Store& store,
                                              DeviceContext& ctx,
                                              std::chrono::milliseconds timeout);

bool gloo_available();
bool nccl_available();

}  // namespace replica
