// Where the ranks of a DDP job have their GPUs, agreed through the rendezvous store before NCCL
// starts (inside libreplica_nccl.so, with nccl_group.cpp).
//
// NCCL refuses two ranks on one GPU ("Duplicate GPU detected": it compares host and bus id).
// When ranks share one, every rank is given an NCCL_HOSTID of its own and the socket transport,
// so NCCL's real set-up, collectives and failures run on a one-GPU machine: a correctness and
// teaching mode that measures no interconnect.
#pragma once
#include <string>

#include "parallel/rendezvous/store.h"

namespace replica {

struct NcclPlacement {
  int gpus = 1;             // distinct GPUs among the ranks
  bool shared_gpu = false;  // fewer GPUs than ranks
};

// Every rank publishes its GPU (host, boot, PCI bus id of CUDA device `ordinal`) and `address`,
// the address it reaches the job from, under `prefix`, and reads everyone's. Where ranks share
// a GPU, sets NCCL_HOSTID and NCCL_NET=Socket for this process, and NCCL_SOCKET_IFNAME=lo (unless
// the user set it) when every rank's address is a loopback one. Before any NCCL call: NCCL reads
// them once.
NcclPlacement agree_on_placement(Store& store, const std::string& prefix, int rank, int size,
                                 int ordinal, const std::string& address);

}  // namespace replica
