#include "tools/bench/report_math.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace replica::bench {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double speedup(double sps_n, double sps_1) { return sps_1 > 0 ? sps_n / sps_1 : 0.0; }

double efficiency(double sps_n, double sps_1, int n) {
  return n > 0 ? speedup(sps_n, sps_1) / n : 0.0;
}

int64_t dp_comm_bytes(int64_t params, int n) {
  return n > 1 ? int64_t(n - 1) * params * int64_t(sizeof(float)) : 0;
}

int64_t ddp_comm_bytes(int64_t params, int n) {
  return n > 1 ? params * int64_t(sizeof(float)) : 0;
}

double ring_wire_bytes(double buffer_bytes, int n) {
  return n > 1 ? buffer_bytes * 2.0 * (n - 1) / n : 0.0;
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce:
      return "all-reduce";
    case Collective::Reduce:
      return "reduce";
    case Collective::Broadcast:
      return "broadcast";
  }
  return "?";
}

double bus_factor(Collective c, int n) {
  if (c == Collective::AllReduce) return n > 0 ? 2.0 * (n - 1) / n : 0.0;
  return 1.0;
}

double algbw_gbps(double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0.0;
}

double busbw_gbps(Collective c, int n, double bytes, double seconds) {
  return algbw_gbps(bytes, seconds) * bus_factor(c, n);
}

AlphaBeta fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds) {
  if (bytes.size() != seconds.size() || bytes.size() < 2)
    throw std::invalid_argument("alpha-beta fit needs at least two (bytes, seconds) points");
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (!(seconds[i] > 0) || !(bytes[i] >= 0))
      throw std::invalid_argument("alpha-beta fit: times must be positive, sizes non-negative");
    const double w = 1.0 / (seconds[i] * seconds[i]);
    sw += w;
    sx += w * bytes[i];
    sy += w * seconds[i];
    sxx += w * bytes[i] * bytes[i];
    sxy += w * bytes[i] * seconds[i];
  }
  const double det = sw * sxx - sx * sx;
  if (!(det > 0)) throw std::invalid_argument("alpha-beta fit needs two distinct sizes");
  double c = (sw * sxy - sx * sy) / det;
  double a = (sy - c * sx) / sw;
  if (a < 0) {  // latency cannot be negative: the best line through the origin instead
    a = 0;
    c = sxy / sxx;
  }
  if (!(c > 0)) throw std::invalid_argument("alpha-beta fit: time does not grow with size");
  return {a, 1.0 / c};
}

AlphaBeta ring_alpha_beta(const AlphaBeta& whole, int n) {
  if (n < 2) throw std::invalid_argument("a ring needs at least two ranks");
  const double steps = 2.0 * (n - 1);
  return {whole.alpha_s / steps, whole.beta_bytes_per_s * steps / n};
}

double overlappable_fraction(const GradientInputs& g) {
  if (g.bytes <= 0) return 0.0;
  return std::clamp(1.0 - g.last_bucket_bytes / g.bytes, 0.0, 1.0);
}

double ring_allreduce_seconds(const AlphaBeta& ring, int n, double bytes, int buckets) {
  if (n < 2) return 0.0;
  return buckets * 2.0 * (n - 1) * ring.alpha_s + ring_wire_bytes(bytes, n) / ring.beta_bytes_per_s;
}

namespace {

Projected finish(const ComputeInputs& c, int n, double comm, double hidden, double extra) {
  Projected p;
  p.devices = n;
  p.comm_s = comm + extra;
  p.hidden_s = hidden;
  p.step_s = c.step_s + comm - hidden + extra;
  p.samples_per_sec = p.step_s > 0 ? double(n) * double(c.batch_per_device) / p.step_s : 0.0;
  p.efficiency = p.step_s > 0 ? c.step_s / p.step_s : 0.0;
  return p;
}

}  // namespace

Projected project_ddp(const DdpModel& m, int n) {
  const double comm = ring_allreduce_seconds(m.ring, n, m.grad.bytes, m.grad.buckets);
  const double hidden = std::min(overlappable_fraction(m.grad) * comm, m.compute.backward_s);
  return finish(m.compute, n, comm, hidden, 0.0);
}

Projected project_dp(const DpModel& m, int n) {
  if (n < 2) return finish(m.compute, n, 0, 0, 0);
  const double S = m.grad.bytes, K = m.grad.buckets;
  const double reduce =
      m.pipelined ? K * (n - 1) * m.reduce.alpha_s + S / m.reduce.beta_bytes_per_s
                  : (n - 1) * (K * m.reduce.alpha_s + S / m.reduce.beta_bytes_per_s);
  const double broadcast = m.pipelined
                               ? (n - 1) * m.broadcast.alpha_s + S / m.broadcast.beta_bytes_per_s
                               : (n - 1) * m.broadcast.seconds(S);
  const double hidden = std::min(overlappable_fraction(m.grad) * reduce, m.compute.backward_s);
  return finish(m.compute, n, reduce, hidden, broadcast);
}

double relative_error(double model, double measured) {
  return measured != 0 ? (model - measured) / measured : 0.0;
}

std::vector<int> device_counts_up_to(int max_devices) {
  std::vector<int> out;
  for (int n = 1; n < max_devices; n *= 2) out.push_back(n);
  if (max_devices >= 1) out.push_back(max_devices);
  return out;
}

}  // namespace replica::bench
