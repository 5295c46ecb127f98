#include "tools/bench/alpha_beta.h"

#include <algorithm>
#include <chrono>
#include <fstream>

#include "engine/error.h"
#include "engine/ops.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"
#include "tools/bench/suites.h"

namespace replica::bench {

namespace {

using Clock = std::chrono::steady_clock;

double median3(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per call of f: after one untimed call, repeated until at least 20 ms and 3 calls,
// then `sync` (device work finished); the median of 3 such runs.
template <class F, class S>
double time_per_call(F&& f, S&& sync) {
  f();
  sync();
  std::vector<double> runs;
  for (int r = 0; r < 3; ++r) {
    int calls = 0;
    const auto t0 = Clock::now();
    double elapsed = 0;
    do {
      f();
      if (++calls >= 3) {
        sync();
        elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    } while (calls < 3 || elapsed < 0.02);
    runs.push_back(elapsed / calls);
  }
  return median3(runs);
}

nlohmann::json fitted(const std::vector<double>& bytes, const std::vector<double>& seconds,
                      const std::string& what) {
  nlohmann::json points = nlohmann::json::array();
  for (size_t i = 0; i < bytes.size(); ++i) points.push_back({bytes[i], seconds[i]});
  const AlphaBeta f = fit_alpha_beta(bytes, seconds);
  return {{"what", what}, {"points", points}, {"alpha_s", f.alpha_s},
          {"beta_bytes_per_s", f.beta_bytes_per_s}};
}

}  // namespace

std::vector<int64_t> sweep_sizes(double gradient_bytes) {
  std::vector<int64_t> sizes;
  for (int64_t s = 16 << 10; s <= (4 << 20); s *= 4) sizes.push_back(s);
  const int64_t g = int64_t(gradient_bytes) / 4 * 4;
  if (g > 0 && g <= (int64_t(64) << 20) &&
      std::find(sizes.begin(), sizes.end(), g) == sizes.end())
    sizes.push_back(g);
  std::sort(sizes.begin(), sizes.end());
  return sizes;
}

nlohmann::json measure_dp_primitives(const std::vector<Device>& devices, int threads,
                                     const std::vector<int64_t>& sizes) {
  REPLICA_CHECK(devices.size() >= 2, "the DP measurement needs two devices");
  DeviceContext c0(devices[0], ContextOptions{threads, false});
  DeviceContext c1(devices[1], ContextOptions{threads, false});
  std::vector<double> bytes, add_s, copy_s;
  for (int64_t size : sizes) {
    const int64_t count = size / 4;
    Tensor a0, b0, a1;
    c0.run([&] {
      a0 = c0.alloc({count});
      b0 = c0.alloc({count});
      c0.ops().fill(c0, a0, 1.f);
      c0.ops().fill(c0, b0, 0.f);
      c0.synchronize();
    });
    c1.run([&] {
      a1 = c1.alloc({count});
      c1.ops().fill(c1, a1, 1.f);
      c1.synchronize();
    });
    // The reduce step: device 0 adds a peer's gradients into its own. On CPU the reducer's
    // communication thread calls the add directly (outside any device's arena), as here. A
    // peer on another GPU is first copied into a staging buffer on device 0, as the reducer
    // does without NCCL.
    const bool other_gpu = c0.is_cuda() && devices[1].index != devices[0].index;
    Tensor stage;
    if (other_gpu) c0.run([&] { stage = c0.alloc({count}); });
    auto add = [&] {
      if (!c0.is_cuda()) {
        c0.ops().add(c0, b0, a1, 1.f);
        return;
      }
      c0.run([&] {
        if (other_gpu) {
          c0.ops().copy(c0, stage, a1);
          c0.ops().add(c0, b0, stage, 1.f);
        } else {
          c0.ops().add(c0, b0, a1, 1.f);
        }
      });
    };
    // The broadcast step: the peer copies device 0's parameters on its own worker.
    auto copy = [&] { c1.run([&] { c1.ops().copy(c1, a1, a0); }); };
    bytes.push_back(double(size));
    add_s.push_back(time_per_call(add, [&] { c0.run([&] { c0.synchronize(); }); }));
    copy_s.push_back(time_per_call(copy, [&] { c1.run([&] { c1.synchronize(); }); }));
  }
  return {{"dp_reduce", fitted(bytes, add_s, "device 0 adds one peer's buffer into its own")},
          {"dp_broadcast", fitted(bytes, copy_s, "a peer copies device 0's buffer")}};
}

nlohmann::json allreduce_sweep(ProcessGroup& group, DeviceContext& ctx,
                               const std::vector<int64_t>& sizes) {
  nlohmann::json points = nlohmann::json::array();
  std::vector<Tensor> keep;  // persistent buffers stay alive for the whole sweep
  for (int64_t size : sizes) {
    const int64_t count = size / 4;
    Tensor t;
    ctx.run([&] {
      t = ctx.alloc({count});
      ctx.ops().fill(ctx, t, 0.f);
      ctx.synchronize();
    });
    keep.push_back(t);
    const int iters = int(std::clamp<int64_t>((int64_t(16) << 20) / size, 3, 50));
    std::vector<double> runs;
    ctx.run([&] {
      const int slot = int(keep.size()) - 1;  // a persistent buffer per size
      group.allreduce_sum(ctx, t, slot);  // warm-up: connections, algorithm objects
      group.synchronize(ctx);
      for (int r = 0; r < 3; ++r) {
        group.barrier();
        const auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) group.allreduce_sum(ctx, t, slot);
        group.synchronize(ctx);
        ctx.synchronize();
        runs.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
      }
    });
    points.push_back({double(size), median3(runs)});
  }
  return points;
}

nlohmann::json measure_ddp_allreduce(const SuiteOptions& o, const std::vector<int64_t>& sizes) {
  const int n = 2;
  ScratchDir dir;
  std::vector<std::string> args = worker_arguments(o);
  args.insert(args.end(), {"--worker", "allreduce", "--worker-out", dir.file("allreduce")});
  launch_ranks(o, n, args, dir.file("launch.log"));
  std::ifstream in(dir.file("allreduce.json"));
  REPLICA_CHECK(in.good(), "rank 0 of the all-reduce sweep wrote no result");
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<double> bytes, seconds;
  for (const auto& p : j.at("points")) {
    bytes.push_back(p.at(0).get<double>());
    seconds.push_back(p.at(1).get<double>());
  }
  const AlphaBeta whole = fit_alpha_beta(bytes, seconds);
  const AlphaBeta ring = ring_alpha_beta(whole, n);
  // (Gloo's ranks on one machine all-reduce through shared memory: a reduce-scatter and an
  // all-gather over memory, modelled as the ring is.)
  std::vector<Device> ranks_devices;
  for (int r = 0; r < n; ++r) ranks_devices.push_back(rank_device(o, r));
  return {{"what", "all-reduce across 2 ranks (ring: 2(n-1) messages of S/n each)"},
          {"ranks", n},
          {"backend", ddp_transport(ddp_backend(o, n), j.value("collectives", ""),
                                    devices_share_hardware(ranks_devices))},
          {"points", j.at("points")},
          {"whole_alpha_s", whole.alpha_s},
          {"whole_beta_bytes_per_s", whole.beta_bytes_per_s},
          {"alpha_s", ring.alpha_s},
          {"beta_bytes_per_s", ring.beta_bytes_per_s}};
}

}  // namespace replica::bench
