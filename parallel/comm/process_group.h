// ProcessGroup: collectives across the ranks of a DDP job, one process per device.
//   gloo  CPU tensors (and GPU tensors staged through pinned host memory, for ranks that share
//         a GPU); ring all-reduce (measured ~10x faster than Gloo's generic allreduce here).
//   nccl  GPU tensors, on a communication stream of the group's own, ordered after the work
//         already on the caller's stream by an event. Ranks that share one GPU are each shown to
//         NCCL as a host of their own, over sockets: a correctness and teaching mode that runs
//         NCCL's real set-up, collectives and failures on a one-GPU machine, not a speed one.
// Every failure is a replica::Error naming the operation; after the group's timeout a stalled
// collective fails (never hangs), and when a PeerMonitor is attached the message names the rank
// that stopped answering (parallel/comm/peer_monitor.h).
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/context.h"
#include "parallel/rendezvous/rendezvous.h"

namespace replica {

class PeerMonitor;

enum class CommBackend { Gloo, Nccl };
CommBackend parse_comm_backend(const std::string& name);  // "gloo" | "nccl" (UsageError else)

struct GroupOptions {
  CommBackend backend = CommBackend::Gloo;
  int rank = 0, size = 1;
  std::shared_ptr<Store> store;  // the rendezvous store (null for a group of one)
  // Gloo: where the peers reach this rank (Rendezvous::address); GLOO_SOCKET_IFNAME, as in
  // PyTorch, names an interface instead.
  std::string address = "127.0.0.1";
  std::chrono::milliseconds timeout{300000};
  // Gloo: tensors longer than this go through in pieces (its algorithms count in an int and
  // hold scratch as large as their buffer). 2^28 floats, 1 GiB; tests set it small.
  int64_t max_piece_floats = int64_t(1) << 28;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup();
  // The backend and how it runs, for output and reports: "nccl", "gloo", "none" (one rank),
  // "nccl over sockets, 2 ranks share one GPU (correctness mode, not a speed measurement)".
  virtual std::string describe() const = 0;
  // True when ranks share a GPU: then the group's timings measure no real interconnect.
  virtual bool shared_gpu() const { return false; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // t <- sum over ranks of t (in place), bit-identical on every rank. t lives on ctx's device.
  // `slot` >= 0: t is persistent buffer number `slot` (gradient bucket `slot`), its memory
  // reused in the same role every step on every rank, so per-buffer setup may be cached; on a
  // GPU the all-reduce waits for the point slot_written(ctx, slot) marked this step, if it did,
  // else for all the work on ctx's stream when it is called.
  virtual void allreduce_sum(DeviceContext& ctx, Tensor& t, int slot = -1) = 0;
  // Backward has written bucket `slot` (from the grad hook, on ctx's thread). A GPU group keeps
  // that point of ctx's stream: the bucket's all-reduce, launched from the communication thread
  // a little later, then waits for no backward kernel queued since. No-op on Gloo, whose
  // collectives run on the host once backward has handed the bucket over.
  virtual void slot_written(DeviceContext& ctx, int slot) {}
  // t <- root's t.
  virtual void broadcast(DeviceContext& ctx, Tensor& t, int root) = 0;
  // Returns when every rank has arrived (host-blocking, with the timeout).
  virtual void barrier() = 0;
  // Every rank's `mine` (the same length on every rank), rank 0's first: small per-rank figures
  // (peak memory, device numbers), exact. Host-blocking; ctx is the rank's device.
  virtual std::vector<int64_t> all_gather(DeviceContext& ctx, const std::vector<int64_t>& mine) = 0;

  // Collectives on a GPU are enqueued, not finished, when they return, and they do not hold up
  // ctx's stream. Before work on ctx's stream reads their results:
  //   stream_wait(ctx)   ctx's stream waits for every collective enqueued so far (no host sync);
  //   synchronize(ctx)   the host waits until they have finished, failing after the timeout.
  // Gloo's collectives are complete when they return: both are no-ops there.
  virtual void stream_wait(DeviceContext& ctx) {}
  virtual void synchronize(DeviceContext& ctx) {}

  // Ends the job's use of the group in order, before a process exits: returns once every rank
  // has returned from its last collective (a rank that exits while a peer is still inside one
  // resets their connection), and on rank 0, which hosts the rendezvous store, once every rank
  // is done with the store too. Two rounds of counters in the store, not a collective: rank 0
  // could leave a Gloo barrier, and exit, while a peer was still inside it (seen with 4 ranks).
  void leave(DeviceContext& ctx);

 protected:
  // `monitor`: every rank's heartbeat, so a failure can name the rank that stopped answering.
  ProcessGroup(const GroupOptions& options, std::unique_ptr<PeerMonitor> monitor);
  // As a collective starts (the monitor counts them; `what` is a string literal).
  void entering(const char* what);
  // Throws the error for a collective that failed or timed out: `what` ("gloo all-reduce"), and
  // `detail` (the transport's words); with a monitor attached, a PeerFailure naming the rank
  // that stopped answering.
  [[noreturn]] void fail(const std::string& what, const std::string& detail) const;

  int rank_, size_;
  std::unique_ptr<PeerMonitor> monitor_;
  std::shared_ptr<Store> store_;  // the rendezvous store, alive while the group is
  std::chrono::milliseconds timeout_;
};

// The options of this rank's group in the job `rv` joined.
GroupOptions group_options(const Rendezvous& rv, CommBackend backend,
                           std::chrono::milliseconds timeout);

// The group for `options`: a group of one (every collective the identity) when size is 1,
// else Gloo or NCCL, set up through the store. ctx is the rank's device (NCCL: its GPU), and
// outlives the group. Throws UsageError when the backend is not built or cannot load here.
std::unique_ptr<ProcessGroup> make_process_group(const GroupOptions& options, DeviceContext& ctx);

// The Gloo group alone (gloo_group.cpp); make_process_group() is what callers use.
std::unique_ptr<ProcessGroup> make_gloo_group(const GroupOptions& options,
                                              std::unique_ptr<PeerMonitor> monitor);

bool gloo_available();
// UsageError where GLOO_SOCKET_IFNAME names no interface of this machine. Gloo's own failure is
// an assertion's text that does not name the variable; and checked before the ranks meet (the
// run's validation), every rank refuses alike, where one that failed in the group first could
// stop the rank that holds the store before the others reached the same error.
void check_gloo_interface();
// Empty when NCCL can be used here, else why not (one line).
std::string nccl_problem();
inline bool nccl_available() { return nccl_problem().empty(); }
// UsageError unless a rank on `device` can use NCCL: a GPU, and NCCL built and loadable.
void check_nccl_usable(const Device& device);

}  // namespace replica
