#include "tools/bench/report_tables.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "tools/bench/report_math.h"

namespace replica::bench {

using json = nlohmann::json;

namespace {

std::string opt(const json& j, const char* key, const char* format) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return "-";
  return fmt::format(fmt::runtime(format), j[key].get<double>());
}

std::string pct(const json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return "-";
  return fmt::format("{:.1f}%", 100 * j[key].get<double>());
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

// "dp", "ddp (gloo)", "ddp (nccl-sockets)".
std::string mode_label(const json& r) {
  const std::string backend = text(r, "backend");
  return text(r, "mode", "?") + (backend.empty() ? "" : " (" + backend + ")");
}

// "replica dp", "replica ddp (gloo)", "pytorch ddp (nccl)".
std::string label(const json& r) {
  return fmt::format("{} {}", r.value("engine", "replica"), mode_label(r));
}

// The math a row ran in; rows written before precisions existed ran in fp32. Convolutions on
// NHWC operands (--memory-format channels_last) and algorithms timed per shape
// (--cudnn-benchmark, PyTorch's cudnn.benchmark) are named: rows are compared only with rows
// that ran alike.
std::string precision_of(const json& r) {
  std::string p = text(r, "precision", "fp32");
  if (text(r, "memory_format", "nchw") == "channels_last") p += ", channels_last";
  if (r.value("cudnn_benchmark", false)) p += ", cudnn.benchmark";
  return p;
}

}  // namespace

double num(const json& j, const char* key, double fallback) {
  return j.is_object() && j.contains(key) && j[key].is_number() ? j[key].get<double>() : fallback;
}

std::string text(const json& j, const char* key, const std::string& fallback) {
  return j.is_object() && j.contains(key) && j[key].is_string() ? j[key].get<std::string>()
                                                                : fallback;
}

std::string device0_bytes(const json& row, const char* key) {
  if (!row.is_object() || !row.contains(key)) return "-";
  const json& v = row[key];
  return v.is_array() && !v.empty() && v[0].is_number() ? format_bytes(v[0].get<double>()) : "-";
}

bool is_trace(const std::string& s) { return s.size() > 5 && s.substr(s.size() - 5) == ".json"; }

std::string throughput_section(const std::vector<json>& rows) {
  std::string s =
      "| engine | mode | model | input | precision | devices | global batch | samples/s | "
      "speed-up | efficiency | ms/step |\n|---|---|---|---|---|---:|---:|---:|---:|---:|---:|\n";
  bool above = false;
  for (const auto& r : rows) {
    above |= num(r, "efficiency") > 1.0;
    s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {:.1f} | {} | {} | {} |\n",
                     r.value("engine", "replica"), mode_label(r), r.value("model", "?"),
                     r.value("input_shape", "?"), precision_of(r), r.value("devices", 0),
                     r.value("global_batch", r.value("devices", 0) *
                                                 r.value("batch_per_device", int64_t(0))),
                     num(r, "samples_per_sec"), opt(r, "speedup", "{:.2f}x"),
                     pct(r, "efficiency"), opt(r, "ms_per_step", "{:.2f}"));
  }
  if (above)
    s += "\nAn efficiency above 100% is measurement noise (or cache effects of the smaller "
         "per-process footprint), not a real super-linear speed-up.\n";
  return s;
}

std::string phase_section(const std::vector<json>& rows) {
  std::vector<std::string> phases;
  for (const auto& r : rows)
    if (r.contains("phase_ms") && r["phase_ms"].is_object())
      for (auto& [p, v] : r["phase_ms"].items())
        if (std::find(phases.begin(), phases.end(), p) == phases.end() && p != "other")
          phases.push_back(p);
  phases.push_back("other");
  std::string s = "| mode | devices | track |";
  std::string sep = "|---|---:|---|";
  for (const auto& p : phases) {
    s += " " + p + " |";
    sep += "---:|";
  }
  s += " total |\n" + sep + "---:|\n";
  for (const auto& r : rows) {
    s += fmt::format("| {} | {} | {} |", label(r), r.value("devices", 0),
                     r.value("phase_track", std::string("-")));
    for (const auto& p : phases)
      s += " " + (r["phase_ms"].is_object() ? opt(r["phase_ms"], p.c_str(), "{:.2f}") : "-") + " |";
    s += " " + opt(r, "ms_per_step", "{:.2f}") + " |\n";
  }
  return s;
}

std::string comm_section(const std::vector<json>& rows, const json& ab) {
  std::string s;
  int64_t params = 0;
  for (const auto& r : rows) params = std::max<int64_t>(params, r.value("params", int64_t(0)));
  s += fmt::format(
      "Bytes per step are the engines' own count (`TrainEngine::comm_bytes_per_step()`), checked "
      "against the formula for P = {} parameters (S = 4 B x P = {}):\n\n"
      "- **DP**: (n-1) x S: every other replica's gradients are summed into device 0 (the "
      "reduce). The broadcast of the updated parameters (and BatchNorm buffers) moves another "
      "(n-1) x S, counted separately below.\n"
      "- **DDP**: S for n > 1: the gradient buffer each rank all-reduces; a ring sends 2(n-1)/n "
      "x S of it per rank.\n\n",
      with_commas(params), format_bytes(4.0 * params));
  s += "| mode | devices | collective | bytes/step | formula | equal | comm ms/step | algbw GB/s | "
       "bus factor | busbw GB/s | DP broadcast ms | broadcast busbw GB/s |\n"
       "|---|---:|---|---:|---:|:-:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rows) {
    const bool match = r.value("comm_bytes_match", false);
    s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", label(r),
                     r.value("devices", 0),
                     text(r, "comm_collective", "-"),
                     with_commas(r.value("comm_bytes", int64_t(0))),
                     with_commas(r.value("comm_bytes_formula", int64_t(0))), match ? "yes" : "**NO**",
                     opt(r, "comm_ms", "{:.2f}"), opt(r, "algbw_gbps", "{:.3f}"),
                     opt(r, "bus_factor", "{:.2f}"), opt(r, "busbw_gbps", "{:.3f}"),
                     opt(r, "broadcast_ms", "{:.2f}"), opt(r, "broadcast_busbw_gbps", "{:.3f}"));
  }
  s += "\nWhich time: **comm ms/step** is the busy time of the communication thread per step "
       "(the union of its `reduce` (DP) or `allreduce` (DDP) spans; DP on CUDA logical devices: "
       "device 0's `reduce` span, device-synchronised). It runs while backward still computes and "
       "it includes waiting for the slowest replica, so it is an upper bound on the pure transfer "
       "time. algbw = S / that time; busbw = algbw x bus factor, nccl-tests' definitions "
       "(all-reduce 2(n-1)/n, reduce and broadcast 1). The DP broadcast time is the wall time "
       "during which any device was copying parameters from device 0.\n";
  if (ab.is_object() && !ab.empty()) {
    s += "\nThe same primitives measured alone (no training running; fitted t(S) = alpha + S / "
         "beta over message sizes; points in `alpha_beta.json`):\n\n| primitive | alpha (us) | "
         "beta (GB/s) "
         "| sizes |\n|---|---:|---:|---|\n";
    for (const char* k : {"dp_reduce", "dp_broadcast", "ddp_allreduce"}) {
      if (!ab.contains(k)) continue;
      const json& a = ab[k];
      const size_t n = a.contains("points") ? a["points"].size() : 0;
      std::string sizes = n ? fmt::format("{} .. {} ({} sizes)", format_bytes(a["points"][0][0]),
                                          format_bytes(a["points"][n - 1][0]), n)
                            : "-";
      s += fmt::format("| {}: {} | {:.1f} | {:.3f} | {} |\n", k, a.value("what", std::string()),
                       num(a, "alpha_s") * 1e6, num(a, "beta_bytes_per_s") / 1e9, sizes);
    }
    if (ab.contains("ddp_allreduce"))
      s += "\nFor the all-reduce, alpha is per ring message and beta per link: the whole 2-rank "
           "all-reduce measured t(S) = 2(n-1) alpha + (2(n-1)/n) S / beta.\n";
  }
  return s;
}

std::string memory_section(const std::vector<json>& rows) {
  std::string s =
      "| mode | devices | device 0 | other devices (max) | device 0 - others | device 0 held | "
      "kept by a forward |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rows) {
    if (!r["peak_memory_bytes"].is_array() || r["peak_memory_bytes"].empty()) continue;
    const auto& p = r["peak_memory_bytes"];
    const double d0 = p[0].get<double>();
    double others = -1;
    for (size_t i = 1; i < p.size(); ++i) others = std::max(others, p[i].get<double>());
    s += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", label(r), r.value("devices", 0),
                     format_bytes(d0), others < 0 ? "-" : format_bytes(others),
                     others < 0 ? "-" : format_bytes(d0 - others),
                     device0_bytes(r, "peak_held_bytes"), device0_bytes(r, "forward_kept_bytes"));
  }
  s += "\nPeak bytes in use of each device's caching allocator (PyTorch's max_memory_allocated); "
       "held: in use plus cached, the most device 0's allocator took from the system "
       "(max_memory_reserved); kept by a forward: what device 0's training forward left "
       "allocated for its backward (its activations). DP's device 0 also holds the gathered "
       "outputs, the loss over the global batch and the optimizer state; DDP's ranks are "
       "alike.\n";
  return s;
}

std::string projection_section(const json& projection) {
  std::string s;
  for (const auto& g : projection) {
    s += fmt::format("\n### {} {}, {} samples per device\n", g.value("model", "?"),
                     g.value("input_shape", "?"), g.value("batch_per_device", int64_t(0)));
    const bool declared = g.contains("link");
    if (declared)
      s += fmt::format(
          "\nProjected to **separate GPUs joined by a declared link: {}**, {:.1f} GB/s per "
          "direction ({}). T1 and the latencies are the ones measured here; the bandwidth is the "
          "link's published figure, not a measurement, and DP is modelled as on separate GPUs "
          "(NCCL's pipelined reduce and broadcast). What would prove it wrong: the same bench on "
          "n such GPUs, measured samples/s well off the projected.\n",
          g["link"].value("name", "?"), num(g["link"], "gbps"),
          g["link"].value("published", "?"));
    else if (g.value("devices_share_gpu", false))
      s += "\nThese devices share one GPU: T1 and the bandwidths are those of a shared GPU, so "
           "the projection says little about separate GPUs (declare the link between GPUs "
           "with `--link`).\n";
    for (const char* mode : {"dp", "ddp"}) {
      if (!g.contains(mode)) continue;
      const json& m = g[mode];
      const json& in = m["inputs"];
      s += fmt::format("\n**{}**: `{}`\n\n", mode == std::string("dp") ? "DP" : "DDP",
                       m.value("formula", ""));
      s += fmt::format(
          "Inputs: T1 = {:.3f} ms (1-device step), Tb = {:.3f} ms (its backward), b = {}, "
          "S = {:.0f} B, K = {} bucket{}, last bucket {:.0f} B, w = 1 - last/S = {:.3f}",
          num(in, "T1_ms"), num(in, "Tb_ms"), in.value("b", int64_t(0)), num(in, "S_bytes"),
          in.value("K", 0), in.value("K", 0) == 1 ? "" : "s", num(in, "last_bucket_bytes"),
          num(in, "w"));
      if (in.contains("ring"))
        s += fmt::format(", alpha = {:.2f} us, beta = {:.4f} GB/s", num(in["ring"], "alpha_us"),
                         num(in["ring"], "beta_gbps"));
      if (in.contains("reduce"))
        s += fmt::format(", alpha_r = {:.2f} us, beta_r = {:.4f} GB/s, alpha_b = {:.2f} us, "
                         "beta_b = {:.4f} GB/s",
                         num(in["reduce"], "alpha_us"), num(in["reduce"], "beta_gbps"),
                         num(in["broadcast"], "alpha_us"), num(in["broadcast"], "beta_gbps"));
      s += fmt::format(" ({}).\n\n", in.value("source", std::string("?")));
      s += "| devices | T(n) ms | communication ms | hidden behind backward ms | samples/s | "
           "efficiency |\n|---:|---:|---:|---:|---:|---:|\n";
      for (const auto& p : m["points"]) {
        const int n = p.value("devices", 0);
        if (n != 8 && n != 16 && n != 64 && !(declared && (n == 2 || n == 4))) continue;
        s += fmt::format("| {} (projection) | {:.2f} | {:.2f} | {:.2f} | {:.1f} | {:.1f}% |\n", n,
                         num(p, "step_ms"), num(p, "comm_ms"), num(p, "hidden_ms"),
                         num(p, "samples_per_sec"), 100 * num(p, "efficiency"));
      }
      if (declared) {
        s += "\nNo error table: the devices measured here are not joined by the declared link.\n";
        continue;
      }
      s += "\nModel against measurement (relative error of samples/s; 1 device is the model's "
           "input T1, so 0 by construction):\n\n| devices | measured | model | error |\n"
           "|---:|---:|---:|---:|\n";
      for (const auto& e : m["errors"])
        s += fmt::format("| {}{} | {:.1f} | {:.1f} | {:+.1f}% |\n", e.value("devices", 0),
                         e.value("devices", 0) == 1 ? " (input)" : "",
                         num(e, "measured_samples_per_sec"), num(e, "model_samples_per_sec"),
                         100 * num(e, "relative_error"));
    }
  }
  return s;
}

namespace {

// The mode column of a side-by-side row: where the engines used different backends (NCCL
// against Gloo compares transports as much as engines), each engine's, so the ratio says so.
std::string compared_mode(const json& other, const json* mine) {
  const std::string mode = text(other, "mode", "?");
  const std::string theirs = text(other, "backend");
  const std::string ours = mine ? text(*mine, "backend") : "";
  if (theirs.empty() || ours.empty() || theirs == ours) return mode;
  return fmt::format("{} (replica {}, {} {})", mode, ours, text(other, "engine", "other"), theirs);
}

}  // namespace

// PyTorch's rows beside replica's of the same mode, device count, model, batch and precision
// (a row of another precision has no partner: "-", never a ratio of unlike things).
std::string compare_section(const std::vector<json>& rows, const std::vector<json>& compare) {
  std::string s = "| mode | model | input | precision | devices | batch/device | replica "
                  "samples/s | other engine | its samples/s | ratio (replica / other) | its "
                  "efficiency |\n|---|---|---|---|---:|---:|---:|---|---:|---:|---:|\n";
  int unmatched = 0;
  for (const auto& c : compare) {
    const json* mine = nullptr;
    for (const auto& r : rows)
      if (r["mode"] == c["mode"] && r["devices"] == c["devices"] && r["model"] == c["model"] &&
          r["batch_per_device"] == c["batch_per_device"] && precision_of(r) == precision_of(c) &&
          r.value("input_shape", "") == c.value("input_shape", r.value("input_shape", "")))
        mine = &r;
    unmatched += mine == nullptr;
    s += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {:.1f} | {} | {} |\n",
                     compared_mode(c, mine), c.value("model", "?"), c.value("input_shape", "?"),
                     precision_of(c), c.value("devices", 0),
                     c.value("batch_per_device", int64_t(0)),
                     mine ? fmt::format("{:.1f}", num(*mine, "samples_per_sec")) : "-",
                     c.value("engine", "other"), num(c, "samples_per_sec"),
                     mine && num(c, "samples_per_sec") > 0
                         ? fmt::format("{:.2f}x", num(*mine, "samples_per_sec") /
                                                      num(c, "samples_per_sec"))
                         : "-",
                     pct(c, "efficiency"));
  }
  if (unmatched > 0)
    s += fmt::format("\n{} of the other engine's {} rows have no replica row of the same mode, "
                     "device count, model, input, batch and precision (\"-\"): measure those "
                     "settings with replica too, or compare rows that match.\n",
                     unmatched, compare.size());
  return s;
}

std::string format_bytes(double bytes) {
  const double a = std::abs(bytes);
  if (a < 1e3) return fmt::format("{:.0f} B", bytes);
  if (a < 1e6) return fmt::format("{:.1f} kB", bytes / 1e3);
  if (a < 1e9) return fmt::format("{:.2f} MB", bytes / 1e6);
  return fmt::format("{:.2f} GB", bytes / 1e9);
}

}  // namespace replica::bench
