#include "tools/bench/options.h"

#include <algorithm>

#include <fmt/ranges.h>

#include "engine/device.h"
#include "engine/error.h"
#include "layers/model.h"
#include "parallel/rendezvous/rendezvous.h"

namespace replica::bench {

std::vector<int64_t> resolve_input_shape(const BenchOptions& o) {
  if (o.input_shape.empty()) return o.model == "cnn" ? Shape{1, 28, 28} : Shape{3, 224, 224};
  return parse_input_shape(o.input_shape);
}

void validate_common(const BenchOptions& o) {
  check_model_name(o.model);
  REPLICA_USAGE_CHECK(o.batch >= 1, "--batch (--batch-per-device) must be at least 1, got {}",
                      o.batch);
  REPLICA_USAGE_CHECK(!o.steps || *o.steps >= 1, "--steps must be at least 1, got {}", *o.steps);
  REPLICA_USAGE_CHECK(!o.warmup || *o.warmup >= 0, "--warmup must be at least 0, got {}",
                      *o.warmup);
  REPLICA_USAGE_CHECK(!o.repeat || *o.repeat >= 1, "--repeat must be at least 1, got {}",
                      *o.repeat);
  REPLICA_USAGE_CHECK(o.seed >= 0, "--seed must be >= 0, got {}", o.seed);
  REPLICA_USAGE_CHECK(!o.trace_steps || *o.trace_steps >= 1,
                      "--trace-steps must be at least 1, got {}", *o.trace_steps);
  REPLICA_USAGE_CHECK(!o.threads_per_device || *o.threads_per_device >= 1,
                      "--threads-per-device must be at least 1, got {}", *o.threads_per_device);
  if (o.threads_per_device) check_cpu_threads("--threads-per-device", *o.threads_per_device);
  timeout_from_seconds(o.timeout_s, "--timeout");
  REPLICA_USAGE_CHECK(o.reduce == "root" || o.reduce == "tree",
                      "unknown --reduce '{}' (root, tree)", o.reduce);
  REPLICA_USAGE_CHECK(o.backend == "auto" || o.backend == "gloo" || o.backend == "nccl",
                      "unknown --backend '{}' (auto, gloo, nccl)", o.backend);
  resolve_input_shape(o);
}

}  // namespace replica::bench
