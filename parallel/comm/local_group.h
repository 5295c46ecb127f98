// LocalGroup: DP's collectives. Its ranks are the worker threads of one process, one model
// replica per device (DDP's ranks are processes: process_group.h). A ProcessGroup is called by
// every rank with its own tensor and the ranks meet inside the call; a LocalGroup is called once
// with every rank's tensor (rank r's on device r), because DP's collectives start from one place
// (the bucket reducer's communication thread, or the engine between steps) and nothing is gained
// by making the threads meet.
//   reduce(slot, parts)   parts[0] <- the sum of parts[0..active), in a fixed order
//   broadcast(sets)       every rank's tensors <- rank 0's, after the work on device 0 so far
// Two ways to run them, chosen by make_local_group():
//   copies  CPU devices: adds on the destination's context in a fixed order (to-root or tree).
//           Logical devices of one GPU (or GPUs without NCCL): the same adds, every one on a
//           communication stream of device 0 ordered by events (no host sync; the adds overlap
//           the rest of backward).
//   nccl    distinct GPUs: NCCL's single-process communicators (ncclCommInitAll), one group
//           call from one thread, each device's part on a communication stream of that GPU,
//           ordered by events like the copies (local_nccl.cpp, in the NCCL plugin).
// Both orders are fixed, so a run reproduces; to-root and tree differ only by association.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/context.h"

namespace replica {

class WorkerPool;

enum class ReduceStrategy { ToRoot, Tree };
ReduceStrategy parse_reduce_strategy(const std::string& name);  // "root" | "tree"

class LocalGroup {
 public:
  virtual ~LocalGroup() = default;
  // A step in which ranks [0, active) take part. The others zeroed their gradients on their
  // own streams (the engine's scatter), which NCCL's reduce still reads: that is their "all
  // written" for the step.
  void begin(int active);
  // On rank r's thread, r's device current: r has enqueued the work that writes `slot` (a
  // bucket), or all of its slots. On a GPU an event records where, and reduce() waits for it.
  void slot_written(int rank, int slot);
  void all_written(int rank) { marks_[size_t(rank)].all.record(*ctx_[size_t(rank)]); }
  // parts[r] is rank r's piece of `slot`; parts[0] receives the sum over the active ranks.
  // Enqueued (GPU) or done (CPU) when it returns; slots are reduced in order.
  virtual void reduce(int slot, std::vector<Tensor>& parts) = 0;
  // Device 0's stream waits for every reduce so far (no host sync).
  virtual void reduced() = 0;
  // sets[r][k] <- sets[0][k] for every rank r > 0 (empty tensors are skipped), each rank's
  // copy ordered after the work enqueued on device 0 so far.
  virtual void broadcast(std::vector<std::vector<Tensor>>& sets) = 0;

 protected:
  LocalGroup(std::vector<DeviceContext*> contexts, int slots);
  // Where rank r's stream had written `slot` this step; for a slot it did not write this step
  // (parameters that got no gradient, an idle rank), where its whole backward had. A
  // communication stream waits on it before reading r's part (no-ops on CPU devices).
  StreamEvent& written(int rank, int slot);

  std::vector<DeviceContext*> ctx_;
  int active_;

 private:
  struct Marks {
    std::vector<StreamEvent> slot;  // sized once: StreamEvents do not move
    std::vector<char> this_step;    // whether slot[s] was recorded this step
    StreamEvent all;
  };
  std::vector<Marks> marks_;  // per rank, sized once
};

// The group for these devices (rank r on contexts[r], served by pool's worker r). `slots` and
// `largest_slot` (elements) size the GPU's per-slot events and its staging buffer.
std::unique_ptr<LocalGroup> make_local_group(std::vector<DeviceContext*> contexts,
                                             WorkerPool& pool, ReduceStrategy strategy,
                                             int slots, int64_t largest_slot);

}  // namespace replica
