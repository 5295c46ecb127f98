// The arithmetic of DP-vs-DDP scaling reports: speed-up and efficiency, bytes per step, algbw and
// busbw (nccl-tests' definitions), the latency-bandwidth (alpha-beta) fit and the projection
// model. Pure functions of numbers: no engine, no clocks, so tests check them on fixed inputs.
//
// Weak scaling throughout: every device trains the same batch, so the global batch grows with
// the device count and the ideal throughput on n devices is n times that of one device.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica::bench {

// The median of repeated measurements (the mean of the middle two for an even count; 0 for none).
double median(std::vector<double> v);

// samples/s on n devices over samples/s on one device.
double speedup(double sps_n, double sps_1);
// speedup / n: 1.0 is perfect weak scaling.
double efficiency(double sps_n, double sps_1, int n);

// Gradient bytes per step as the engines count them (TrainEngine::comm_bytes_per_step), for a
// model of `params` FP32 parameters on n devices:
//   DP   (n-1) x 4 x params: every replica's gradients are summed into device 0 (the reduce).
//        The broadcast of the updated parameters moves another (n-1) x 4 x params (+ buffers).
//   DDP  4 x params (n > 1): the gradient buffer every rank all-reduces; a ring sends
//        2(n-1)/n of it per rank (ring_wire_bytes).
int64_t dp_comm_bytes(int64_t params, int n);
int64_t ddp_comm_bytes(int64_t params, int n);
double ring_wire_bytes(double buffer_bytes, int n);

enum class Collective { AllReduce, Reduce, Broadcast };
const char* collective_name(Collective c);
// nccl-tests' bus factor: all-reduce 2(n-1)/n; reduce and broadcast 1.
double bus_factor(Collective c, int n);
// algbw = buffer bytes / time; busbw = algbw x bus factor. GB/s (1e9 bytes per second).
double algbw_gbps(double bytes, double seconds);
double busbw_gbps(Collective c, int n, double bytes, double seconds);

// t(S) = alpha + S / beta. alpha in seconds, beta in bytes per second.
struct AlphaBeta {
  double alpha_s = 0;
  double beta_bytes_per_s = 0;
  double seconds(double bytes) const { return alpha_s + bytes / beta_bytes_per_s; }
};
// Least-squares line t = a + c S through measured (bytes, seconds) points, weighted by 1/t^2 so
// every size counts by its relative error (small messages fix alpha, large ones beta). A
// negative intercept is clamped to 0 (the slope is refitted through the origin). Needs >= 2
// distinct sizes with positive times and a positive slope; throws std::invalid_argument
// otherwise.
AlphaBeta fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds);
// The ring all-reduce's per-message latency and link bandwidth from a fit of a whole n-rank
// all-reduce t(S) = a + c S: a = 2(n-1) alpha, c = (2(n-1)/n) / beta.
AlphaBeta ring_alpha_beta(const AlphaBeta& whole_allreduce, int n);

// What the projection needs from the measured runs.
struct ComputeInputs {
  double step_s = 0;      // one device's step time (1-device run of that mode)
  double backward_s = 0;  // its backward time per step
  int64_t batch_per_device = 0;
};
struct GradientInputs {
  double bytes = 0;              // S = 4 x parameters
  int buckets = 1;               // K
  double last_bucket_bytes = 0;  // the bucket that can only start when backward has ended
};
// Fraction of the gradient bytes whose communication may overlap backward: 1 - last / S.
double overlappable_fraction(const GradientInputs& g);

// DDP on n devices: T(n) = T1 + C(n) - min(w C(n), Tb), the ring all-reduce of K buckets
// C(n) = K 2(n-1) alpha + (2(n-1)/n) S / beta, of which the part w C(n) may hide behind the
// backward time Tb.
struct DdpModel {
  ComputeInputs compute;
  GradientInputs grad;
  AlphaBeta ring;  // per-message latency, per-link bandwidth
};
// DP on n devices: T(n) = T1 + R(n) - min(w R(n), Tb) + B(n). On devices that share memory
// (CPU devices, logical devices of one GPU) everything goes through device 0: reduce
// R(n) = (n-1)(K alpha_r + S / beta_r) (device 0 adds each replica's buckets in turn), broadcast
// B(n) = (n-1)(alpha_b + S / beta_b) (device 0's parameters copied to each replica). On separate
// GPUs DP uses NCCL's reduce and broadcast, which pipeline chunks along a chain, so every link
// carries S once: R(n) = K (n-1) alpha_r + S / beta_r, B(n) = (n-1) alpha_b + S / beta_b.
struct DpModel {
  ComputeInputs compute;
  GradientInputs grad;
  AlphaBeta reduce, broadcast;
  bool pipelined = false;  // separate GPUs (NCCL), else through device 0
};

struct Projected {
  int devices = 1;
  double step_s = 0;    // T(n)
  double comm_s = 0;    // communication time before overlap
  double hidden_s = 0;  // the part hidden behind backward
  double samples_per_sec = 0;  // n b / T(n)
  double efficiency = 0;       // T1 / T(n)
};
double ring_allreduce_seconds(const AlphaBeta& ring, int n, double bytes, int buckets);
Projected project_ddp(const DdpModel& m, int n);
Projected project_dp(const DpModel& m, int n);

// (model - measured) / measured.
double relative_error(double model, double measured);

// Device counts a sweep measures: 1, 2, 4, ... below max, and max itself.
std::vector<int> device_counts_up_to(int max_devices);

}  // namespace replica::bench
