// REPLICA_NCCL_CHECK(call): throws replica::Error naming the call, NCCL's message and file:line
// when an NCCL call fails. CUDA builds with NCCL only (include <nccl.h> first).
#pragma once
#include "engine/error.h"

#define REPLICA_NCCL_CHECK(call)                                                            \
  do {                                                                                      \
    ncclResult_t replica_nr_ = (call);                                                      \
    if (replica_nr_ != ncclSuccess)                                                         \
      throw ::replica::Error(fmt::format("{} failed: {} ({}:{})", #call,                    \
                                         ncclGetErrorString(replica_nr_), __FILE__, __LINE__)); \
  } while (0)
