// DistributedSampler: PyTorch's formula (reimplemented here, independently, on top of a given
// order), the seed article's DistributedSampler experiment (2 ranks, batch 4), the
// union-of-ranks == one-device-batch property, and the replica-sampler program.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "engine/allocator.h"
#include "engine/data/dataset.h"
#include "engine/error.h"
#include "parallel/loop/distributed_sampler.h"

using namespace replica;

namespace {

using Indices = std::vector<int64_t>;

// torch/utils/data/distributed.py, line by line, with Python's float division and math.ceil,
// applied to an already computed `indices` (the epoch's order).
Indices torch_formula(Indices indices, int num_replicas, int rank, bool drop_last,
                      int64_t* num_samples_out = nullptr, int64_t* total_size_out = nullptr) {
  const int64_t n = static_cast<int64_t>(indices.size());
  int64_t num_samples;
  if (drop_last && n % num_replicas != 0)
    num_samples = static_cast<int64_t>(std::ceil(double(n - num_replicas) / num_replicas));
  else
    num_samples = static_cast<int64_t>(std::ceil(double(n) / num_replicas));
  const int64_t total_size = num_samples * num_replicas;
  if (!drop_last) {
    const int64_t padding_size = total_size - n;
    if (padding_size <= n) {
      indices.insert(indices.end(), indices.begin(), indices.begin() + padding_size);
    } else {
      const int64_t times = static_cast<int64_t>(std::ceil(double(padding_size) / n));
      Indices repeated;
      for (int64_t t = 0; t < times; ++t) repeated.insert(repeated.end(), indices.begin(),
                                                          indices.end());
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding_size);
    }
  } else {
    indices.resize(static_cast<size_t>(total_size));
  }
  REQUIRE(int64_t(indices.size()) == total_size);
  Indices mine;
  for (int64_t i = rank; i < total_size; i += num_replicas) mine.push_back(indices[size_t(i)]);
  REQUIRE(int64_t(mine.size()) == num_samples);
  if (num_samples_out) *num_samples_out = num_samples;
  if (total_size_out) *total_size_out = total_size;
  return mine;
}

DistributedSampler make(int64_t n, int replicas, int rank, bool drop_last = false,
                        bool shuffle = true, uint64_t seed = 0) {
  SamplerOptions o;
  o.dataset_size = n;
  o.num_replicas = replicas;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = seed;
  o.drop_last = drop_last;
  return DistributedSampler(o);
}

Indices rank_indices(int64_t n, int replicas, int rank, bool drop_last, int64_t epoch,
                     bool shuffle = true, uint64_t seed = 0) {
  DistributedSampler s = make(n, replicas, rank, drop_last, shuffle, seed);
  s.set_epoch(epoch);
  return s.indices();
}

// A DataLoader over `indices`: consecutive chunks of `batch`, the last partial unless drop_last.
std::vector<Indices> loader_batches(const Indices& indices, size_t batch, bool drop_last) {
  std::vector<Indices> out;
  for (size_t b = 0; b < indices.size(); b += batch) {
    size_t e = std::min(indices.size(), b + batch);
    if (drop_last && e - b < batch) break;
    out.emplace_back(indices.begin() + b, indices.begin() + e);
  }
  return out;
}

std::vector<size_t> batch_sizes(const std::vector<Indices>& batches) {
  std::vector<size_t> s;
  for (const auto& b : batches) s.push_back(b.size());
  return s;
}

const std::string kSampler = test::bin("replica-sampler");

}  // namespace

TEST_CASE("matches PyTorch's formula for many sizes, replica counts and flags") {
  std::vector<int64_t> sizes;
  for (int64_t n = 0; n <= 40; ++n) sizes.push_back(n);
  for (int64_t n : {63, 64, 65, 100, 1000, 1001}) sizes.push_back(n);
  for (int64_t n : sizes)
    for (int r : {1, 2, 3, 4, 5, 7, 8, 16, 64})
      for (bool drop_last : {false, true})
        for (bool shuffle : {false, true})
          for (uint64_t seed : {0ull, 7ull})
            for (int64_t epoch : {0, 3}) {
              const Indices order = epoch_order(n, seed, epoch, shuffle);
              std::multiset<int64_t> seen;
              for (int rank = 0; rank < r; ++rank) {
                CAPTURE(n); CAPTURE(r); CAPTURE(rank); CAPTURE(drop_last); CAPTURE(shuffle);
                CAPTURE(seed); CAPTURE(epoch);
                int64_t num_samples = 0, total_size = 0;
                const Indices expected =
                    torch_formula(order, r, rank, drop_last, &num_samples, &total_size);
                DistributedSampler s = make(n, r, rank, drop_last, shuffle, seed);
                s.set_epoch(epoch);
                REQUIRE(s.num_samples() == num_samples);
                REQUIRE(s.total_size() == total_size);
                REQUIRE(s.indices() == expected);
                seen.insert(expected.begin(), expected.end());
              }
              // Every sample is read (padding) or at most once (drop_last).
              if (!drop_last || n % r == 0) {
                for (int64_t i = 0; i < n; ++i) REQUIRE(seen.count(i) >= 1);
              }
              if (drop_last)
                for (int64_t i : seen) REQUIRE(seen.count(i) == 1);
            }
}

TEST_CASE("edge cases: empty data set, fewer samples than ranks, exact division") {
  for (bool drop_last : {false, true}) {
    DistributedSampler empty = make(0, 4, 3, drop_last);
    CHECK(empty.num_samples() == 0);
    CHECK(empty.total_size() == 0);
    CHECK(empty.indices().empty());
  }
  // N < R without drop_last: every rank gets one index, the order repeated cyclically.
  const Indices order = epoch_order(3, 0, 0, true);
  for (int rank = 0; rank < 8; ++rank)
    CHECK(make(3, 8, rank).indices() == Indices{order[size_t(rank % 3)]});
  // N < R with drop_last: nobody gets anything (ceil((3 - 8) / 8) = 0).
  for (int rank = 0; rank < 8; ++rank) {
    DistributedSampler s = make(3, 8, rank, true);
    CHECK(s.num_samples() == 0);
    CHECK(s.indices().empty());
  }
  // N % R == 0: drop_last changes nothing.
  for (int rank = 0; rank < 4; ++rank)
    CHECK(make(12, 4, rank, true).indices() == make(12, 4, rank, false).indices());
  // No shuffle: PyTorch's numbers exactly.
  CHECK(make(5, 2, 0, false, false).indices() == Indices{0, 2, 4});
  CHECK(make(5, 2, 1, false, false).indices() == Indices{1, 3, 0});
  CHECK(make(5, 2, 0, true, false).indices() == Indices{0, 2});
  CHECK(make(5, 2, 1, true, false).indices() == Indices{1, 3});
}

TEST_CASE("bad options are UsageErrors") {
  CHECK_THROWS_AS(make(-1, 2, 0), UsageError);
  CHECK_THROWS_AS(make(10, 0, 0), UsageError);
  CHECK_THROWS_AS(make(10, -3, 0), UsageError);
  CHECK_THROWS_AS(make(10, 2, 2), UsageError);
  CHECK_THROWS_AS(make(10, 2, -1), UsageError);
  CHECK_NOTHROW(make(0, 1, 0));
  // A size whose order no machine holds (8 bytes an index): said at once, not std::bad_alloc
  // or the OOM killer in the first epoch.
  CHECK(test::contains(test::error_of([] { make(int64_t(1) << 50, 2, 0); }),
                       "its shuffled order takes"));
  // Every rank on the machine holds its own order: one that fits alone, times 4 ranks, does
  // not (each of two ranks once found room for its own, and the OOM killer ended one).
  size_t room = 0;
  host_can_hold(size_t(1) << 30, &room);  // (it reads the room for blocks of 256 MiB or more)
  if (room == 0) {
    MESSAGE("SKIPPED: this machine does not say how much memory is available");
    return;
  }
  SamplerOptions o;
  o.dataset_size = int64_t(room / 48);  // one rank's order and share: a third of the room
  CHECK_NOTHROW(DistributedSampler{o});
  o.local_ranks = 4;
  CHECK(test::contains(test::error_of([&] { DistributedSampler{o}; }),
                       "GiB in the 4 ranks on this machine and"));
}

TEST_CASE("the seed article's experiment: 2 ranks, batch 4") {
  const int R = 2;
  const size_t B = 4;
  SUBCASE("size 8, drop_last on: 4 per rank, together a permutation") {
    Indices both;
    for (int rank = 0; rank < R; ++rank) {
      Indices mine = rank_indices(8, R, rank, true, 0);
      CHECK(mine.size() == 4);
      CHECK(batch_sizes(loader_batches(mine, B, true)) == std::vector<size_t>{4});
      both.insert(both.end(), mine.begin(), mine.end());
    }
    std::sort(both.begin(), both.end());
    CHECK(both == Indices{0, 1, 2, 3, 4, 5, 6, 7});
  }
  SUBCASE("no sampler (one replica, no shuffle): every process reads [0..3], [4..7]") {
    auto batches = loader_batches(rank_indices(8, 1, 0, true, 0, false), B, true);
    CHECK(batches == std::vector<Indices>{{0, 1, 2, 3}, {4, 5, 6, 7}});
  }
  SUBCASE("size 6, drop_last off: 3 per rank, one batch of 3; DataLoader drop_last drops it") {
    for (int rank = 0; rank < R; ++rank) {
      Indices mine = rank_indices(6, R, rank, false, 0);
      CHECK(mine.size() == 3);
      CHECK(batch_sizes(loader_batches(mine, B, false)) == std::vector<size_t>{3});
      CHECK(loader_batches(mine, B, true).empty());
    }
  }
  SUBCASE("size 5, drop_last off: padded to 6 with the first index of the shuffled order") {
    const Indices order = epoch_order(5, 0, 0, true);
    DistributedSampler s0 = make(5, R, 0), s1 = make(5, R, 1);
    CHECK(s0.total_size() == 6);
    const Indices all = s0.global_indices();
    CHECK(Indices(all.begin(), all.begin() + 5) == order);
    CHECK(all[5] == order[0]);
    CHECK(s0.indices() == Indices{order[0], order[2], order[4]});
    CHECK(s1.indices() == Indices{order[1], order[3], order[0]});
  }
  SUBCASE("size 10, drop_last off: 5 per rank, batches of 4 and 1 (4 with DataLoader drop_last)") {
    for (int rank = 0; rank < R; ++rank) {
      Indices mine = rank_indices(10, R, rank, false, 0);
      CHECK(mine.size() == 5);
      CHECK(batch_sizes(loader_batches(mine, B, false)) == std::vector<size_t>{4, 1});
      CHECK(batch_sizes(loader_batches(mine, B, true)) == std::vector<size_t>{4});
    }
    auto table = test::run(kSampler + " --size 10 --replicas 2 --batch-size 4");
    INFO(table.output);
    CHECK(table.exit_code == 0);
    CHECK(table.output.find("num_samples 5 per rank") != std::string::npos);
    CHECK(table.output.find("batch of 1") != std::string::npos);
    auto dropped = test::run(kSampler + " --size 10 --replicas 2 --batch-size 4 --loader-drop-last");
    CHECK(dropped.exit_code == 0);
    CHECK(dropped.output.find("batch of 1") == std::string::npos);
    CHECK(dropped.output.find("(dropped: ") != std::string::npos);
  }
  SUBCASE("size 10, sampler drop_last: still 5 per rank (10 % 2 == 0)") {
    for (int rank = 0; rank < R; ++rank) {
      CHECK(make(10, R, rank, true).num_samples() == 5);
      CHECK(rank_indices(10, R, rank, true, 0) == rank_indices(10, R, rank, false, 0));
    }
  }
  SUBCASE("without set_epoch the split repeats; with set_epoch it changes") {
    DistributedSampler s = make(8, R, 0, true);
    const Indices first = s.indices();
    for (int epoch = 1; epoch < 4; ++epoch) CHECK(s.indices() == first);  // set_epoch never called
    s.set_epoch(0);
    CHECK(s.indices() == first);
    std::set<Indices> splits;
    for (int64_t epoch = 0; epoch < 4; ++epoch) {
      s.set_epoch(epoch);
      splits.insert(s.indices());
    }
    CHECK(splits.size() > 1);
    s.set_epoch(1);
    CHECK(s.indices() != first);
  }
}

TEST_CASE("union over ranks of step s == step s of a one-device run (no padding involved)") {
  const size_t B = 8;
  for (int R : {2, 4})
    for (int64_t n : {64, 70, 37, 8, 3})
      for (bool drop_last : {false, true})
        for (uint64_t seed : {0ull, 5ull})
          for (int64_t epoch : {0, 1, 2}) {
            CAPTURE(R); CAPTURE(n); CAPTURE(drop_last); CAPTURE(seed); CAPTURE(epoch);
            const size_t b = B / size_t(R);
            const Indices order = epoch_order(n, seed, epoch, true);
            const auto single = loader_batches(order, B, false);
            std::vector<std::vector<Indices>> per_rank;
            for (int rank = 0; rank < R; ++rank)
              per_rank.push_back(
                  loader_batches(rank_indices(n, R, rank, drop_last, epoch, true, seed), b, false));
            const int64_t total = make(n, R, 0, drop_last).total_size();
            const int64_t covered = std::min(n, total);
            for (size_t s = 0; s < per_rank[0].size(); ++s) {
              CAPTURE(s);
              Indices together;
              for (const auto& batches : per_rank)
                together.insert(together.end(), batches[s].begin(), batches[s].end());
              std::sort(together.begin(), together.end());
              Indices one = single[s];
              std::sort(one.begin(), one.end());
              const bool full_step = int64_t((s + 1) * B) <= covered;
              const bool last_partial_exact = n % R == 0;
              if (full_step || last_partial_exact) {
                CHECK(together == one);
              } else if (!drop_last) {
                // The padded last step: some of its samples are repeats of the order's start.
                CHECK(together != one);
              }
            }
          }
}

TEST_CASE("replica-sampler --json equals indices()") {
  struct Case {
    int64_t n;
    int r;
    int64_t epoch;
    uint64_t seed;
    bool drop_last, shuffle;
  };
  for (const Case& c : {Case{5, 2, 0, 0, false, true}, Case{10, 3, 2, 9, false, true},
                        Case{3, 4, 0, 0, true, true}, Case{3, 4, 1, 1, false, true},
                        Case{0, 2, 0, 0, false, true}, Case{7, 3, 0, 0, false, false},
                        Case{23, 5, 4, 42, true, true}, Case{12, 12, 1, 3, false, true}}) {
    std::string cmd = kSampler + " --json --size " + std::to_string(c.n) + " --replicas " +
                      std::to_string(c.r) + " --epoch " + std::to_string(c.epoch) + " --seed " +
                      std::to_string(c.seed) + (c.drop_last ? " --drop-last" : "") +
                      (c.shuffle ? "" : " --no-shuffle");
    auto out = test::run(cmd);
    INFO(cmd << "\n" << out.output);
    REQUIRE(out.exit_code == 0);
    CHECK(test::count_lines(out.output) == 1);
    CHECK(out.output.rfind("{\"0\": [", 0) == 0);
    nlohmann::json j = nlohmann::json::parse(out.output);
    REQUIRE(j.is_object());
    CHECK(j.size() == size_t(c.r));
    for (int rank = 0; rank < c.r; ++rank) {
      Indices expected = rank_indices(c.n, c.r, rank, c.drop_last, c.epoch, c.shuffle, c.seed);
      CHECK(j.at(std::to_string(rank)).get<Indices>() == expected);
    }
  }
}

TEST_CASE("replica-sampler: help, and bad input is one line with exit code 2") {
  auto help = test::run(kSampler + " --help");
  CHECK(help.exit_code == 0);
  CHECK(help.output.find("--loader-drop-last") != std::string::npos);
  for (const std::string args :
       {"--size 8 --replicas 0", "--size -1 --replicas 2", "--size 8 --replicas 2 --no-such-flag",
        "--replicas 2", "--size 8", "--size 8 --replicas 2 --batch-size 0",
        "--size 8 --replicas 2 --epoch -1", "--size 8 --replicas 2 --loader-drop-last",
        "--size eight --replicas 2", "--size 8 --replicas 2 --json --batch-size 4",
        "--size 1000000000000 --replicas 2", "--size 8 --replicas 2 --seed -1"}) {
    auto r = test::run(kSampler + " " + args);
    INFO("args: " << args << "\noutput: " << r.output);
    CHECK(r.exit_code == 2);
    CHECK(test::count_lines(r.output) == 1);
    CHECK(r.output.rfind("replica-sampler: error: ", 0) == 0);
  }
  // Output that cannot be written (a full disk, a closed stdout) is an error, not exit 0.
  for (const char* redirect : {" > /dev/full", " >&-"}) {
    if (std::string(redirect) == " > /dev/full" && !test::fs::exists("/dev/full")) continue;
    auto r = test::run("sh -c '" + kSampler + " --size 8 --replicas 2 --json" + redirect + "'");
    INFO("redirect: " << redirect << "\noutput: " << r.output);
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("replica-sampler: error: cannot write the output to standard output") !=
          std::string::npos);
  }
}
