// DP equivalence: N devices over a global batch B give the parameters of one device over the
// same batch, within 1e-5 relative, for 1-4 virtual CPU devices, 5 SGD-momentum and 5 Adam
// steps, batch sizes that divide evenly, that do not, and that are smaller than the device
// count. The one-device reference does DP's arithmetic in DP's order (dp_reference.h), so the
// agreement is exact; for the CNN (no BatchNorm) DP also matches a plain full-batch step. Also
// the two ways a step divides its work (the batch into chunks, the gradients into buckets), and
// the order in which the buckets go.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <thread>

#include "dp_reference.h"
#include <fmt/format.h>

#include "parallel/comm/bucket_reducer.h"
#include "parallel/engines/dp_engine.h"

using namespace replica;

namespace {

EngineOptions options(const std::string& model, const Shape& shape, const std::string& opt) {
  EngineOptions o;
  o.model = model;
  o.input_shape = shape;
  o.seed = 3;
  o.threads_per_device = 1;
  o.deterministic = true;
  o.optimizer.name = opt;
  o.optimizer.lr = opt == "sgd" ? 0.05f : 1e-3f;
  o.optimizer.momentum = opt == "sgd" ? 0.9f : 0.f;
  return o;
}

std::vector<Device> cpus(int n) { return parse_devices(n == 1 ? "cpu" : fmt::format("cpu*{}", n)); }

std::vector<float> run_dp(const EngineOptions& o, int n, const std::vector<Batch>& batches,
                          ReduceStrategy s = ReduceStrategy::ToRoot) {
  DpOptions dp;
  dp.strategy = s;
  auto e = make_dp_engine(cpus(n), o, dp);
  for (const auto& b : batches) e->train_step(b);
  e->synchronize();
  return test::params_of(*e);
}

void check_model(const std::string& model, const Shape& shape, std::vector<int64_t> batches_to_try,
                 bool also_full_batch_single) {
  for (const char* opt : {"sgd", "adam"}) {
    for (int n = 1; n <= 4; ++n) {
      for (int64_t batch : batches_to_try) {
        CAPTURE(model);
        CAPTURE(opt);
        CAPTURE(n);
        CAPTURE(batch);
        const auto o = options(model, shape, opt);
        const auto batches = test::make_batches(shape, batch, 5, 100 + batch);
        const auto dp = run_dp(o, n, batches);
        const auto ref = test::reference_params(o, batches, n);
        CHECK(test::relative_difference(ref, dp) <= 1e-5);
        if (also_full_batch_single) {
          // Full-batch gradients sum samples in another order: equal up to rounding, which
          // Adam's normalisation magnifies for near-zero gradients, hence the L2 measure.
          auto single = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
          for (const auto& b : batches) single->train_step(b);
          CHECK(test::relative_l2(test::params_of(*single), dp) <= 1e-5);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("scatter chunks follow torch.chunk") {
  auto sizes = [](int64_t b, int n) {
    std::string s;
    for (const auto& c : scatter_chunks(b, n)) s += std::to_string(c.count) + " ";
    return s;
  };
  CHECK(sizes(8, 4) == "2 2 2 2 ");
  CHECK(sizes(9, 4) == "3 3 3 0 ");
  CHECK(sizes(15, 4) == "4 4 4 3 ");
  CHECK(sizes(3, 4) == "1 1 1 0 ");
  CHECK(sizes(1, 3) == "1 0 0 ");
  CHECK(sizes(9, 2) == "5 4 ");
}

// DP's and DDP's buckets: backward's order (reverse registration), each bucket one range of the
// flat gradients, filled up to its cap (the first one's own) and closed before a parameter
// would take it past; a parameter larger than the cap is a bucket alone.
TEST_CASE("buckets: reverse order, contiguous ranges, closed before the cap") {
  const std::vector<int64_t> sizes = {100, 300, 50, 1000, 10};
  std::vector<Param> storage(sizes.size());
  std::vector<Param*> params;
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    storage[i].shape = {sizes[i]};
    storage[i].offset = offset;
    offset += sizes[i];
    params.push_back(&storage[i]);
  }
  const auto buckets = make_buckets(params, 200 * sizeof(float), 400 * sizeof(float));
  std::vector<std::vector<int>> members;
  for (const Bucket& b : buckets) members.push_back(b.params);
  CHECK(members == std::vector<std::vector<int>>{{4}, {3}, {2, 1}, {0}});
  int64_t end = offset;  // the buckets tile the flat buffer from its end down
  for (const Bucket& b : buckets) {
    CHECK(b.offset + b.numel == end);
    end = b.offset;
  }
  CHECK(end == 0);
  // One cap for all: every parameter alone at 1 float; all in one bucket at their total.
  CHECK(make_buckets(params, 4, 4).size() == sizes.size());
  CHECK(make_buckets(params, size_t(offset) * 4, size_t(offset) * 4).size() == 1);
}

// The reducer both strategies share: a bucket goes once every replica has finished it, buckets
// go in order, and those of parameters that got no gradient go at finish(), still in order.
TEST_CASE("bucket reducer: in order, once every replica finished; unused buckets at finish") {
  auto a = make_model("cnn", {1, 28, 28}, 10), b = make_model("cnn", {1, 28, 28}, 10);
  std::mutex mu;
  std::vector<int> launched;
  auto so_far = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return launched;
  };
  // A cap of one byte: every parameter a bucket of its own, bucket k = parameter n - 1 - k.
  BucketReducer reducer({a.get(), b.get()}, 1, 1, [&](int k) {
    std::lock_guard<std::mutex> lock(mu);
    launched.push_back(k);
  }, "wait_reduce");
  const int n = int(a->params().size());
  REQUIRE(int(reducer.buckets().size()) == n);
  auto finished = [&](Model& m, int bucket) {
    reducer.on_ready(&m == a.get() ? 0 : 1, {m.params()[size_t(n - 1 - bucket)]});
  };
  reducer.begin(2);
  finished(*a, 0);
  finished(*b, 0);  // both replicas: bucket 0 goes, on the communication thread
  for (int wait_ms = 0; so_far().empty() && wait_ms < 10000; ++wait_ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(so_far() == std::vector<int>{0});
  for (int k = 2; k < n; ++k) finished(*a, k);  // bucket 1's parameter got no gradient
  for (int k = 2; k < n; ++k) finished(*b, k);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(so_far() == std::vector<int>{0});  // nothing passes bucket 1
  // finish() waits for every bucket: one never launched would hang it, so it is watched. The
  // reducer cannot be destroyed while finish() waits in it, hence the exit.
  auto finished_all = std::async(std::launch::async, [&] { reducer.finish(); });
  if (finished_all.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "bucket reducer: finish() still waits after 60 s: a bucket of unused "
                         "parameters was never launched\n");
    std::_Exit(1);
  }
  finished_all.get();
  std::vector<int> all(size_t(n), 0);
  for (int k = 0; k < n; ++k) all[size_t(k)] = k;
  CHECK(so_far() == all);
}

TEST_CASE("DP cnn equals one device on the full batch (1-4 devices, B = 8, 9, 15, 3)") {
  check_model("cnn", {1, 28, 28}, {8, 9, 15, 3}, true);
}

TEST_CASE("DP resnet18 (BatchNorm) equals the one-device reference (1-4 devices, B = 8, 9, 15)") {
  // BatchNorm normalises each device's chunk, as PyTorch's DataParallel does; the reference
  // runs the same chunks on one replica, accumulating gradients, then steps once.
  check_model("resnet18", {1, 28, 28}, {8, 9, 15}, false);
}

TEST_CASE("DP resnet18 with a batch smaller than the device count") {
  // At 28x28 a chunk of one sample leaves BatchNorm one value per channel in layer4 (an error
  // in PyTorch too), so this case uses 64x64 inputs, where layer4 is 2x2.
  for (const char* opt : {"sgd", "adam"}) {
    const auto o = options("resnet18", {1, 64, 64}, opt);
    const auto batches = test::make_batches({1, 64, 64}, 3, 5, 7);
    CHECK(test::relative_difference(test::reference_params(o, batches, 4), run_dp(o, 4, batches)) <=
          1e-5);
  }
}

TEST_CASE("tree and root reductions agree; runs are reproducible") {
  const auto o = options("cnn", {1, 28, 28}, "sgd");
  const auto batches = test::make_batches({1, 28, 28}, 15, 5, 1);
  const auto root = run_dp(o, 4, batches, ReduceStrategy::ToRoot);
  const auto tree = run_dp(o, 4, batches, ReduceStrategy::Tree);
  CHECK(test::relative_difference(test::reference_params(o, batches, 4, true), tree) <= 1e-5);
  CHECK(test::relative_l2(root, tree) <= 1e-5);
  // The same run twice is bit-identical (deterministic reduction order).
  CHECK(run_dp(o, 4, batches, ReduceStrategy::Tree) == tree);
}
