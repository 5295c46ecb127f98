// DDP: n ranks of this program under replica-launch; every rank builds make_ddp_engine on its
// device, runs the same harness as DP and writes its measurement for the parent.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>

#include "engine/error.h"
#include "parallel/loop/run_summary.h"
#include "parallel/engines/ddp_engine.h"
#include "parallel/rendezvous/rendezvous.h"
#include "tools/bench/alpha_beta.h"
#include "tools/bench/suites.h"

namespace replica::bench {

namespace {

Rendezvous join(const SuiteOptions& o) {
  Rendezvous rv = rendezvous_env_ranks();
  if (rv.world_size > 1) {
    RendezvousOptions ro;
    ro.timeout = timeout_from_seconds(o.timeout_s, "--timeout");
    rv = rendezvous(ro);
  }
  return rv;
}

}  // namespace

Device rank_device(const SuiteOptions& o, int rank) {
  return o.devices[size_t(rank) % o.devices.size()];
}

std::string ddp_backend(const SuiteOptions& o, int n) {
  if (o.backend != "auto") return o.backend;
  if (n <= 1 || !o.devices[0].is_cuda() || !nccl_available()) return "gloo";
  std::set<int> gpus;
  for (int r = 0; r < n; ++r) gpus.insert(o.devices[r].index);
  return int(gpus.size()) == n ? "nccl" : "gloo";  // logical devices sharing a GPU: Gloo
}

std::vector<Measurement> measure_ddp(const SuiteOptions& o, int n, const RunOptions& run) {
  SuiteOptions ro = o;
  ro.run = run;
  ro.backend = ddp_backend(o, n);
  ScratchDir dir;
  std::vector<std::string> args = worker_arguments(ro);
  args.insert(args.end(), {"--worker", "ddp", "--worker-out", dir.file("result")});
  launch_ranks(ro, n, args, dir.file("launch.log"), dir.file("result.alive"));
  std::vector<Measurement> ranks;
  for (int r = 0; r < n; ++r) {
    std::ifstream in(dir.file(fmt::format("result.rank{}.json", r)));
    REPLICA_CHECK(in.good(), "DDP rank {} of {} wrote no result", r, n);
    ranks.push_back(measurement_from_json(nlohmann::json::parse(in).at("measurement")));
  }
  return ranks;
}

int run_rank_worker(const std::string& kind, const SuiteOptions& o, const std::string& out) {
  REPLICA_USAGE_CHECK(kind == "ddp" || kind == "allreduce", "unknown --worker '{}'", kind);
  REPLICA_USAGE_CHECK(!out.empty(), "--worker needs --worker-out");
  Rendezvous rv = join(o);
  const Device device = rank_device(o, rv.rank);
  const GroupOptions go =
      group_options(rv, parse_comm_backend(ddp_backend(o, rv.world_size)),
                    timeout_from_seconds(o.timeout_s, "--timeout"));

  if (kind == "allreduce") {
    DeviceContext ctx(device, ContextOptions{o.run.threads_per_device, false});
    ctx.activate();
    auto group = make_process_group(go, ctx);
    const double grad_bytes = double(model_facts(o.run.model, o.run.input_shape).params) * 4;
    nlohmann::json points = allreduce_sweep(*group, ctx, sweep_sizes(grad_bytes));
    if (rv.rank == 0)
      write_json_file(out + ".json", {{"points", points}, {"collectives", group->describe()}});
    group->leave(ctx);  // rank 0 hosts the store: nobody leaves while another still uses it
    return 0;
  }

  const EngineOptions eo = engine_options(o.run);
  auto engine = make_ddp_engine(device, go, eo, DdpOptions{});
  // Each rank its own samples (as a DistributedSampler would give it), the same count.
  const Preloaded pre = preload_batches(o.run.input_shape, o.run.batch_per_device,
                                        o.run.seed + 7919 * uint64_t(rv.rank + 1), 4, engine.get());
  Measurement m = measure(*engine, pre.batches, o.run, ProgressBeat(out + ".alive"));
  engine->finish();
  write_json_file(fmt::format("{}.rank{}.json", out, rv.rank),
                  {{"rank", rv.rank}, {"device", device.str()}, {"measurement", to_json(m)}});
  return 0;
}

}  // namespace replica::bench
