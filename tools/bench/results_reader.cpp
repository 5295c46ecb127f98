#include "tools/bench/results_reader.h"

#include <filesystem>
#include <sstream>
#include <utility>

#include "engine/error.h"
#include "engine/file_io.h"
#include "tools/bench/rows.h"

namespace replica::bench {

namespace {

using nlohmann::json;

// What a field holds. Null is allowed where a writer leaves a figure out (PyTorch's speedup
// before add_scaling, a bus bandwidth of one device, a peak that a CPU run does not know).
enum class Kind {
  String, Integer, Number, Bool, Numbers, Strings, PhaseMap, TrackMap, Object, Array
};

struct Field {
  const char* name;
  Kind kind;
  bool nullable;
};

// The fields of a row that are read back, with their kinds (rows.cpp and tools/pytorch_bench.py
// write them). A field not listed is kept as it is and never read.
const std::vector<Field>& row_fields() {
  static const std::vector<Field> f = {
      {"mode", Kind::String, false},          {"model", Kind::String, false},
      {"engine", Kind::String, false},        {"input_shape", Kind::String, false},
      {"reduce", Kind::String, false},        {"backend", Kind::String, true},
      {"trace", Kind::String, true},          {"phase_track", Kind::String, false},
      {"precision", Kind::String, false},     {"memory_format", Kind::String, false},
      {"data", Kind::String, false},          {"comm_timing", Kind::String, false},
      {"comm_collective", Kind::String, true}, {"comm_bytes_formula_text", Kind::String, true},
      {"devices", Kind::Integer, false},      {"batch_per_device", Kind::Integer, false},
      {"global_batch", Kind::Integer, false}, {"params", Kind::Integer, false},
      {"comm_bytes", Kind::Integer, false},   {"comm_bytes_formula", Kind::Integer, false},
      {"broadcast_bytes", Kind::Integer, true}, {"warmup_steps", Kind::Integer, false},
      {"timed_steps", Kind::Integer, false},  {"repeats", Kind::Integer, false},
      {"threads_per_device", Kind::Integer, false},
      {"samples_per_sec", Kind::Number, false}, {"speedup", Kind::Number, true},
      {"efficiency", Kind::Number, true},     {"ms_per_step", Kind::Number, false},
      {"buffer_bytes", Kind::Number, true},   {"comm_ms", Kind::Number, true},
      {"broadcast_ms", Kind::Number, true},   {"final_loss", Kind::Number, true},
      {"load_avg_1m", Kind::Number, true},    {"algbw_gbps", Kind::Number, true},
      {"busbw_gbps", Kind::Number, true},     {"broadcast_busbw_gbps", Kind::Number, true},
      {"bus_factor", Kind::Number, true},     {"comm_bytes_match", Kind::Bool, false},
      {"cuda_graphs", Kind::Bool, false},     {"cudnn_benchmark", Kind::Bool, false},
      {"devices_share_gpu", Kind::Bool, false}, {"bucket_bytes", Kind::Numbers, true},
      {"peak_memory_bytes", Kind::Numbers, true}, {"peak_held_bytes", Kind::Numbers, true},
      {"forward_kept_bytes", Kind::Numbers, true}, {"samples_per_sec_runs", Kind::Numbers, true},
      {"device_list", Kind::Strings, false},  {"phase_ms", Kind::PhaseMap, false},
      {"tracks_ms", Kind::TrackMap, true},    {"rank_window_seconds", Kind::Array, true},
      {"env", Kind::Object, true},
  };
  return f;
}

// The environment's fields that environment_line() reads.
const std::vector<Field>& env_fields() {
  static const std::vector<Field> f = {
      {"cpu", Kind::String, true},         {"build_type", Kind::String, true},
      {"commit", Kind::String, true},      {"device_spec", Kind::String, true},
      {"cores", Kind::Integer, false},     {"load_avg_1m", Kind::Number, false},
      {"others_cpu_share", Kind::Number, true}, {"gpus", Kind::Strings, true},
      {"versions", Kind::Object, true},    {"variables", Kind::Object, true},
  };
  return f;
}

bool all_of(const json& a, bool (json::*is)() const) {
  for (const auto& v : a)
    if (!(v.*is)()) return false;
  return true;
}

bool holds(const json& v, Kind k) {
  switch (k) {
    case Kind::String: return v.is_string();
    case Kind::Integer: return v.is_number_integer();
    case Kind::Number: return v.is_number();
    case Kind::Bool: return v.is_boolean();
    case Kind::Numbers: return v.is_array() && all_of(v, &json::is_number);
    case Kind::Strings: return v.is_array() && all_of(v, &json::is_string);
    case Kind::PhaseMap: return v.is_object() && all_of(v, &json::is_number);
    case Kind::TrackMap:
      if (!v.is_object()) return false;
      for (const auto& t : v)
        if (!holds(t, Kind::PhaseMap)) return false;
      return true;
    case Kind::Object: return v.is_object();
    case Kind::Array: return v.is_array();
  }
  return false;
}

const char* describe(Kind k) {
  switch (k) {
    case Kind::String: return "a string";
    case Kind::Integer: return "a whole number";
    case Kind::Number: return "a number";
    case Kind::Bool: return "true or false";
    case Kind::Numbers: return "a list of numbers";
    case Kind::Strings: return "a list of strings";
    case Kind::PhaseMap: return "an object of numbers (ms per phase)";
    case Kind::TrackMap: return "an object of objects of numbers (ms per phase per track)";
    case Kind::Object: return "an object";
    case Kind::Array: return "a list";
  }
  return "?";
}

void check_fields(const json& j, const std::vector<Field>& fields, const std::string& where,
                  const std::string& prefix) {
  for (const Field& f : fields) {
    if (!j.contains(f.name)) continue;
    const json& v = j[f.name];
    if (v.is_null() && f.nullable) continue;
    REPLICA_USAGE_CHECK(holds(v, f.kind), "{}: '{}{}' must be {}{} (got {})", where, prefix,
                        f.name, describe(f.kind), f.nullable ? " or null" : "",
                        v.dump().substr(0, 40));
  }
}

void check_row(const json& j, const std::string& where) {
  REPLICA_USAGE_CHECK(j.is_object(), "{}: not a JSON object", where);
  for (const auto& f : required_fields())
    REPLICA_USAGE_CHECK(j.contains(f), "{}: missing field '{}'", where, f);
  check_fields(j, row_fields(), where, "");
  REPLICA_USAGE_CHECK(j["devices"].get<int64_t>() >= 1, "{}: 'devices' must be at least 1", where);
  REPLICA_USAGE_CHECK(j["samples_per_sec"].get<double>() > 0,
                      "{}: 'samples_per_sec' must be positive", where);
  REPLICA_USAGE_CHECK(!j["peak_memory_bytes"].is_array() || !j["peak_memory_bytes"].empty(),
                      "{}: 'peak_memory_bytes' must list a device's peak", where);
  REPLICA_USAGE_CHECK(j["mode"] == "dp" || j["mode"] == "ddp",
                      "{}: 'mode' must be \"dp\" or \"ddp\"", where);
  if (j.contains("env") && j["env"].is_object())
    check_fields(j["env"], env_fields(), where, "env.");
}

// One measured primitive: {"points": [[bytes, seconds], ...], "alpha_s", "beta_bytes_per_s",
// "what", ...} (alpha_beta.h).
void check_primitive(const json& p, const std::string& where) {
  REPLICA_USAGE_CHECK(p.is_object(), "{}: not an object", where);
  static const std::vector<Field> fields = {
      {"what", Kind::String, false},          {"backend", Kind::String, false},
      {"ranks", Kind::Integer, false},        {"alpha_s", Kind::Number, false},
      {"beta_bytes_per_s", Kind::Number, false}, {"whole_alpha_s", Kind::Number, false},
      {"whole_beta_bytes_per_s", Kind::Number, false}, {"points", Kind::Array, false}};
  for (const char* required : {"alpha_s", "beta_bytes_per_s", "points"})
    REPLICA_USAGE_CHECK(p.contains(required), "{}: missing field '{}'", where, required);
  check_fields(p, fields, where, "");
  const json& points = p["points"];
  for (size_t i = 0; i < points.size(); ++i) {
    const json& pt = points[i];
    REPLICA_USAGE_CHECK(pt.is_array() && pt.size() == 2 && pt[0].is_number() &&
                            pt[1].is_number() && pt[0].get<double>() > 0,
                        "{}: points[{}] must be [bytes, seconds] with bytes > 0 (got {})", where,
                        i, pt.dump().substr(0, 40));
  }
}

}  // namespace

std::vector<json> read_rows(const std::string& path) {
  // Read whole through open_regular_file: a named pipe would block the read for good.
  const std::vector<uint8_t> bytes = read_file_bytes(path, "a results file (JSON lines)");
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::vector<json> rows;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, number);
    json j;
    try {
      j = json::parse(line);
    } catch (const std::exception&) {
      throw UsageError(where + ": not a JSON object");
    }
    check_row(j, where);
    if (!j.contains("engine")) j["engine"] = "replica";
    rows.push_back(std::move(j));
  }
  REPLICA_USAGE_CHECK(!rows.empty(), "results file '{}' has no rows", path);
  return rows;
}

json read_alpha_beta(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec))) return json();
  const std::vector<uint8_t> bytes = read_file_bytes(path, "alpha_beta.json");
  json j;
  try {
    j = json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception&) {
    throw UsageError(fmt::format("'{}' is not valid JSON", path));
  }
  REPLICA_USAGE_CHECK(j.is_object(), "'{}' must hold a JSON object", path);
  for (const char* k : {"dp_reduce", "dp_broadcast", "ddp_allreduce"})
    if (j.contains(k)) check_primitive(j[k], fmt::format("{}: '{}'", path, k));
  return j;
}

}  // namespace replica::bench
