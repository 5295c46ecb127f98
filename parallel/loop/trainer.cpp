// The training entry point (trainer.h): the engine a config asks for, and run_training(), which
// installs the Ctrl-C handlers and runs a TrainLoop (train_loop.h).
#include "parallel/loop/trainer.h"

#include <algorithm>
#include <limits>

#include "engine/error.h"
#include "engine/env_switch.h"
#include "engine/trace.h"
#include "parallel/engines/ddp_engine.h"
#include "parallel/engines/dp_engine.h"
#include "parallel/loop/stop_request.h"
#include "parallel/rendezvous/rendezvous.h"
#include "parallel/loop/train_loop.h"

namespace replica {

namespace {

// --batch-per-device times the devices (DP) or ranks (DDP): the global batch, refused where the
// product does not fit rather than wrapping to a negative batch.
int64_t global_batch(int64_t batch_per_device, int64_t n, const char* what) {
  REPLICA_USAGE_CHECK(batch_per_device <= std::numeric_limits<int64_t>::max() / n,
                      "--batch-per-device {} times {} {} is too large a batch", batch_per_device,
                      n, what);
  return batch_per_device * n;
}

}  // namespace

std::unique_ptr<TrainEngine> make_engine(TrainConfig& c, const std::vector<Device>& devices) {
  c.engine.precision = resolve_precision(c.precision, devices);
  c.engine.channels_last = resolve_channels_last(c.memory_format, c.engine.precision, devices);
  // Tests: batches staged a step ahead on CPU devices too (EngineOptions::prefetch_on_cpu).
  c.engine.prefetch_on_cpu = switches::kPrefetchOnCpu.on();
  // Gradient buckets (DP and DDP): 1 MB first, so communication starts early, then the cap.
  const size_t bucket_bytes = size_t(c.bucket_cap_mb * (1 << 20));
  const size_t first_bucket_bytes = std::min(bucket_bytes, size_t(1) << 20);
  if (c.mode == "single") {
    if (c.batch_per_device > 0) c.batch_size = c.batch_per_device;
    return make_single_device_engine(devices[0], c.engine);
  }
  if (c.mode == "dp") {
    if (c.batch_per_device > 0)
      c.batch_size = global_batch(c.batch_per_device, int64_t(devices.size()), "devices");
    return make_dp_engine(devices, c.engine,
                          {parse_reduce_strategy(c.reduce), first_bucket_bytes, bucket_bytes});
  }
  Rendezvous rv = rendezvous_env_ranks();
  const std::chrono::milliseconds timeout = timeout_from_seconds(c.timeout_s, "--timeout");
  if (rv.world_size > 1) {
    RendezvousOptions ro;
    ro.init_method = c.init_method;
    ro.timeout = timeout;
    rv = rendezvous(ro);
  }
  if (c.batch_per_device > 0)
    c.batch_size = global_batch(c.batch_per_device, rv.world_size, "ranks");
  check_global_batch(c.batch_size, rv.world_size);
  check_accumulate(c.accumulate, c.batch_size / rv.world_size);
  const bool own_gpu = devices[0].is_cuda() && cuda_device_count() >= rv.local_world_size;
  const CommBackend backend =
      parse_comm_backend(c.backend != "auto" ? c.backend : own_gpu ? "nccl" : "gloo");
  if (devices[0].is_cpu() && c.engine.threads_per_device == 0)
    c.engine.threads_per_device = std::max(1, cpu_cores() / std::max(1, rv.local_world_size));
  return make_ddp_engine(devices[0], group_options(rv, backend, timeout), c.engine,
                         {first_bucket_bytes, bucket_bytes, c.accumulate});
}

nlohmann::json run_training(const TrainConfig& config) {
  validate(config);
  Tracer& tracer = Tracer::global();
  tracer.set_recording(!config.trace_file.empty());
  tracer.set_sync_device(!config.trace_file.empty());
  // Until the data is read and the engine built there is nothing to save, so a signal ends the
  // process at once (a rank waiting in the rendezvous used to sit out the whole --timeout).
  TrainLoop loop(config);
  const StopRequest handlers(config.stop_on_signal);
  return loop.run();
}

}  // namespace replica
