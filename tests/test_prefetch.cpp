// Batches copied to their devices a step ahead (BatchPrefetcher, TrainEngine::prefetch): a
// step takes exactly the rows staged for it, once; anything else is copied as before; and
// training with prefetched batches gives the bits of training without. On a GPU the copies run
// on a copy stream beside the step before; here the staging runs on CPU devices
// (stage_on_cpu), where it is only a copy, so its bookkeeping is tested without a GPU. The GPU
// runs are in test_cuda_dp, test_cuda_resident_data and test_cli (resume, --data-placement
// host).
#include <doctest/doctest.h>

#include <cstring>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "dp_reference.h"
#include "engine/data/resident_dataset.h"
#include "parallel/engines/dp_engine.h"
#include "parallel/engines/engine_steps.h"

using namespace replica;

namespace {

const Device kCpu{DeviceType::CPU, 0, 0};

bool same_values(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

EngineOptions sgd_cnn() {
  EngineOptions o = test::sgd_options("cnn", {1, 28, 28});
  o.threads_per_device = 1;
  o.prefetch_on_cpu = true;
  return o;
}

}  // namespace

TEST_CASE("a step takes the rows staged for it, once, and only those") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  BatchPrefetcher prefetcher({&ctx}, /*stage_on_cpu=*/true);
  REQUIRE(prefetcher.active());
  Batch batch = test::make_batches({1, 28, 28}, 8, 1, 5)[0];
  const Tensor host_images = batch.images.slice_rows(2, 6);
  const Tensor host_labels = batch.labels.slice_rows(2, 6);

  prefetcher.stage(ctx, batch, 2, 6, BatchParts::Both, "test");
  CHECK(batch.staged->size() == 1);
  // Other rows, other parts or another device are not what was staged: copied as before (on a
  // CPU device: the host batch in place), and the staged rows stay.
  DeviceContext other(kCpu, ContextOptions{1});
  CHECK(batch_rows(ctx, batch, 2, 6, BatchParts::Images).images.raw() == host_images.raw());
  CHECK(batch_rows(ctx, batch, 2, 5, BatchParts::Both).images.raw() == host_images.raw());
  CHECK(batch_rows(other, batch, 2, 6, BatchParts::Both).images.raw() == host_images.raw());
  CHECK(batch.staged->size() == 1);

  DeviceBatch staged = batch_rows(ctx, batch, 2, 6, BatchParts::Both);
  CHECK(batch.staged->size() == 0);
  CHECK(staged.images.raw() != host_images.raw());  // the copy, with the host rows' values
  CHECK(same_values(staged.images, host_images));
  CHECK(same_values(staged.labels, host_labels));
  CHECK(staged.images.shape() == host_images.shape());
  // Taken once: asking again copies again.
  CHECK(batch_rows(ctx, batch, 2, 6, BatchParts::Both).images.raw() == host_images.raw());

  // One part alone leaves the other undefined, as batch_rows does.
  prefetcher.stage(ctx, batch, 0, 8, BatchParts::Labels, "test");
  DeviceBatch labels = batch_rows(ctx, batch, 0, 8, BatchParts::Labels);
  CHECK(!labels.images.defined());
  CHECK(same_values(labels.labels, batch.labels));
}

TEST_CASE("nothing is staged for CPU devices, nor for batches of a set held on the devices") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  BatchPrefetcher plain({&ctx});
  CHECK(!plain.active());
  Batch batch = test::make_batches({1, 28, 28}, 4, 1, 5)[0];
  plain.stage(ctx, batch, 0, 4, BatchParts::Both, "test");
  CHECK(batch.staged->size() == 0);

  auto data = make_synthetic(16, {1, 28, 28}, 10, 9);
  ResidentDataset resident(*data);
  resident.hold_on(ctx);
  Loader loader(*data, 4, false, 2, &resident);
  loader.start_epoch(epoch_order(data->size(), 1, 0, false), 0);
  auto held = loader.next();
  REQUIRE(bool(held));
  BatchPrefetcher forced({&ctx}, /*stage_on_cpu=*/true);
  forced.stage(ctx, *held, 0, 4, BatchParts::Both, "test");
  CHECK(held->staged->size() == 0);  // its rows are gathered on the device
}

TEST_CASE("rows staged and never taken are released with their batch") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  BatchPrefetcher prefetcher({&ctx}, /*stage_on_cpu=*/true);
  const size_t before = ctx.allocator().bytes_in_use();
  {
    Batch batch = test::make_batches({1, 28, 28}, 8, 1, 5)[0];
    prefetcher.stage(ctx, batch, 0, 8, BatchParts::Both, "test");
    CHECK(ctx.allocator().bytes_in_use() > before);
  }
  CHECK(ctx.allocator().bytes_in_use() == before);
}

TEST_CASE("training on prefetched batches gives the bits of training without: single and DP") {
  const EngineOptions o = sgd_cnn();
  for (int64_t batch : {8, 9, 2}) {
    const auto batches = test::make_batches(o.input_shape, batch, 4, 40 + batch);
    CAPTURE(batch);
    auto plain = make_single_device_engine(kCpu, o);
    for (const auto& b : batches) plain->train_step(b);
    auto single = make_single_device_engine(kCpu, o);
    test::train_prefetching(*single, batches);
    CHECK(test::params_of(*single) == test::params_of(*plain));
    for (const char* spec : {"cpu*2", "cpu*3"}) {
      CAPTURE(spec);
      auto dp_plain = make_dp_engine(parse_devices(spec), o);
      for (const auto& b : batches) dp_plain->train_step(b);
      auto dp = make_dp_engine(parse_devices(spec), o);
      test::train_prefetching(*dp, batches, int(parse_devices(spec).size()));
      dp->synchronize();
      dp_plain->synchronize();
      CHECK(test::params_of(*dp) == test::params_of(*dp_plain));
    }
  }
}

TEST_CASE("replica-train with batches staged a step ahead ends as without: single, DP, DDP, resume") {
  test::TempDir tmp;
  const std::string common = test::small_mnist_train(tmp);
  const std::string staged = "env REPLICA_PREFETCH_ON_CPU=1 ";
  for (const std::string& mode : test::cpu_modes()) {
    CAPTURE(mode);
    const std::string train = common + " " + mode + " --checkpoint ";
    auto plain = test::run(train + tmp.str("plain"), 300);
    REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
    auto ahead = test::run(staged + train + tmp.str("ahead") + " --metrics-json " +
                               tmp.str("ahead.json"),
                           300);
    REQUIRE_MESSAGE(ahead.exit_code == 0, ahead.output);
    // Stopped mid-epoch 2 (the batch taken ahead is never trained) and resumed.
    auto part = test::run(staged + train + tmp.str("part") + " --max-steps 9", 300);
    REQUIRE_MESSAGE(part.exit_code == 0, part.output);
    auto rest = test::run(staged + train + tmp.str("part") + " --resume", 300);
    REQUIRE_MESSAGE(rest.exit_code == 0, rest.output);
    test::check_same_checkpoint(tmp.str("plain/checkpoint.safetensors"),
                                tmp.str("ahead/checkpoint.safetensors"));
    test::check_same_checkpoint(tmp.str("plain/checkpoint.safetensors"),
                                tmp.str("part/checkpoint.safetensors"));
    // The staging ran: its phase is in the metrics.
    auto metrics = nlohmann::json::parse(test::read_text(tmp.str("ahead.json")));
    CHECK(metrics["phase_ms_per_step"].contains("prefetch"));
    for (const char* dir : {"plain", "ahead", "part"}) test::fs::remove_all(tmp.path / dir);
  }
}
