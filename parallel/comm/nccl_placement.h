// Where the ranks of a DDP job over NCCL have their GPUs, agreed through the rendezvous store
// before NCCL starts, and what NCCL must be told when ranks share one.
//
// NCCL refuses two ranks on one GPU ("Duplicate GPU detected": it compares host and bus id).
// When ranks share one, every rank is given an NCCL_HOSTID of its own and the socket transport,
// so NCCL's real set-up, collectives and failures run on a one-GPU machine: a correctness and
// teaching mode that measures no interconnect. Plain C++ (the NCCL plugin passes the bus id),
// so the agreement is tested without a GPU.
#pragma once
#include <string>

#include "parallel/rendezvous/store.h"

namespace replica {

// This boot of this machine ("host:boot id"), as NCCL tells hosts apart: cloned machines may
// share a hostname, never a boot id. Also what tells the shared-memory all-reduce that ranks
// share a machine.
std::string machine_id();

struct NcclPlacement {
  int gpus = 1;             // distinct GPUs among the ranks
  bool shared_gpu = false;  // fewer GPUs than ranks
  // Where a GPU is shared: this rank's NCCL host id (one per rank), and whether its sockets go
  // over loopback, which they may only when every rank's address is a loopback one (ranks in
  // network namespaces of one machine share its GPU, not its "lo").
  std::string host_id;
  bool loopback_sockets = false;
};

// Every rank publishes its GPU (this host and boot, and `gpu_bus_id`, the PCI bus id of its
// CUDA device) with `address`, the address it reaches the job from, under `prefix`; then reads
// everyone's. Waits (up to the store's timeout) for every rank.
NcclPlacement agree_on_placement(Store& store, const std::string& prefix, int rank, int size,
                                 const std::string& gpu_bus_id, const std::string& address);

// Tells this process's NCCL what `p` says, before any NCCL call (NCCL reads its environment
// once): NCCL_HOSTID and NCCL_NET=Socket where the GPU is shared, and NCCL_SOCKET_IFNAME=lo with
// loopback sockets unless the user set an interface. Nothing when no GPU is shared.
void tell_nccl(const NcclPlacement& p);

}  // namespace replica
