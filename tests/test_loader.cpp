// The background Loader: every index once per epoch in order, partial batches and drop_last,
// resume and restart mid-epoch, buffers reused and held batches intact, shutdown with batches
// outstanding, errors of the loader thread reaching next(). (epoch_order and the synthetic
// data: test_data.cpp.)
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "engine/allocator.h"
#include "engine/data/dataset.h"
#include "engine/data/loader.h"
#include "engine/error.h"

using namespace replica;

namespace {

// Sample i is an image filled with i and label i % classes; optional delay and a failing index.
class CountingDataset : public Dataset {
 public:
  CountingDataset(int64_t n, Shape shape = {1, 2, 3}) : n_(n), shape_(std::move(shape)) {}
  int64_t size() const override { return n_; }
  Shape sample_shape() const override { return shape_; }
  int num_classes() const override { return 7; }
  void read_samples(const int64_t* idx, int64_t n, int64_t, float* images,
                    int32_t* labels) const override {
    reads++;
    if (delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    const int64_t per = shape_numel(shape_);
    for (int64_t i = 0; i < n; ++i) {
      if (idx[i] == fail_at) throw Error("sample " + std::to_string(idx[i]) + " is unreadable");
      for (int64_t k = 0; k < per; ++k) images[i * per + k] = float(idx[i]);
      labels[i] = int32_t(idx[i] % 7);
    }
  }
  std::string describe() const override { return "counting"; }

  int delay_ms = 0;
  int64_t fail_at = -1;
  mutable std::atomic<int> reads{0};

 private:
  int64_t n_;
  Shape shape_;
};

// Checks a batch holds exactly `expect` (in order) and returns nothing.
void check_batch(const Batch& b, const std::vector<int64_t>& expect, int64_t per) {
  REQUIRE(b.size() == int64_t(expect.size()));
  CHECK(b.images.shape()[0] == b.size());
  CHECK(b.labels.dtype() == DType::I32);
  for (size_t i = 0; i < expect.size(); ++i) {
    CHECK(b.labels.i32()[i] == int32_t(expect[i] % 7));
    CHECK(b.images.f32()[i * per] == float(expect[i]));
    CHECK(b.images.f32()[i * per + per - 1] == float(expect[i]));
  }
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

TEST_CASE("loader: every index once per epoch, in order, partial last batch") {
  CountingDataset ds(23);
  Loader loader(ds, 5, /*drop_last=*/false);
  CHECK(loader.batches_per_epoch(23) == 5);
  CHECK(loader.batches_per_epoch(0) == 0);
  CHECK(loader.pool_size() == 4);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    auto order = epoch_order(23, 11, epoch, true);
    loader.start_epoch(order, epoch);
    std::vector<int64_t> seen;
    int64_t expect_index = 0;
    while (auto b = loader.next()) {
      CHECK(b->epoch == epoch);
      CHECK(b->index == expect_index++);
      CHECK(b->images.on_host());
      CHECK(b->images.shape() == Shape{b->size(), 1, 2, 3});
      std::vector<int64_t> expect(order.begin() + b->index * 5,
                                  order.begin() + std::min<int64_t>(23, b->index * 5 + 5));
      check_batch(*b, expect, 6);
      seen.insert(seen.end(), expect.begin(), expect.end());
    }
    CHECK(expect_index == 5);
    CHECK(seen == order);
    CHECK_FALSE(bool(loader.next()));  // stays at the end
  }
}

TEST_CASE("loader: drop_last, first_batch resume, empty epochs") {
  CountingDataset ds(23);
  Loader loader(ds, 5, /*drop_last=*/true, 1);
  CHECK(loader.batches_per_epoch(23) == 4);
  CHECK(loader.batches_per_epoch(4) == 0);
  loader.start_epoch(iota(23), 0);
  int n = 0;
  while (auto b = loader.next()) {
    CHECK(b->size() == 5);
    ++n;
  }
  CHECK(n == 4);
  // Resume at batch 2: batches 2 and 3, with their own indices.
  loader.start_epoch(iota(23), 1, 2);
  auto b = loader.next();
  REQUIRE(bool(b));
  CHECK(b->index == 2);
  check_batch(*b, {10, 11, 12, 13, 14}, 6);
  b = loader.next();
  REQUIRE(bool(b));
  CHECK(b->index == 3);
  CHECK_FALSE(bool(loader.next()));
  // Resuming exactly at the end gives an empty epoch; past it is an error.
  loader.start_epoch(iota(23), 2, 4);
  CHECK_FALSE(bool(loader.next()));
  CHECK_THROWS_AS(loader.start_epoch(iota(23), 2, 5), UsageError);
  CHECK_THROWS_AS(loader.start_epoch(iota(23), 2, -1), UsageError);
  // Fewer samples than a batch with drop_last: nothing.
  loader.start_epoch({1, 2, 3}, 3);
  CHECK_FALSE(bool(loader.next()));
  // Empty index list.
  loader.start_epoch({}, 4);
  CHECK_FALSE(bool(loader.next()));
}

TEST_CASE("loader: bad arguments") {
  CountingDataset ds(10);
  CHECK_THROWS_AS(Loader(ds, 0, false), UsageError);
  CHECK_THROWS_AS(Loader(ds, -3, false), UsageError);
  CHECK_THROWS_AS(Loader(ds, 2, false, 0), UsageError);
  Loader loader(ds, 4, false);
  CHECK_THROWS_AS(loader.next(), Error);  // no epoch started
  CHECK_THROWS_AS(loader.start_epoch({0, 1, 10}, 0), UsageError);
  CHECK_THROWS_AS(loader.start_epoch({-1}, 0), UsageError);
  // A batch larger than the data set is just one partial batch.
  Loader big(ds, 64, false);
  big.start_epoch(iota(10), 0);
  auto b = big.next();
  REQUIRE(bool(b));
  CHECK(b->size() == 10);
  CHECK_FALSE(bool(big.next()));
}

TEST_CASE("loader: restart mid-epoch, including while the thread is mid-batch") {
  CountingDataset ds(100);
  ds.delay_ms = 5;
  Loader loader(ds, 4, false, 3);
  for (int round = 0; round < 20; ++round) {
    loader.start_epoch(epoch_order(100, 1, round, true), round);
    auto first = loader.next();
    REQUIRE(bool(first));
    CHECK(first->index == 0);
    // Restart after a varying pause: the thread may be idle, mid-read or have queued batches.
    std::this_thread::sleep_for(std::chrono::milliseconds(round % 7));
    auto order = epoch_order(100, 2, round, true);
    loader.start_epoch(order, 100 + round, 3);
    int64_t expect = 3;
    while (auto b = loader.next()) {
      CHECK(b->epoch == 100 + round);
      CHECK(b->index == expect);
      std::vector<int64_t> want(order.begin() + expect * 4, order.begin() + expect * 4 + 4);
      check_batch(*b, want, 6);
      ++expect;
      if (expect == 6) break;  // abandon the epoch part-way
    }
    // `first` (from the old epoch) is still intact while held across the restarts.
    std::vector<int64_t> old_order = epoch_order(100, 1, round, true);
    check_batch(*first, {old_order.begin(), old_order.begin() + 4}, 6);
  }
}

TEST_CASE("loader: buffers are reused (no allocation per batch), held batches stay intact") {
  CountingDataset ds(64, {1, 4, 4});
  Loader loader(ds, 8, false, 2);
  loader.start_epoch(iota(64), 0);
  size_t allocs = pinned_allocator().system_allocations();
  std::vector<std::shared_ptr<Batch>> held;
  held.push_back(loader.next());
  held.push_back(loader.next());  // the consumer may hold two while the thread fills the rest
  int64_t count = 2;
  while (auto b = loader.next()) {
    std::vector<int64_t> want(8);
    std::iota(want.begin(), want.end(), b->index * 8);
    check_batch(*b, want, 16);
    ++count;
  }
  CHECK(count == 8);
  check_batch(*held[0], {0, 1, 2, 3, 4, 5, 6, 7}, 16);
  check_batch(*held[1], {8, 9, 10, 11, 12, 13, 14, 15}, 16);
  CHECK(pinned_allocator().system_allocations() == allocs);
}

TEST_CASE("loader: a held batch is not overwritten; releasing it lets the loader go on") {
  CountingDataset ds(40);
  Loader loader(ds, 2, false, 1);  // pool of 3
  loader.start_epoch(iota(40), 0);
  auto a = loader.next(), b = loader.next();
  std::vector<std::shared_ptr<Batch>> rest;
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    a.reset();  // the consumer finished with batch 0 on another thread
  });
  // With two held and one prefetched, the fourth next() needs a buffer back.
  auto c = loader.next();
  auto d = loader.next();
  releaser.join();
  REQUIRE(bool(d));
  CHECK(d->index == 3);
  check_batch(*b, {2, 3}, 6);
  check_batch(*c, {4, 5}, 6);
  check_batch(*d, {6, 7}, 6);
}

TEST_CASE("loader: destruction with batches outstanding, mid-epoch, and while next() waits") {
  CountingDataset ds(50);
  std::shared_ptr<Batch> kept;
  {
    Loader loader(ds, 5, false);
    loader.start_epoch(iota(50), 0);
    kept = loader.next();
    auto other = loader.next();
    // Destroyed with two batches held and more being prepared.
  }
  REQUIRE(bool(kept));
  check_batch(*kept, {0, 1, 2, 3, 4}, 6);
  kept.reset();  // returns its buffer to a pool whose loader is gone: fine

  // Destroyed while the thread is inside a slow read.
  ds.delay_ms = 100;
  auto t0 = std::chrono::steady_clock::now();
  {
    Loader loader(ds, 5, false);
    loader.start_epoch(iota(50), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));

  // Destroyed while another thread is blocked in next(): it returns nullptr.
  {
    auto loader = std::make_unique<Loader>(ds, 5, false);
    loader->start_epoch(iota(50), 0);
    std::atomic<bool> done{false};
    std::shared_ptr<Batch> got;
    Loader* raw = loader.get();
    std::thread consumer([&got, &done, raw] {
      got = raw->next();  // first batch is 100 ms away
      done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    loader.reset();
    consumer.join();
    CHECK(done);
  }
  // Never started.
  { Loader idle(ds, 5, false); }
}

TEST_CASE("loader: exceptions in the loader thread reach next(), after the good batches") {
  CountingDataset ds(30);
  ds.fail_at = 17;  // in batch 3 (indices 15..19)
  Loader loader(ds, 5, false);
  loader.start_epoch(iota(30), 0);
  for (int i = 0; i < 3; ++i) {
    auto b = loader.next();
    REQUIRE(bool(b));
    CHECK(b->index == i);
  }
  std::string msg;
  try {
    loader.next();
  } catch (const Error& e) {
    msg = e.what();
  }
  CHECK(msg == "sample 17 is unreadable");
  CHECK_THROWS_AS(loader.next(), Error);  // the epoch stays failed
  // A new epoch avoiding the bad sample works again.
  std::vector<int64_t> good = {0, 1, 2, 3, 4, 5, 6};
  loader.start_epoch(good, 1);
  int n = 0;
  while (auto b = loader.next()) n += int(b->size());
  CHECK(n == 7);
}

TEST_CASE("loader: MNIST-sized synthetic data through the loader, many epochs") {
  auto ds = make_synthetic(1000, {1, 28, 28}, 10, 3);
  Loader loader(*ds, 64, false, 2);
  std::vector<float> ref(784);
  int32_t ref_label;
  for (int epoch = 0; epoch < 3; ++epoch) {
    auto order = epoch_order(1000, 5, epoch, true);
    loader.start_epoch(order, epoch);
    int64_t total = 0;
    while (auto b = loader.next()) {
      // Spot-check one sample per batch against a direct read.
      int64_t i = b->size() - 1;
      int64_t idx = order[size_t(b->index * 64 + i)];
      ds->read(&idx, 1, ref.data(), &ref_label);
      CHECK(std::memcmp(ref.data(), b->images.f32() + i * 784, 784 * sizeof(float)) == 0);
      CHECK(ref_label == b->labels.i32()[i]);
      total += b->size();
    }
    CHECK(total == 1000);
  }
}
