// DP equivalence on GPUs: logical devices sharing GPU 0 (cuda:0*2, cuda:0*4) and, where there
// are several, distinct GPUs, against the one-device reference on GPU 0 doing DP's arithmetic
// in DP's order (to-root and tree), with buckets reduced on device 0's communication stream
// while backward runs: small buckets, so many reductions overlap it; batches copied a step
// ahead on copy streams or in the step. And the trace of such a run shows a reduction
// finishing on the GPU before backward did. Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "dp_reference.h"
#include "gpu_skip.h"
#include "engine/trace.h"
#include "parallel/engines/dp_engine.h"

using namespace replica;

namespace {

// 64 kB buckets: the CNN's gradients in several, ResNet-18's in dozens.
DpOptions small_buckets(bool tree) {
  DpOptions dp;
  dp.strategy = tree ? ReduceStrategy::Tree : ReduceStrategy::ToRoot;
  dp.first_bucket_bytes = dp.bucket_bytes = size_t(64) << 10;
  return dp;
}

void check(const std::string& spec, const std::string& model, const std::string& opt,
           int64_t batch, bool tree = false) {
  EngineOptions o;
  o.model = model;
  o.input_shape = {1, 28, 28};
  o.seed = 3;
  o.deterministic = true;
  o.optimizer.name = opt;
  o.optimizer.lr = opt == "sgd" ? 0.05f : 1e-3f;
  o.optimizer.momentum = opt == "sgd" ? 0.9f : 0.f;
  const auto devices = parse_devices(spec);
  // Pinned, as the loader's: their copies can run beside the step before.
  const auto batches =
      test::make_batches(o.input_shape, batch, 5, 100 + batch, pinned_allocator());
  auto dp = make_dp_engine(devices, o, small_buckets(tree));
  // Batches of 9 and 15 come prefetched, as the training loop has them: each replica's chunk
  // copied on its copy stream while the step before computes.
  if (batch == 8) {
    for (const auto& b : batches) dp->train_step(b);
  } else {
    test::train_prefetching(*dp, batches, int(devices.size()));
  }
  dp->synchronize();
  const auto ref =
      test::reference_params(o, batches, int(devices.size()), tree, Device{DeviceType::CUDA, 0, 0});
  CAPTURE(spec);
  CAPTURE(model);
  CAPTURE(opt);
  CAPTURE(batch);
  CAPTURE(tree);
  CHECK(test::relative_difference(ref, test::params_of(*dp)) <= 1e-5);
}

}  // namespace

TEST_CASE("DP on logical devices of GPU 0 equals the one-device reference") {
  if (!test::have_gpu()) return;
  for (const char* spec : {"cuda:0*2", "cuda:0*4"})
    for (const char* model : {"cnn", "resnet18"})
      for (const char* opt : {"sgd", "adam"})
        for (int64_t batch : {8, 9, 15}) check(spec, model, opt, batch);
  for (const char* model : {"cnn", "resnet18"}) check("cuda:0*4", model, "sgd", 15, /*tree=*/true);
}

TEST_CASE("DP on cuda:0*2: a bucket's reduction completes on the GPU while backward still runs") {
  if (!test::have_gpu()) return;
  EngineOptions o = test::sgd_options("resnet18", {1, 28, 28});
  auto dp = make_dp_engine(parse_devices("cuda:0*2"), o, small_buckets(false));
  const auto batches = test::make_batches(o.input_shape, 64, 4, 7);
  dp->train_step(batches[0]);  // warm-up: algorithms, workspaces
  dp->synchronize();
  Tracer& tracer = Tracer::global();
  tracer.clear_events();
  tracer.set_sync_device(true);  // spans end when their device (or stream) finished
  tracer.set_recording(true);
  for (size_t s = 1; s < batches.size(); ++s) dp->train_step(batches[s]);
  dp->synchronize();
  tracer.set_recording(false);
  tracer.set_sync_device(false);
  std::vector<Tracer::Event> backward, reduce;
  for (const auto& e : tracer.events()) {
    if (e.track == "cuda:0" && e.phase == "backward") backward.push_back(e);
    if (e.track == "comm" && e.phase == "reduce") reduce.push_back(e);
  }
  tracer.clear_events();
  REQUIRE(backward.size() == 3);
  CHECK(reduce.size() >= 3 * 10);  // dozens of buckets per step
  int inside = 0;
  for (const auto& r : reduce)
    for (const auto& b : backward)
      if (r.end > b.start && r.end < b.end) ++inside;
  MESSAGE(reduce.size() << " bucket reductions, " << inside
                        << " of them finished on the GPU before replica 0's backward did");
  CHECK(inside > 0);
}

TEST_CASE("DP on distinct GPUs equals the one-device reference") {
  if (!test::have_gpu()) return;
  if (cuda_device_count() < 2) {
    std::printf("SKIPPED: one GPU only (distinct-GPU DP needs two)\n");
    return;
  }
  for (const char* opt : {"sgd", "adam"}) check("cuda", "cnn", opt, 15);
}
