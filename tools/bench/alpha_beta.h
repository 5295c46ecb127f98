// Latency-bandwidth (alpha-beta) measurements of the primitives each strategy communicates with,
// on an otherwise idle machine, over a range of message sizes:
//   DP   device 0 adds a peer device's buffer into its own (the reduce step, done as the
//        reducer does it) and a peer copies device 0's buffer (the broadcast step);
//   DDP  an all-reduce across 2 ranks with the process group DDP uses (Gloo or NCCL).
// The fits (report_math.h: fit_alpha_beta) feed the projection.
#pragma once
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/context.h"
#include "parallel/comm/process_group.h"
#include "tools/bench/suites.h"

namespace replica::bench {

// 16 KB .. 4 MB by factors of 4, plus the model's gradient size when it is at most 64 MB.
std::vector<int64_t> sweep_sizes(double gradient_bytes);

// {"dp_reduce": {...}, "dp_broadcast": {...}}, each {"points": [[bytes, seconds], ...],
// "alpha_s", "beta_bytes_per_s", "what"}. Needs two devices.
nlohmann::json measure_dp_primitives(const std::vector<Device>& devices, int threads_per_device,
                                     const std::vector<int64_t>& sizes);

// One rank's part of the all-reduce sweep (every rank calls it with the same sizes); returns
// the points (seconds per all-reduce, median of 3 runs).
nlohmann::json allreduce_sweep(ProcessGroup& group, DeviceContext& ctx,
                               const std::vector<int64_t>& sizes);

// Launches 2 ranks that run allreduce_sweep; returns {"ranks", "backend", "points", the fit of
// the whole all-reduce ("whole_alpha_s", "whole_beta_bytes_per_s") and the ring's per-message
// latency and per-link bandwidth ("alpha_s", "beta_bytes_per_s")}.
nlohmann::json measure_ddp_allreduce(const SuiteOptions& o, const std::vector<int64_t>& sizes);

}  // namespace replica::bench
