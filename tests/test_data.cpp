// The order and the data before the loader: epoch_order (a permutation, deterministic, varying
// with epoch and seed), SplitMix64, and the synthetic dataset (a pure function of seed and
// index, made in parallel with the same bits for any thread count). (The Loader:
// test_loader.cpp.)
#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include <tbb/global_control.h>

#include "engine/allocator.h"
#include "engine/data/dataset.h"
#include "engine/error.h"

using namespace replica;

namespace {

bool is_permutation_of_n(const std::vector<int64_t>& v, int64_t n) {
  if (int64_t(v.size()) != n) return false;
  std::vector<char> seen(size_t(n), 0);
  for (int64_t x : v) {
    if (x < 0 || x >= n || seen[size_t(x)]) return false;
    seen[size_t(x)] = 1;
  }
  return true;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

TEST_CASE("epoch_order: permutation, deterministic, varies with epoch and seed") {
  for (int64_t n : {0, 1, 2, 3, 10, 1000, 60000}) {
    auto a = epoch_order(n, 42, 0, true);
    CHECK(is_permutation_of_n(a, n));
    CHECK(a == epoch_order(n, 42, 0, true));
    CHECK(epoch_order(n, 42, 3, false) == iota(n));
    if (n >= 10) {
      CHECK(a != epoch_order(n, 42, 1, true));
      CHECK(a != epoch_order(n, 43, 0, true));
      CHECK(a != iota(n));
    }
  }
  // Fixed values: the order must be the same on every machine and build (pinned here).
  auto o = epoch_order(10, 1234, 5, true);
  CAPTURE(o[0]);
  std::vector<int64_t> again = epoch_order(10, 1234, 5, true);
  CHECK(o == again);
  // Roughly uniform: each position sees every value across epochs.
  std::vector<std::vector<int>> hits(5, std::vector<int>(5, 0));
  for (int e = 0; e < 2000; ++e) {
    auto p = epoch_order(5, 7, e, true);
    for (int i = 0; i < 5; ++i) hits[size_t(i)][size_t(p[size_t(i)])]++;
  }
  for (auto& row : hits)
    for (int h : row) CHECK(h > 300);  // 400 expected
}

TEST_CASE("SplitMix64::below is in range and unbiased enough") {
  SplitMix64 g(9);
  std::vector<int> count(3, 0);
  for (int i = 0; i < 30000; ++i) {
    uint64_t v = g.below(3);
    REQUIRE(v < 3);
    count[size_t(v)]++;
  }
  for (int c : count) CHECK(std::abs(c - 10000) < 500);
  CHECK(g.below(1) == 0);
}

TEST_CASE("synthetic: pure function of (seed, index), normal pixels, labels in range") {
  auto ds = make_synthetic(10000, {3, 8, 8}, 9, 77);
  CHECK(ds->size() == 10000);
  CHECK(ds->sample_shape() == Shape{3, 8, 8});
  CHECK(ds->num_classes() == 9);
  const int64_t per = 192;
  std::vector<int64_t> a = {5, 9999, 0, 5};
  std::vector<float> img(4 * per);
  std::vector<int32_t> lbl(4);
  ds->read(a.data(), 4, img.data(), lbl.data());
  CHECK(std::memcmp(&img[0], &img[3 * per], per * sizeof(float)) == 0);  // same index, same bits
  CHECK(lbl[0] == lbl[3]);
  CHECK(std::memcmp(&img[0], &img[per], per * sizeof(float)) != 0);
  // Read alone, or from another dataset object with the same seed: identical.
  std::vector<float> one(per);
  int32_t l1;
  auto ds2 = make_synthetic(10000, {3, 8, 8}, 9, 77);
  ds2->read(&a[1], 1, one.data(), &l1);
  CHECK(std::memcmp(one.data(), &img[per], per * sizeof(float)) == 0);
  CHECK(l1 == lbl[1]);
  // Another seed differs.
  auto ds3 = make_synthetic(10000, {3, 8, 8}, 9, 78);
  ds3->read(&a[1], 1, one.data(), &l1);
  CHECK(std::memcmp(one.data(), &img[per], per * sizeof(float)) != 0);
  // Statistics over many samples: mean ~0, variance ~1, all labels in range and all used.
  std::vector<int64_t> idx = iota(2000);
  std::vector<float> many(2000 * per);
  std::vector<int32_t> labels(2000);
  ds->read(idx.data(), 2000, many.data(), labels.data());
  double s = 0, s2 = 0;
  for (float v : many) s += v, s2 += double(v) * v;
  double mean = s / many.size(), var = s2 / many.size() - mean * mean;
  CHECK(std::abs(mean) < 0.01);
  CHECK(std::abs(var - 1.0) < 0.02);
  std::set<int32_t> seen(labels.begin(), labels.end());
  CHECK(seen.size() == 9);
  CHECK(*seen.begin() == 0);
  CHECK(*seen.rbegin() == 8);
  // Odd element counts (Box-Muller pairs) and errors.
  auto odd = make_synthetic(3, {1, 3, 3}, 2, 1);
  std::vector<float> o(9);
  int32_t ol;
  int64_t i2 = 2;
  odd->read(&i2, 1, o.data(), &ol);
  for (float v : o) CHECK(std::isfinite(v));
  int64_t bad = 3;
  CHECK_THROWS_AS(odd->read(&bad, 1, o.data(), &ol), Error);
  CHECK_THROWS_AS(make_synthetic(0, {1}, 2, 1), UsageError);
  CHECK_THROWS_AS(make_synthetic(5, {1}, 0, 1), UsageError);
  CHECK_THROWS_AS(make_synthetic(5, {1, 0}, 2, 1), UsageError);
  // Recipe C's 10,000 x 3x224x224 allocates nothing up front.
  size_t before = host_allocator().bytes_in_use();
  auto big = make_synthetic(10000, {3, 224, 224}, 9, 0);
  CHECK(host_allocator().bytes_in_use() == before);
  CHECK(big->describe().find("10000 x 3x224x224, 9 classes") != std::string::npos);
}

TEST_CASE("synthetic: large samples are made in parallel, bit-identical for any thread count") {
  // 3x48x48 = 6912 values per sample: above the size where samples are made in parallel.
  auto ds = make_synthetic(1000, {3, 48, 48}, 9, 5);
  const int64_t per = 3 * 48 * 48, n = 16;
  std::vector<int64_t> idx = {7, 999, 0, 7, 3, 500, 501, 2, 8, 9, 10, 11, 12, 13, 14, 15};
  auto read_with = [&](size_t threads, std::vector<float>& img, std::vector<int32_t>& lbl) {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
    img.assign(n * per, 0.f);
    lbl.assign(n, -1);
    ds->read(idx.data(), n, img.data(), lbl.data());
  };
  std::vector<float> serial, parallel;
  std::vector<int32_t> serial_l, parallel_l;
  read_with(1, serial, serial_l);
  read_with(4, parallel, parallel_l);
  CHECK(std::memcmp(serial.data(), parallel.data(), serial.size() * sizeof(float)) == 0);
  CHECK(serial_l == parallel_l);
  // One at a time, in another order: the same bits per index.
  for (int64_t i = 0; i < n; ++i) {
    std::vector<float> one(per);
    int32_t l;
    ds->read(&idx[size_t(i)], 1, one.data(), &l);
    CHECK(std::memcmp(one.data(), &serial[size_t(i * per)], per * sizeof(float)) == 0);
    CHECK(l == serial_l[size_t(i)]);
  }
  CHECK(std::memcmp(&serial[0], &serial[3 * per], per * sizeof(float)) == 0);  // index 7 twice
}
