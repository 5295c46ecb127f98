// The training set held on the devices (--data-placement device): gather_rows cuts exact rows,
// one copy serves every device on the same memory, the loader then hands out indices only, and
// training reaches the same bits as with batches prepared on the host, in every mode.
#include <doctest/doctest.h>

#include <numeric>

#include <nlohmann/json.hpp>

#include "checkpoint_helpers.h"
#include "cli_helpers.h"
#include "engine/context.h"
#include "engine/data/dataset.h"
#include "engine/data/loader.h"
#include "engine/data/resident_dataset.h"
#include "engine/ops.h"
#include "parallel/engines/dp_engine.h"

using namespace replica;

namespace {

Tensor i32_tensor(DeviceContext& ctx, const std::vector<int32_t>& v) {
  Tensor t = ctx.alloc({int64_t(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

std::vector<float> floats(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }
std::vector<int32_t> ints(const Tensor& t) { return {t.i32(), t.i32() + t.numel()}; }

}  // namespace

TEST_CASE("gather_rows copies whole rows by index (F32 and I32, repeats, any order)") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  Tensor table = ctx.alloc({5, 2, 3});
  std::iota(table.f32(), table.f32() + table.numel(), 0.f);
  Tensor rows = i32_tensor(ctx, {3, 0, 3, 4});
  Tensor out = ctx.alloc({4, 2, 3});
  ctx.ops().gather_rows(ctx, out, table, rows);
  const std::vector<float> got = floats(out);
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 6; ++k) CHECK(got[size_t(i * 6 + k)] == float(rows.i32()[i] * 6 + k));

  Tensor labels = i32_tensor(ctx, {10, 11, 12, 13, 14});
  Tensor picked = ctx.alloc({4}, DType::I32);
  ctx.ops().gather_rows(ctx, picked, labels, rows);
  CHECK(ints(picked) == std::vector<int32_t>{13, 10, 13, 14});

  Tensor empty = ctx.alloc({0, 2, 3});
  CHECK_NOTHROW(ctx.ops().gather_rows(ctx, empty, table, i32_tensor(ctx, {})));
  Tensor wrong = ctx.alloc({4, 5});
  CHECK_THROWS_WITH_AS(ctx.ops().gather_rows(ctx, wrong, table, rows),
                       doctest::Contains("gather_rows"), Error);
  Tensor as_f32 = ctx.alloc({4});
  CHECK_THROWS_AS(ctx.ops().gather_rows(ctx, picked, table, as_f32), Error);  // rows not I32
  CHECK_THROWS_AS(ctx.ops().gather_rows(ctx, as_f32, labels, rows), Error);   // dtype mismatch
}

TEST_CASE("a resident set: one copy per memory, batches equal to the host reader's") {
  auto data = make_synthetic(37, {1, 5, 4}, 6, 99);
  DeviceContext a(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  DeviceContext b(Device{DeviceType::CPU, 1, 1}, ContextOptions{1});
  ResidentDataset set(*data);
  set.hold_on(a);
  set.hold_on(b);  // virtual CPU devices share the host's memory
  CHECK(set.copies() == 1);
  CHECK(set.bytes() == 37 * (20 * 4 + 4));

  const std::vector<int64_t> picks = {36, 0, 17, 17, 5};
  Batch host = read_batch(*data, picks, host_allocator());
  Tensor rows = i32_tensor(b, {36, 0, 17, 17, 5});
  Tensor images = set.images(b, rows), labels = set.labels(b, rows);
  CHECK(images.shape() == host.images.shape());
  CHECK(floats(images) == floats(host.images));
  CHECK(ints(labels) == ints(host.labels));

  ResidentDataset unused(*data);
  CHECK_THROWS_WITH_AS(unused.images(a, rows), doctest::Contains("not held on cpu:0"), Error);
}

TEST_CASE("placement: names, auto keeps CPU devices on the host, device is honoured") {
  CHECK(parse_data_placement("device") == DataPlacement::Device);
  CHECK(std::string(data_placement_name(parse_data_placement("host"))) == "host");
  CHECK_THROWS_WITH_AS(parse_data_placement("gpu"), doctest::Contains("auto, host or device"),
                       UsageError);
  auto data = make_synthetic(10, {1, 28, 28}, 10, 1);
  const std::vector<Device> cpus = {Device{DeviceType::CPU, 0, 0}, Device{DeviceType::CPU, 1, 1}};
  CHECK(resolve_data_placement(DataPlacement::Auto, *data, cpus, 1) == DataPlacement::Host);
  CHECK(resolve_data_placement(DataPlacement::Device, *data, cpus, 1) == DataPlacement::Device);
  CHECK(resolve_data_placement(DataPlacement::Host, *data, cpus, 1) == DataPlacement::Host);
  CHECK_FALSE(data_fits_on_device(1, cpus[0], 1));
}

TEST_CASE("a loader over a resident set hands out indices only, in epoch order") {
  auto data = make_synthetic(23, {1, 4, 4}, 3, 5);
  ResidentDataset set(*data);
  Loader loader(*data, 5, false, 2, &set);
  std::vector<int64_t> order = epoch_order(23, 8, 0, true);
  loader.start_epoch(order, 0);
  std::vector<int64_t> seen;
  while (auto batch = loader.next()) {
    CHECK(batch->resident == &set);
    CHECK_FALSE(batch->images.defined());
    CHECK_FALSE(batch->labels.defined());
    REQUIRE(batch->indices.defined());
    CHECK(batch->size() == batch->indices.dim(0));
    for (int64_t i = 0; i < batch->size(); ++i) seen.push_back(batch->indices.i32()[i]);
  }
  CHECK(seen == order);

  auto other = make_synthetic(23, {1, 4, 4}, 3, 6);
  CHECK_THROWS_AS(Loader(*other, 5, false, 2, &set), Error);  // a set of another dataset
}

TEST_CASE("evaluation reads a resident batch as it reads a host one (single and DP cpu*2)") {
  auto data = make_synthetic(24, {1, 28, 28}, 10, 4);
  EngineOptions o;
  o.threads_per_device = 1;
  const std::vector<int64_t> picks = {3, 17, 0, 9, 9, 21, 14};
  for (int devices : {1, 2}) {
    CAPTURE(devices);
    auto engine = devices == 1 ? make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o)
                               : make_dp_engine(parse_devices("cpu*2"), o);
    ResidentDataset set(*data);
    for (DeviceContext* ctx : engine->contexts()) set.hold_on(*ctx);
    Batch host = read_batch(*data, picks, host_allocator());
    Batch resident;
    resident.indices = Tensor::empty(host_allocator(), {int64_t(picks.size())}, DType::I32);
    for (size_t i = 0; i < picks.size(); ++i) resident.indices.i32()[i] = int32_t(picks[i]);
    resident.resident = &set;
    engine->set_training(false);
    EvalSums on_host, on_device;
    engine->eval_batch(host, on_host);
    engine->eval_batch(resident, on_device);
    CHECK(on_device.loss_sum == on_host.loss_sum);
    CHECK(on_device.top1 == on_host.top1);
    CHECK(on_device.top5 == on_host.top5);
    CHECK(on_host.loss_sum > 0);
  }
}

TEST_CASE("training on a resident set gives the host path's bits: single, DP cpu*2, DDP 2 ranks") {
  test::TempDir tmp;
  const std::string common = test::small_mnist_train(tmp);
  for (const std::string& mode : test::cpu_modes()) {
    CAPTURE(mode);
    test::check_placements_agree(common + " " + mode, tmp);
  }
}

TEST_CASE("the run says where the data is; auto on CPU devices keeps it on the host") {
  const std::string train = test::bin("replica-train") +
                            " --synthetic --synthetic-size 64 --max-steps 2 --no-eval"
                            " --devices cpu*2 --threads-per-device 1";
  auto device = test::run(train + " --data-placement device", 120);
  REQUIRE_MESSAGE(device.exit_code == 0, device.output);
  CHECK(device.output.find("data: the training set is held on the device (0.2 MB") !=
        std::string::npos);
  auto automatic = test::run(train, 120);
  REQUIRE_MESSAGE(automatic.exit_code == 0, automatic.output);
  CHECK(automatic.output.find("data: the training set") == std::string::npos);
}
