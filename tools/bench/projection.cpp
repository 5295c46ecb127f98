#include "tools/bench/projection.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "tools/bench/link.h"
#include "tools/bench/report_math.h"

namespace replica::bench {

namespace {

using json = nlohmann::json;

const json* find_row(const std::vector<const json*>& rows, const std::string& mode, int n) {
  for (const json* r : rows)
    if ((*r)["mode"] == mode && (*r)["devices"] == n) return r;
  return nullptr;
}

double number(const json& j, const char* key, double fallback = 0) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : fallback;
}

ComputeInputs compute_inputs(const json& one) {
  ComputeInputs c;
  c.step_s = number(one, "ms_per_step") / 1e3;
  c.backward_s = one.contains("phase_ms") ? number(one["phase_ms"], "backward") / 1e3 : 0.0;
  c.batch_per_device = one["batch_per_device"].get<int64_t>();
  return c;
}

GradientInputs gradient_inputs(const json& one) {
  GradientInputs g;
  g.bytes = number(one, "params") * 4;
  if (one.contains("bucket_bytes") && one["bucket_bytes"].is_array() &&
      !one["bucket_bytes"].empty()) {
    g.buckets = int(one["bucket_bytes"].size());
    g.last_bucket_bytes = one["bucket_bytes"].back().get<double>();
  } else {
    g.buckets = 1;
    g.last_bucket_bytes = g.bytes;
  }
  return g;
}

// alpha/beta of a measurement section, or from the measured 2-device row: beta = S / time.
AlphaBeta communication(const json& section, const json* two, const char* time_key,
                        double bytes, double factor, std::string& source) {
  if (section.is_object() && section.contains("beta_bytes_per_s")) {
    source = "measured: " + section.value("what", std::string("alpha-beta sweep"));
    return {section["alpha_s"].get<double>(), section["beta_bytes_per_s"].get<double>()};
  }
  if (two && number(*two, time_key) > 0) {
    source = fmt::format("from the measured 2-device run ({} per step), alpha = 0", time_key);
    return {0.0, factor * bytes / (number(*two, time_key) / 1e3)};
  }
  source = "not measured";
  return {0.0, 0.0};
}

// The inputs both models share, as the report prints them.
json shared_inputs(const ComputeInputs& compute, const GradientInputs& grad) {
  return {{"T1_ms", compute.step_s * 1e3},
          {"Tb_ms", compute.backward_s * 1e3},
          {"b", compute.batch_per_device},
          {"S_bytes", grad.bytes},
          {"K", grad.buckets},
          {"last_bucket_bytes", grad.last_bucket_bytes},
          {"w", overlappable_fraction(grad)}};
}

// A declared link replaces the measured bandwidth; the latency stays what was measured.
void declare(AlphaBeta& ab, const Link* link, std::string& source) {
  if (!link) return;
  ab.beta_bytes_per_s = link->bytes_per_s;
  source = fmt::format("beta: the declared link {}; alpha {}", link->name,
                       source == "not measured" ? "0, not measured" : source);
}

json ab_json(const AlphaBeta& ab) {
  return {{"alpha_us", ab.alpha_s * 1e6}, {"beta_gbps", ab.beta_bytes_per_s / 1e9}};
}

template <class Project>
json curve(const std::vector<const json*>& rows, const std::string& mode, Project project) {
  std::set<int> counts(projection_counts().begin(), projection_counts().end());
  for (const json* r : rows)
    if ((*r)["mode"] == mode) counts.insert((*r)["devices"].get<int>());
  json points = json::array(), errors = json::array();
  for (int n : counts) {
    const Projected p = project(n);
    points.push_back({{"devices", n}, {"samples_per_sec", p.samples_per_sec},
                      {"efficiency", p.efficiency}, {"step_ms", p.step_s * 1e3},
                      {"comm_ms", p.comm_s * 1e3}, {"hidden_ms", p.hidden_s * 1e3}});
    if (const json* m = find_row(rows, mode, n))
      errors.push_back({{"devices", n},
                        {"measured_samples_per_sec", (*m)["samples_per_sec"]},
                        {"model_samples_per_sec", p.samples_per_sec},
                        {"relative_error",
                         relative_error(p.samples_per_sec, (*m)["samples_per_sec"].get<double>())}});
  }
  return {{"points", points}, {"errors", errors}};
}

}  // namespace

const std::vector<int>& projection_counts() {
  static const std::vector<int> c = {1, 2, 4, 8, 16, 32, 64};
  return c;
}

json build_projection(const std::vector<json>& rows, const json& alpha_beta,
                      const Link* link) {
  std::map<std::string, std::vector<const json*>> groups;
  for (const auto& r : rows)
    if (r.value("engine", "replica") == "replica")
      groups[fmt::format("{}|{}|{}", r.value("model", ""), r.value("input_shape", ""),
                         r.value("batch_per_device", int64_t(0)))]
          .push_back(&r);
  const json ab = alpha_beta.is_object() ? alpha_beta : json::object();
  json out = json::array();
  for (const auto& [key, g] : groups) {
    json entry = {{"model", (*g[0])["model"]},
                  {"input_shape", (*g[0])["input_shape"]},
                  {"batch_per_device", (*g[0])["batch_per_device"]}};
    bool shared = false;
    for (const json* r : g) shared |= r->value("devices_share_gpu", false);
    entry["devices_share_gpu"] = shared;
    if (link)
      entry["link"] = {{"name", link->name},
                       {"gbps", link->bytes_per_s / 1e9},
                       {"published", link->published}};
    if (const json* one = find_row(g, "ddp", 1)) {
      DdpModel m{compute_inputs(*one), gradient_inputs(*one), {}};
      std::string source;
      const json ar = ab.contains("ddp_allreduce") ? ab["ddp_allreduce"] : json();
      // From a measured row: all-reduce time of S over 2 ranks = S / beta (ring, n = 2).
      m.ring = communication(ar, find_row(g, "ddp", 2), "comm_ms", m.grad.bytes, 1.0, source);
      declare(m.ring, link, source);
      if (m.ring.beta_bytes_per_s > 0) {
        json c = curve(g, "ddp", [&](int n) { return project_ddp(m, n); });
        c["formula"] =
            "T(n) = T1 + C(n) - min(w C(n), Tb),  C(n) = K 2(n-1) alpha + (2(n-1)/n) S / beta,  "
            "samples/s = n b / T(n)";
        c["inputs"] = shared_inputs(m.compute, m.grad);
        c["inputs"]["ring"] = ab_json(m.ring);
        c["inputs"]["source"] = source;
        entry["ddp"] = c;
      }
    }
    if (const json* one = find_row(g, "dp", 1)) {
      DpModel m{compute_inputs(*one), gradient_inputs(*one), {}, {}};
      std::string rs, bs;
      const json* two = find_row(g, "dp", 2);
      m.reduce = communication(ab.contains("dp_reduce") ? ab["dp_reduce"] : json(), two, "comm_ms",
                               m.grad.bytes, 1.0, rs);
      m.broadcast = communication(ab.contains("dp_broadcast") ? ab["dp_broadcast"] : json(), two,
                                  "broadcast_ms", m.grad.bytes, 1.0, bs);
      declare(m.reduce, link, rs);
      declare(m.broadcast, link, bs);
      m.pipelined = link != nullptr;  // separate GPUs: NCCL's pipelined reduce and broadcast
      if (m.reduce.beta_bytes_per_s > 0 && m.broadcast.beta_bytes_per_s > 0) {
        json c = curve(g, "dp", [&](int n) { return project_dp(m, n); });
        c["formula"] =
            m.pipelined
                ? "T(n) = T1 + R(n) - min(w R(n), Tb) + B(n),  R(n) = K (n-1) alpha_r + S / "
                  "beta_r,  B(n) = (n-1) alpha_b + S / beta_b,  samples/s = n b / T(n)"
                : "T(n) = T1 + R(n) - min(w R(n), Tb) + B(n),  R(n) = (n-1)(K alpha_r + S / "
                  "beta_r),  B(n) = (n-1)(alpha_b + S / beta_b),  samples/s = n b / T(n)";
        c["inputs"] = shared_inputs(m.compute, m.grad);
        c["inputs"]["reduce"] = ab_json(m.reduce);
        c["inputs"]["broadcast"] = ab_json(m.broadcast);
        c["inputs"]["source"] = rs + "; " + bs;
        entry["dp"] = c;
      }
    }
    if (entry.contains("dp") || entry.contains("ddp")) out.push_back(entry);
  }
  return out;
}

}  // namespace replica::bench
