// DP: make_dp_engine over the first n devices, in this process.
#include "parallel/engines/dp_engine.h"
#include "tools/bench/suites.h"

namespace replica::bench {

std::vector<Measurement> measure_dp(const SuiteOptions& o, int n, const RunOptions& run) {
  const EngineOptions eo = engine_options(run);
  DpOptions dp;
  dp.strategy = parse_reduce_strategy(o.reduce);
  const std::vector<Device> devices(o.devices.begin(), o.devices.begin() + n);
  auto engine = make_dp_engine(devices, eo, dp);
  const Preloaded pre =
      preload_batches(run.input_shape, n * run.batch_per_device, run.seed, 4, engine.get());
  return {measure(*engine, pre.batches, run)};
}

}  // namespace replica::bench
