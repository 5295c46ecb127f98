// The shared-memory all-reduce of ranks on one machine (parallel/comm/shm_allreduce.h): every
// value right over several rounds and uneven shares, on 2 to 4 ranks; Gloo's TCP kept where it
// is turned off or the ranks' addresses differ; a rank that exits, or stops, named.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "engine/context.h"
#include "env_guard.h"
#include "parallel/comm/process_group.h"
#include "parallel/comm/shm_allreduce.h"
#include "parallel/rendezvous/store.h"

using namespace replica;

namespace {

std::shared_ptr<Store> client(const TcpStoreServer& server) {
  return std::make_shared<TcpStoreClient>("127.0.0.1", server.port(), std::chrono::seconds(30));
}

// `ranks` Gloo groups, one thread each, rank r at address `address(r)`: each all-reduces a
// tensor of `numel` floats twice as one bucket (rank r holds r + i at i) and once as a one-off
// tensor. Returns the wrong values per rank (-1: the rank failed) and rank 0's describe().
struct Outcome {
  std::vector<int64_t> wrong;
  std::string described;
};
template <class Address>
Outcome sum_on_ranks(int ranks, int64_t numel, Address address) {
  TcpStoreServer server("127.0.0.1", 0);
  Outcome out{std::vector<int64_t>(size_t(ranks), -1), ""};
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        DeviceContext ctx(Device{DeviceType::CPU, r, 0});
        GroupOptions o{CommBackend::Gloo, r, ranks, client(server), address(r),
                       std::chrono::milliseconds(30000)};
        auto pg = make_process_group(o, ctx);
        if (r == 0) out.described = pg->describe();
        Tensor bucket = ctx.alloc({numel}), once = ctx.alloc({numel});
        for (int64_t i = 0; i < numel; ++i) bucket.f32()[i] = once.f32()[i] = float(r + i % 1000);
        pg->allreduce_sum(ctx, bucket, /*slot=*/0);
        pg->allreduce_sum(ctx, bucket, /*slot=*/0);
        pg->allreduce_sum(ctx, once);
        const float base = float(ranks * (ranks - 1) / 2);
        int64_t bad = 0;
        for (int64_t i = 0; i < numel; ++i) {
          const float once_sum = float(ranks) * float(i % 1000) + base;
          bad += once.f32()[i] != once_sum;
          bad += bucket.f32()[i] != float(ranks) * once_sum;
        }
        pg->barrier();
        out.wrong[size_t(r)] = bad;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  return out;
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
      for (int64_t w : o.wrong) CHECK(w == 0);
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
    for (int64_t w : o.wrong) CHECK(w == 0);
  }
  SUBCASE("ranks at other addresses (as nodes in network namespaces of one machine)") {
    test::EnvGuard env({"REPLICA_SHM_ALLREDUCE"});
    const Outcome o = sum_on_ranks(2, 4097, [](int r) { return r ? "127.0.0.2" : "127.0.0.1"; });
    CHECK(o.described == "gloo");
    for (int64_t w : o.wrong) CHECK(w == 0);
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
