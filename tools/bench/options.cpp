#include "tools/bench/options.h"

#include <algorithm>

#include <fmt/ranges.h>

#include "engine/error.h"
#include "layers/model.h"

namespace replica::bench {

namespace {

int64_t parse_positive(const std::string& part, const std::string& what, const std::string& all) {
  REPLICA_USAGE_CHECK(!part.empty() && part.size() < 7 &&
                          part.find_first_not_of("0123456789") == std::string::npos &&
                          std::stoll(part) > 0,
                      "{} '{}': expected positive integers, got '{}'", what, all, part);
  return std::stoll(part);
}

}  // namespace

std::vector<int64_t> parse_positive_list(const std::string& text, char sep,
                                         const std::string& what) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (true) {
    size_t at = text.find(sep, start);
    out.push_back(parse_positive(text.substr(start, at == std::string::npos ? at : at - start),
                                 what, text));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return out;
}

std::vector<int64_t> resolve_input_shape(const BenchOptions& o) {
  if (o.input_shape.empty()) return o.model == "cnn" ? Shape{1, 28, 28} : Shape{3, 224, 224};
  REPLICA_USAGE_CHECK(o.input_shape.find_first_not_of("0123456789x") == std::string::npos,
                      "--input-shape '{}': expected CxHxW, e.g. 3x224x224", o.input_shape);
  Shape shape = parse_positive_list(o.input_shape, 'x', "--input-shape");
  REPLICA_USAGE_CHECK(shape.size() == 3, "--input-shape '{}': expected CxHxW", o.input_shape);
  return shape;
}

void validate_common(const BenchOptions& o) {
  const auto names = model_names();
  REPLICA_USAGE_CHECK(std::find(names.begin(), names.end(), o.model) != names.end(),
                      "--model '{}': unknown model (known: {})", o.model,
                      fmt::format("{}", fmt::join(names, ", ")));
  REPLICA_USAGE_CHECK(o.batch >= 1, "--batch must be at least 1, got {}", o.batch);
  // -1: not given, chosen later from a measured step time (dp/ddp).
  REPLICA_USAGE_CHECK(o.steps >= 1 || o.steps == -1, "--steps must be at least 1, got {}", o.steps);
  REPLICA_USAGE_CHECK(o.warmup >= 0 || o.warmup == -1, "--warmup must be >= 0, got {}", o.warmup);
  REPLICA_USAGE_CHECK(o.repeat >= 1, "--repeat must be at least 1, got {}", o.repeat);
  REPLICA_USAGE_CHECK(o.trace_steps >= 0, "--trace-steps must be >= 0, got {}", o.trace_steps);
  REPLICA_USAGE_CHECK(o.threads_per_device >= 0, "--threads-per-device must be >= 1, got {}",
                      o.threads_per_device);
  REPLICA_USAGE_CHECK(o.timeout_s > 0, "--timeout must be positive, got {}", o.timeout_s);
  REPLICA_USAGE_CHECK(o.reduce == "root" || o.reduce == "tree",
                      "unknown --reduce '{}' (root, tree)", o.reduce);
  REPLICA_USAGE_CHECK(o.backend == "auto" || o.backend == "gloo" || o.backend == "nccl",
                      "unknown --backend '{}' (auto, gloo, nccl)", o.backend);
  resolve_input_shape(o);
}

}  // namespace replica::bench
