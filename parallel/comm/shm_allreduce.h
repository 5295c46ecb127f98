// The all-reduce of Gloo groups whose ranks share one machine, through shared memory instead of
// TCP over loopback. Loopback moved about 1 GB/s on the 2-core development machine, and a
// ResNet-101 DDP step of two ranks took 1.4x one rank's (170 MB of gradients a step).
//
// Every rank maps every rank's segment. A sum is two rounds: each rank copies its tensor into
// its own segment; then each sums its 1/n of the elements over all segments, in rank order,
// in place in its own segment; then each copies the n sums back. Every element is summed once,
// in one order, so every rank receives the same bits. Ranks meet at counters in the segments
// (futex waits); each round's data alternates between two areas, so a rank that runs ahead
// never overwrites what a slower one is still reading. A peer that exits is noticed within a
// tenth of a second, a stopped one after the group's timeout.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace replica {

class Store;

class ShmAllreduce {
 public:
  // Every rank of the group calls this once, at the same point. It returns a ready object on
  // every rank, or null on every rank when shared memory is not to be used: ranks on other
  // machines or network namespaces (their addresses differ), REPLICA_SHM_ALLREDUCE=0, or a rank
  // that cannot make its segment (no /dev/shm, too little room in it).
  static std::unique_ptr<ShmAllreduce> connect(Store& store, int rank, int size,
                                               const std::string& address,
                                               std::chrono::milliseconds timeout);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // p[0, n) <- the sum over ranks of p. Throws replica::Error naming the rank waited for when
  // it exited or the timeout passed, or one whose call has another length.
  void sum(float* p, int64_t n);

  // Floats a round carries (larger tensors go in rounds): each rank's segment holds two areas
  // of this many, 8 MB.
  static constexpr int64_t kAreaFloats = int64_t(1) << 20;

 private:
  struct Segment;
  ShmAllreduce(int rank, int size, std::chrono::milliseconds timeout);
  void round(float* p, int64_t n, int64_t call_n);  // n <= kAreaFloats of a call of call_n
  // Waits until rank `peer`'s counter `which` (0 arrived, 1 summed) reaches `target`.
  void wait_for(int peer, int which, uint32_t target) const;

  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::vector<Segment*> segments_;  // every rank's, mapped here; segments_[rank_] is ours
  std::vector<int> pids_;
  std::vector<int> pidfds_;  // each peer's process (pidfd_open), -1 for this rank
  uint32_t rounds_ = 0;
  bool failed_ = false;
};

}  // namespace replica
