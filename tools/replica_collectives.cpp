// replica-collectives: checks and measures the process group's collectives across the ranks
// of a launched job (nccl-tests style, for Gloo on CPU and NCCL on GPUs).
//   replica-launch --nproc-per-node 4 -- replica-collectives --check
//   replica-launch --nproc-per-node 2 -- replica-collectives --bench --min-bytes 1K --max-bytes 64M
// --check: every rank fills a tensor with its rank; all-reduce must give n(n-1)/2 everywhere;
// broadcast from every root; barriers. --bench: all-reduce time, algbw = bytes / time and
// busbw = algbw x 2(n-1)/n (the bytes each link carries in a ring), a #wrong column.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/program.h"

#include "engine/error.h"
#include "engine/ops.h"
#include "engine/device.h"
#include "parallel/comm/process_group.h"
#include "parallel/rendezvous/rendezvous.h"

using namespace replica;

namespace {

// "4", "1K", "64M", "2G": from 4 bytes (one float) to 16 GiB.
int64_t parse_bytes(const std::string& s, const char* flag) {
  int64_t mult = 1;
  std::string num = s;
  switch (s.empty() ? ' ' : s.back()) {
    case 'K': mult = 1 << 10; num.pop_back(); break;
    case 'M': mult = 1 << 20; num.pop_back(); break;
    case 'G': mult = int64_t(1) << 30; num.pop_back(); break;
    default: break;
  }
  REPLICA_USAGE_CHECK(!num.empty() && num.size() <= 11 &&
                          num.find_first_not_of("0123456789") == std::string::npos,
                      "{} '{}': expected a size like 4, 1K, 64M or 2G", flag, s);
  const int64_t bytes = std::stoll(num) * mult;
  REPLICA_USAGE_CHECK(bytes >= 4 && bytes <= (int64_t(16) << 30),
                      "{} '{}': sizes go from 4 bytes (one float) to 16G", flag, s);
  return bytes;
}

// t's values on the host, once the group's collectives are done: t itself on a CPU device (a
// message of several GB is not copied twice more), a host copy of a GPU tensor.
Tensor read_back(ProcessGroup& pg, DeviceContext& ctx, const Tensor& t) {
  pg.synchronize(ctx);
  pg.stream_wait(ctx);
  if (!ctx.is_cuda()) return t;
  Tensor host = to_host(ctx, t);
  ctx.synchronize();
  return host;
}

// How many of t's values fail `ok`.
template <class Ok>
int64_t count_wrong(ProcessGroup& pg, DeviceContext& ctx, const Tensor& t, Ok&& ok) {
  const Tensor host = read_back(pg, ctx, t);
  const float* v = host.f32();
  int64_t wrong = 0;
  for (int64_t i = 0; i < host.numel(); ++i) wrong += !ok(v[i]);
  return wrong;
}

int check(ProcessGroup& pg, DeviceContext& ctx) {
  const int n = pg.size(), r = pg.rank();
  int64_t wrong = 0;
  for (int64_t count : {int64_t(1), int64_t(1000), int64_t(1) << 20}) {
    Tensor t = ctx.alloc({count});
    ctx.ops().fill(ctx, t, float(r));
    pg.allreduce_sum(ctx, t);
    const float expect = float(n * (n - 1) / 2);
    wrong += count_wrong(pg, ctx, t, [&](float v) { return v == expect; });
  }
  for (int root = 0; root < n; ++root) {
    Tensor t = ctx.alloc({4097});
    ctx.ops().fill(ctx, t, float(r == root ? 100 + root : -1));
    pg.broadcast(ctx, t, root);
    wrong += count_wrong(pg, ctx, t, [&](float v) { return v == float(100 + root); });
  }
  for (int i = 0; i < 3; ++i) pg.barrier();
  std::printf("rank %d of %d: all-reduce, broadcast, barrier: %s (%ld wrong)\n", r, n,
              wrong ? "FAILED" : "ok", long(wrong));
  return wrong ? 1 : 0;
}

void bench(ProcessGroup& pg, DeviceContext& ctx, int64_t min_bytes, int64_t max_bytes, int iters) {
  const int n = pg.size();
  if (pg.rank() == 0)
    std::printf("%12s %12s %10s %10s %10s %7s\n", "bytes", "floats", "time_us", "algbw_GBs",
                "busbw_GBs", "#wrong");
  int slot = 0;  // a persistent buffer per size
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2, ++slot) {
    const int64_t count = std::max<int64_t>(1, bytes / 4);
    Tensor t = ctx.alloc({count});
    ctx.ops().fill(ctx, t, 1.f);
    // `t` is reused in the same role every iteration on every rank, as a gradient bucket is in
    // training: a persistent slot, so the timed calls run the cached algorithm (Gloo registers
    // a fresh one's buffers with the transport on every call: 20-40x the transfer here).
    // Gloo keeps each size's algorithm, with its buffers, until the process ends.
    pg.allreduce_sum(ctx, t, slot);  // warm-up (connections, algorithm objects)
    pg.synchronize(ctx);
    pg.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) pg.allreduce_sum(ctx, t, slot);
    pg.synchronize(ctx);
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
        iters;
    // After warm-up + iters sums of all-ones: n^(iters+1).
    const double expect = std::pow(double(n), iters + 1);
    const int64_t wrong =
        count_wrong(pg, ctx, t, [&](float v) { return std::fabs(v - expect) <= 1e-3 * expect; });
    const double algbw = count * 4.0 / us / 1e3;  // GB/s
    const double busbw = algbw * 2.0 * (n - 1) / n;
    // Bandwidths in significant digits: a latency-bound size on a busy machine measures
    // 0.0003 GB/s, which three decimals would print as zero.
    if (pg.rank() == 0)
      std::printf("%12ld %12ld %10.1f %10.3g %10.3g %7ld\n", long(count * 4), long(count), us,
                  algbw, busbw, long(wrong));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool do_check = false, do_bench = false;
  std::string min_s = "1K", max_s = "64M";
  int iters = 5;
  double timeout_s = 60;
  std::string backend = "gloo";
  CLI::App app{"replica-collectives: check and measure collectives across launched ranks"};
  app.add_flag("--check", do_check, "closed-form checks of all-reduce, broadcast, barrier");
  app.add_flag("--bench", do_bench, "all-reduce algbw/busbw over a size range");
  app.add_option("--min-bytes", min_s, "smallest message")->capture_default_str();
  app.add_option("--max-bytes", max_s, "largest message")->capture_default_str();
  app.add_option("--iters", iters, "timed iterations per size")->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds")->capture_default_str();
  app.add_option("--backend", backend,
                 "gloo (CPU tensors) | nccl (GPU tensors; ranks beyond the GPU count share GPUs)")
      ->capture_default_str();
  return run_program("replica-collectives", [&] {
    if (auto code = parse_cli(app, argc, argv)) return *code;
    REPLICA_USAGE_CHECK(do_check || do_bench, "give --check and/or --bench");
    REPLICA_USAGE_CHECK(iters >= 1, "--iters must be at least 1");
    const int64_t min_bytes = parse_bytes(min_s, "--min-bytes");
    const int64_t max_bytes = parse_bytes(max_s, "--max-bytes");
    REPLICA_USAGE_CHECK(min_bytes <= max_bytes, "--min-bytes {} is larger than --max-bytes {}",
                        min_s, max_s);
    RendezvousOptions ro;
    ro.timeout = timeout_from_seconds(timeout_s, "--timeout");
    Rendezvous rv = rendezvous(ro);
    const GroupOptions go = group_options(rv, parse_comm_backend(backend), ro.timeout);
    // NCCL: the LOCAL_RANK-th GPU, shared round-robin when there are fewer GPUs than ranks.
    const int gpus = cuda_device_count();
    REPLICA_USAGE_CHECK(go.backend == CommBackend::Gloo || gpus > 0,
                        "--backend nccl needs a GPU, and none was found{}", cuda_backend_note());
    const Device device = go.backend == CommBackend::Nccl
                              ? Device{DeviceType::CUDA, rv.local_rank % std::max(gpus, 1), 0}
                              : Device{DeviceType::CPU, rv.local_rank, 0};
    DeviceContext ctx(device, ContextOptions{1, true});
    auto pg = make_process_group(go, ctx);
    if (rv.rank == 0) std::printf("replica-collectives: %d ranks, %s\n", rv.world_size,
                                  pg->describe().c_str());
    int rc = 0;
    if (do_check) rc = check(*pg, ctx);
    if (do_bench) bench(*pg, ctx, min_bytes, max_bytes, iters);
    pg->leave(ctx);
    return rc;
  });
}
