// The shared-memory all-reduce of ranks on one machine (parallel/comm/shm_allreduce.h): every
// value right over several rounds and uneven shares, on 2 to 4 ranks; Gloo's TCP kept where it
// is turned off or the ranks' addresses differ; a rank that exits, or stops, named.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "engine/context.h"
#include "env_guard.h"
#include "parallel/comm/process_group.h"
#include "parallel/comm/shm_allreduce.h"
#include "parallel/rendezvous/store.h"
#include "thread_ranks.h"

using namespace replica;

namespace {

std::shared_ptr<Store> client(const TcpStoreServer& server) {
  return std::make_shared<TcpStoreClient>("127.0.0.1", server.port(), std::chrono::seconds(30));
}

// `ranks` Gloo groups, one thread each, rank r at address `address(r)`: each all-reduces a
// tensor of `numel` floats twice as one bucket and once as a one-off tensor. Rank r holds
// 0.1 r + 0.001 (i mod 1000) at i: fractions, so that the order of the sum shows in the bits.
struct Outcome {
  std::vector<std::vector<float>> bucket, once;  // each rank's results (empty: it failed)
  std::string described;                         // rank 0's group
};
template <class Address>
Outcome sum_on_ranks(int ranks, int64_t numel, Address address) {
  TcpStoreServer server("127.0.0.1", 0);
  Outcome out{std::vector<std::vector<float>>(size_t(ranks)),
              std::vector<std::vector<float>>(size_t(ranks)), ""};
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        DeviceContext ctx(Device{DeviceType::CPU, r, 0});
        std::shared_ptr<Store> store = client(server);
        GroupOptions o{CommBackend::Gloo, r, ranks, store, address(r),
                       std::chrono::milliseconds(30000)};
        auto pg = make_process_group(o, ctx);
        if (r == 0) out.described = pg->describe();
        Tensor bucket = ctx.alloc({numel}), once = ctx.alloc({numel});
        for (int64_t i = 0; i < numel; ++i)
          bucket.f32()[i] = once.f32()[i] = 0.1f * float(r) + 0.001f * float(i % 1000);
        pg->allreduce_sum(ctx, bucket, /*slot=*/0);
        pg->allreduce_sum(ctx, bucket, /*slot=*/0);
        pg->allreduce_sum(ctx, once);
        test::finish_together(*store, ranks);
        out.bucket[size_t(r)].assign(bucket.f32(), bucket.f32() + numel);
        out.once[size_t(r)].assign(once.f32(), once.f32() + numel);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

// Every rank the same bits, close to the sum; with `rank_order`, exactly the float sum in rank
// order (the shared-memory all-reduce's promise).
void check_sums(const Outcome& o, int ranks, int64_t numel, bool rank_order) {
  for (int r = 0; r < ranks; ++r) {
    REQUIRE(o.once[size_t(r)].size() == size_t(numel));
    CHECK(o.once[size_t(r)] == o.once[0]);
    CHECK(o.bucket[size_t(r)] == o.bucket[0]);
  }
  int64_t off = 0, not_in_order = 0;
  for (int64_t i = 0; i < numel; ++i) {
    float in_order = 0.f;
    double exact = 0.0;
    for (int q = 0; q < ranks; ++q) {
      const float v = 0.1f * float(q) + 0.001f * float(i % 1000);
      in_order = q ? in_order + v : v;
      exact += v;
    }
    float twice = in_order;
    for (int q = 1; q < ranks; ++q) twice += in_order;
    off += std::abs(o.once[0][size_t(i)] - exact) > 1e-5 * (1 + std::abs(exact));
    not_in_order += o.once[0][size_t(i)] != in_order || o.bucket[0][size_t(i)] != twice;
  }
  CHECK(off == 0);
  if (rank_order) CHECK(not_in_order == 0);
}

// This process's segment names left in /dev/shm (none once the groups are set up).
int names_left() {
  const std::string prefix = fmt::format("replica-allreduce-{}-", getpid());
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    n += e.path().filename().string().rfind(prefix, 0) == 0;
  return n;
}

std::string loopback(int) { return "127.0.0.1"; }

}  // namespace

TEST_CASE("shared-memory all-reduce: every value right over rounds and uneven shares") {
  if (!gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  test::EnvGuard env({"REPLICA_SHM_ALLREDUCE"});
  // 2.5 areas: three rounds, the last short; 3 and 5 floats: ranks with one value or none.
  for (int64_t numel : {ShmAllreduce::kAreaFloats * 5 / 2 + 3, int64_t(5), int64_t(3)})
    for (int ranks : {2, 3, 4}) {
      CAPTURE(numel);
      CAPTURE(ranks);
      const Outcome o = sum_on_ranks(ranks, numel, loopback);
      CHECK(o.described.find("shared memory") != std::string::npos);
      check_sums(o, ranks, numel, /*rank_order=*/true);
      CHECK(names_left() == 0);
    }
}

TEST_CASE("Gloo's TCP all-reduce where shared memory is off or the ranks' addresses differ") {
  if (!gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  SUBCASE("REPLICA_SHM_ALLREDUCE=0") {
    test::ScopedEnv off("REPLICA_SHM_ALLREDUCE", "0");
    const Outcome o = sum_on_ranks(3, 4097, loopback);
    CHECK(o.described == "gloo");
    check_sums(o, 3, 4097, /*rank_order=*/false);
  }
  SUBCASE("ranks at other addresses (as nodes in network namespaces of one machine)") {
    test::EnvGuard env({"REPLICA_SHM_ALLREDUCE"});
    const Outcome o = sum_on_ranks(2, 4097, [](int r) { return r ? "127.0.0.2" : "127.0.0.1"; });
    CHECK(o.described == "gloo");
    check_sums(o, 2, 4097, /*rank_order=*/false);
  }
}

TEST_CASE("shared-memory all-reduce: a rank that exits is named at once, one that stops after "
          "the timeout") {
  test::EnvGuard env({"REPLICA_SHM_ALLREDUCE"});
  SUBCASE("exits") {
    TcpStoreServer server("127.0.0.1", 0);
    const pid_t child = fork();
    if (child == 0) {  // rank 1: joins, then leaves without entering the sum
      try {
        auto store = client(server);
        auto shm = ShmAllreduce::connect(*store, 1, 2, "127.0.0.1", std::chrono::seconds(30));
      } catch (...) {
      }
      _exit(0);
    }
    auto store = client(server);
    auto shm = ShmAllreduce::connect(*store, 0, 2, "127.0.0.1", std::chrono::seconds(30));
    REQUIRE(shm);
    std::vector<float> v(100, 1.f);
    const auto start = std::chrono::steady_clock::now();
    const std::string expected = fmt::format("rank 1 (pid {}) exited", child);
    CHECK_THROWS_WITH_AS(shm->sum(v.data(), 100), doctest::Contains(expected.c_str()), Error);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
    waitpid(child, nullptr, 0);
  }
  SUBCASE("stops") {
    TcpStoreServer server("127.0.0.1", 0);
    std::unique_ptr<ShmAllreduce> peer;
    std::thread rank1([&] {  // joins, then never enters the sum
      auto store = client(server);
      peer = ShmAllreduce::connect(*store, 1, 2, "127.0.0.1", std::chrono::seconds(1));
    });
    auto store = client(server);
    auto shm = ShmAllreduce::connect(*store, 0, 2, "127.0.0.1", std::chrono::seconds(1));
    rank1.join();
    REQUIRE(shm);
    std::vector<float> v(100, 1.f);
    CHECK_THROWS_WITH_AS(shm->sum(v.data(), 100), doctest::Contains("waited 1 s for rank 1"),
                         Error);
  }
}

TEST_CASE("shared-memory all-reduce: ranks whose calls differ in length both fail, and stay failed") {
  test::EnvGuard env({"REPLICA_SHM_ALLREDUCE"});
  TcpStoreServer server("127.0.0.1", 0);
  std::string error1;
  std::thread rank1([&] {
    auto store = client(server);
    auto shm = ShmAllreduce::connect(*store, 1, 2, "127.0.0.1", std::chrono::seconds(10));
    std::vector<float> v(12, 1.f);
    try {
      shm->sum(v.data(), 12);
    } catch (const Error& e) {
      error1 = e.what();
    }
  });
  auto store = client(server);
  auto shm = ShmAllreduce::connect(*store, 0, 2, "127.0.0.1", std::chrono::seconds(10));
  REQUIRE(shm);
  std::vector<float> v(10, 1.f);
  CHECK_THROWS_WITH_AS(shm->sum(v.data(), 10),
                       "rank 1 all-reduces 12 values where this rank has 10: the ranks' calls "
                       "differ",
                       Error);
  rank1.join();
  CHECK(error1 == "rank 0 all-reduces 10 values where this rank has 12: the ranks' calls differ");
  CHECK_THROWS_WITH_AS(shm->sum(v.data(), 10), "an earlier shared-memory all-reduce failed",
                       Error);
}
