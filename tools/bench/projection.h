// The projection of DP and DDP to device counts not measured, from the measured 1-device runs
// (compute), the alpha-beta measurements (communication) and the model in report_math.h; and its
// error on the device counts that were measured.
#pragma once
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/bench/link.h"

namespace replica::bench {

// Device counts the projection is drawn at (8, 16 and 64 among them).
const std::vector<int>& projection_counts();

// One entry per (model, input shape, batch per device) of replica's rows that has a 1-device row
// for DP and/or DDP: {"model", "input_shape", "batch_per_device", "dp": M, "ddp": M} with
//   M = {"inputs": {...}, "formula": "...", "points": [{"devices", "samples_per_sec",
//        "efficiency", "step_ms", "comm_ms", "hidden_ms"}], "errors": [{"devices",
//        "measured_samples_per_sec", "model_samples_per_sec", "relative_error"}]}.
// Communication comes from `alpha_beta` (alpha_beta.h's measurements) when present, else from
// the measured 2-device row (beta = bytes / measured communication time, alpha = 0). With a
// declared `link` (not null) the bandwidths are the link's, the latencies stay the measured ones,
// DP is modelled as on separate GPUs (NCCL's pipelined reduce and broadcast), and the entry
// holds "link": {"name", "gbps", "published"}.
nlohmann::json build_projection(const std::vector<nlohmann::json>& rows,
                                const nlohmann::json& alpha_beta, const Link* link = nullptr);

}  // namespace replica::bench
