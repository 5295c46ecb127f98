#include "tools/bench/rows.h"

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/ranges.h>

#include "engine/error.h"
#include "engine/output_files.h"
#include "layers/model.h"
#include "parallel/comm/buckets.h"
#include "tools/bench/report_math.h"

namespace replica::bench {

namespace {

double get_ms(const TrackPhaseMs& t, const std::string& track, const std::string& phase) {
  auto it = t.find(track);
  if (it == t.end()) return 0;
  auto p = it->second.find(phase);
  return p == it->second.end() ? 0 : p->second;
}

double load_now() {
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  return load[0];
}

}  // namespace

const std::vector<std::string>& required_fields() {
  static const std::vector<std::string> f = {
      "mode",     "devices",    "model",       "batch_per_device", "samples_per_sec",
      "efficiency", "phase_ms", "comm_bytes", "busbw_gbps",       "peak_memory_bytes"};
  return f;
}

ModelFacts model_facts(const std::string& model, const Shape& input_shape) {
  auto m = make_model(model, input_shape, 10);
  ModelFacts f;
  f.params = m->num_params();
  f.buffer_elements = m->num_buffer_elements();
  for (const auto& b : make_buckets(m->params(), size_t(1) << 20, size_t(25) << 20))
    f.bucket_bytes.push_back(b.numel * int64_t(sizeof(float)));
  return f;
}

std::string primary_track(const Config& c) {
  return c.mode == "ddp" ? "rank0 " + c.devices[0].str() : c.devices[0].str();
}

namespace {

// Samples/s of each timed window. A DDP window lasts as long as its slowest rank (they step in
// lockstep anyway).
std::vector<double> window_throughput(const std::vector<Measurement>& ranks, int64_t samples) {
  std::vector<double> windows = ranks[0].window_seconds;
  for (const auto& r : ranks)
    for (size_t w = 0; w < windows.size() && w < r.window_seconds.size(); ++w)
      windows[w] = std::max(windows[w], r.window_seconds[w]);
  std::vector<double> sps;
  for (double s : windows) sps.push_back(double(samples * ranks[0].steps_per_window) / s);
  return sps;
}

// Phases of one step on the primary track, plus what the step spends outside them.
nlohmann::json primary_phases(const Measurement& m0, const std::string& track, double ms_per_step) {
  nlohmann::json phase_ms = nlohmann::json::object();
  double phase_sum = 0;
  if (m0.track_ms.count(track))
    for (const auto& [phase, ms] : m0.track_ms.at(track)) {
      phase_ms[phase] = ms;
      phase_sum += ms;
    }
  phase_ms["other"] = std::max(0.0, ms_per_step - phase_sum);
  return phase_ms;
}

// Communication per step and how it was timed: NCCL's all-reduces as the GPU timed them on the
// group's stream (StreamTimeline, track "... nccl stream") where there are such spans ("gpu
// events"); else the busy time of the communication thread ("host"; on CUDA its spans end when
// the device finished the bucket).
std::pair<double, std::string> comm_time(const Measurement& m0, int n, bool ddp) {
  if (n < 2) return {0.0, "host"};
  std::pair<double, std::string> t{get_ms(m0.track_ms, "comm", ddp ? "allreduce" : "reduce"),
                                   "host"};
  const std::string stream = " nccl stream";
  for (const auto& [name, phases] : m0.track_ms) {
    const bool nccl_stream = name.size() > stream.size() &&
                             name.compare(name.size() - stream.size(), stream.size(), stream) == 0;
    const double gpu_ms = nccl_stream && ddp ? get_ms(m0.track_ms, name, "allreduce") : 0;
    if (gpu_ms > 0) t = {gpu_ms, "gpu events"};
  }
  return t;
}

// The communication columns: what was sent (measured and by formula), how long it took and the
// bandwidths that makes, with nccl-tests' definitions; DP's broadcast apart.
nlohmann::json comm_fields(const Config& c, const ModelFacts& facts,
                           const std::vector<Measurement>& ranks) {
  const int n = int(c.devices.size());
  const bool ddp = c.mode == "ddp";
  const Measurement& m0 = ranks[0];
  const auto [comm_ms, comm_timing] = comm_time(m0, n, ddp);
  const double buffer_bytes = double(facts.params) * sizeof(float);
  const Collective coll = ddp ? Collective::AllReduce : Collective::Reduce;
  const int64_t formula = ddp ? ddp_comm_bytes(facts.params, n) : dp_comm_bytes(facts.params, n);
  int64_t comm_bytes = 0;
  for (const auto& r : ranks) comm_bytes = std::max(comm_bytes, r.comm_bytes);
  auto nullable = [](bool ok, double v) { return ok ? nlohmann::json(v) : nlohmann::json(); };
  const bool have_comm = n > 1 && comm_ms > 0;
  nlohmann::json f = {
      {"comm_collective", n > 1 ? nlohmann::json(collective_name(coll)) : nlohmann::json()},
      {"comm_ms", comm_ms},
      {"comm_timing", comm_timing},
      {"comm_bytes", comm_bytes},
      {"comm_bytes_formula", formula},
      {"comm_bytes_formula_text",
       ddp ? fmt::format("4 B x {} params (n > 1)", facts.params)
           : fmt::format("(n-1) x 4 B x {} params", facts.params)},
      {"comm_bytes_match", comm_bytes == formula},
      {"buffer_bytes", buffer_bytes},
      {"bus_factor", n > 1 ? nlohmann::json(bus_factor(coll, n)) : nlohmann::json()},
      {"algbw_gbps", nullable(have_comm, algbw_gbps(buffer_bytes, comm_ms / 1e3))},
      {"busbw_gbps", nullable(have_comm, busbw_gbps(coll, n, buffer_bytes, comm_ms / 1e3))},
  };
  if (!ddp) {
    const double bc_ms = n > 1 ? get_ms(m0.track_ms, "*", "broadcast") : 0.0;
    const double bc_bytes = double(facts.params + facts.buffer_elements) * sizeof(float);
    f["broadcast_ms"] = bc_ms;
    f["broadcast_bytes"] = int64_t(n - 1) * int64_t(bc_bytes);
    f["broadcast_busbw_gbps"] =
        nullable(n > 1 && bc_ms > 0, busbw_gbps(Collective::Broadcast, n, bc_bytes, bc_ms / 1e3));
  }
  return f;
}

}  // namespace

std::string ddp_transport(const std::string& backend, const std::string& collectives,
                          bool share_gpu) {
  if (backend == "nccl" && share_gpu) return "nccl-sockets";
  if (backend == "gloo" && collectives.find("shared memory") != std::string::npos)
    return "gloo-shm";
  return backend;
}

nlohmann::json make_row(const Config& c, const ModelFacts& facts,
                        const std::vector<Measurement>& ranks, const nlohmann::json& env) {
  REPLICA_CHECK(!ranks.empty(), "no measurements for {} on {} devices", c.mode, c.devices.size());
  const int n = int(c.devices.size());
  const Measurement& m0 = ranks[0];
  const int64_t b = c.run.batch_per_device;
  const std::vector<double> sps = window_throughput(ranks, n * b);
  const double sps_med = median(sps);
  const double ms_per_step = 1e3 * double(n * b) / sps_med;
  const std::string track = primary_track(c);
  nlohmann::json device_list = nlohmann::json::array();
  for (const auto& d : c.devices) device_list.push_back(d.str());
  nlohmann::json peaks = nlohmann::json::array(), held = nlohmann::json::array(),
                 kept = nlohmann::json::array();
  for (const auto& r : ranks) {
    for (size_t p : r.peak_memory) peaks.push_back(p);
    for (size_t p : r.peak_held) held.push_back(p);
    for (size_t p : r.forward_kept) kept.push_back(p);
  }
  nlohmann::json row = {
      {"engine", "replica"},
      {"mode", c.mode},
      {"devices", n},
      {"device_list", device_list},
      {"devices_share_gpu", devices_share_hardware(c.devices)},
      {"model", c.run.model},
      {"input_shape", fmt::format("{}", fmt::join(c.run.input_shape, "x"))},
      {"params", facts.params},
      {"batch_per_device", b},
      {"global_batch", n * b},
      {"threads_per_device", c.run.threads_per_device},
      {"precision", precision_name(c.run.precision)},
      {"cudnn_benchmark", c.run.cudnn_benchmark},
      // GPUs: cuDNN's interface for convolutions (REPLICA_CUDNN_API; engine/context.h)
      {"cudnn_api", c.devices[0].is_cuda()
                        ? nlohmann::json(conv_api_name(conv_api_from_environment()))
                        : nlohmann::json()},
      {"memory_format", memory_format_name(c.run.channels_last)},
      {"cuda_graphs", c.run.cuda_graphs},
      {"warmup_steps", c.run.warmup},
      {"timed_steps", c.run.steps},
      {"repeats", c.run.repeat},
      {"data", preloaded_data_name(c.devices)},
      {"samples_per_sec", sps_med},
      {"samples_per_sec_runs", sps},
      {"ms_per_step", ms_per_step},
      {"speedup", nullptr},
      {"efficiency", nullptr},
      {"phase_ms", primary_phases(m0, track, ms_per_step)},
      {"phase_track", track},
      {"tracks_ms", m0.track_ms},
      {"bucket_bytes", facts.bucket_bytes},
      {"peak_memory_bytes", peaks},
      {"peak_held_bytes", held},
      {"forward_kept_bytes", kept},
      {"final_loss", m0.final_loss},
      {"load_avg_1m", load_now()},
      {"env", env},
  };
  row.update(comm_fields(c, facts, ranks));
  if (c.mode == "ddp") {
    row["backend"] = ddp_transport(c.backend, m0.collectives, devices_share_hardware(c.devices));
    nlohmann::json rank_windows = nlohmann::json::array();
    for (const auto& r : ranks) rank_windows.push_back(r.window_seconds);
    row["rank_window_seconds"] = rank_windows;
  } else {
    row["reduce"] = c.reduce;
  }
  return row;
}

void add_scaling(std::vector<nlohmann::json>& rows) {
  auto key = [](const nlohmann::json& r) {
    return fmt::format("{}|{}|{}|{}|{}", r.value("engine", "replica"), r.value("mode", ""),
                       r.value("model", ""), r.value("input_shape", ""),
                       r.value("batch_per_device", int64_t(0)));
  };
  std::map<std::string, double> base;
  for (const auto& r : rows)
    if (r.value("devices", 0) == 1 && r["samples_per_sec"].is_number())
      base[key(r)] = r["samples_per_sec"].get<double>();
  for (auto& r : rows) {
    auto it = base.find(key(r));
    if (it == base.end() || !r["samples_per_sec"].is_number()) continue;
    const double sps = r["samples_per_sec"].get<double>();
    r["speedup"] = speedup(sps, it->second);
    r["efficiency"] = efficiency(sps, it->second, r["devices"].get<int>());
  }
}

namespace {

std::string json_lines(const std::vector<nlohmann::json>& rows) {
  std::string text;
  for (const auto& r : rows) text += r.dump() + "\n";
  return text;
}

}  // namespace

void append_rows(const std::string& path, const std::vector<nlohmann::json>& rows) {
  append_file_atomically(path, json_lines(rows));
}

void write_rows(const std::string& path, const std::vector<nlohmann::json>& rows) {
  write_file_atomically(path, json_lines(rows));
}

void write_csv(const std::string& path, const std::vector<nlohmann::json>& rows) {
  const std::vector<std::string> cols = {
      "engine", "mode", "devices", "devices_share_gpu", "model", "input_shape",
      "batch_per_device", "global_batch", "threads_per_device", "precision", "samples_per_sec",
      "speedup", "efficiency", "ms_per_step", "comm_bytes", "comm_bytes_formula", "comm_ms", "algbw_gbps",
      "busbw_gbps"};
  std::set<std::string> phases;
  size_t max_devices = 0;
  for (const auto& r : rows) {
    if (r.contains("phase_ms") && r["phase_ms"].is_object())
      for (auto& [p, v] : r["phase_ms"].items()) phases.insert(p);
    if (r.contains("peak_memory_bytes") && r["peak_memory_bytes"].is_array())
      max_devices = std::max(max_devices, r["peak_memory_bytes"].size());
  }
  auto cell = [](const nlohmann::json& v) -> std::string {
    if (v.is_null()) return "";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
    return v.dump();
  };
  std::string out;
  std::string header = fmt::format("{}", fmt::join(cols, ","));
  for (const auto& p : phases) header += ",phase_" + p + "_ms";
  // Per device: the peak bytes in use, the peak bytes held, what a forward kept for backward.
  const std::pair<const char*, const char*> peak_columns[] = {
      {"peak_memory_bytes", "peak_memory_dev{}_bytes"},
      {"peak_held_bytes", "peak_held_dev{}_bytes"},
      {"forward_kept_bytes", "forward_kept_dev{}_bytes"}};
  for (const auto& [key, column] : peak_columns)
    for (size_t d = 0; d < max_devices; ++d)
      header += "," + fmt::format(fmt::runtime(column), d);
  out += header + "\n";
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i)
      line += (i ? "," : "") + (r.contains(cols[i]) ? cell(r[cols[i]]) : std::string());
    for (const auto& p : phases)
      line += "," + (r.contains("phase_ms") && r["phase_ms"].is_object() && r["phase_ms"].contains(p)
                         ? cell(r["phase_ms"][p])
                         : std::string());
    for (const auto& [key, column] : peak_columns) {
      const auto& pk = r.contains(key) ? r[key] : nlohmann::json();
      for (size_t d = 0; d < max_devices; ++d)
        line += "," + (pk.is_array() && d < pk.size() ? cell(pk[d]) : std::string());
    }
    out += line + "\n";
  }
  write_file_atomically(path, out);
}

}  // namespace replica::bench
