// Rendezvous: the rank environment of torchrun, OpenMPI and Slurm, env:// with 1, 2 and 4
// ranks as processes (IPv6 too, and one with a rank missing), file:// and tcp:// with explicit
// ranks, the address a rank offers its peers, and the NCCL ranks' agreement on where their
// GPUs are.
#include <atomic>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "env_guard.h"
#include "process_helpers.h"
#include "engine/error.h"
#include "parallel/comm/nccl_placement.h"
#include "parallel/rendezvous/rendezvous.h"

using namespace replica;
using namespace test;

namespace {

void set_rank_env(int rank, int world, int port, const char* master_addr = "127.0.0.1") {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("MASTER_ADDR", master_addr, 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

const std::vector<std::string> kRankVars = {"RANK",
                                            "WORLD_SIZE",
                                            "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE",
                                            "MASTER_ADDR",
                                            "MASTER_PORT",
                                            "OMPI_COMM_WORLD_RANK",
                                            "OMPI_COMM_WORLD_SIZE",
                                            "OMPI_COMM_WORLD_LOCAL_RANK",
                                            "OMPI_COMM_WORLD_LOCAL_SIZE",
                                            "SLURM_PROCID",
                                            "SLURM_NTASKS",
                                            "SLURM_LOCALID",
                                            "SLURM_TASKS_PER_NODE",
                                            "SLURM_NODEID",
                                            "SLURM_NNODES"};

}  // namespace

TEST_CASE("rank environment: torchrun, OpenMPI and Slurm variables") {
  test::EnvGuard guard(kRankVars);
  Rendezvous r = rendezvous_env_ranks();
  CHECK((r.rank == 0 && r.world_size == 1 && r.local_rank == 0 && r.local_world_size == 1));
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  r = rendezvous_env_ranks();
  CHECK((r.rank == 3 && r.world_size == 4 && r.local_rank == 1 && r.local_world_size == 2));
  setenv("RANK", "5", 1);  // torchrun's names win
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  r = rendezvous_env_ranks();
  CHECK((r.rank == 5 && r.world_size == 8 && r.local_rank == 1 && r.local_world_size == 4));
  // Half a launcher's names: an error, not a job of one (the real rank 0 would wait for it).
  unsetenv("RANK");
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }),
                 "WORLD_SIZE is set but RANK is not: set both"));
  setenv("RANK", "5", 1);
  unsetenv("WORLD_SIZE");
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }),
                 "RANK is set but WORLD_SIZE is not: set both"));
  for (const char* n : {"RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"})
    unsetenv(n);
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }),
                 "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not"));
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "6", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NODEID", "1", 1);
  setenv("SLURM_TASKS_PER_NODE", "4,2", 1);
  r = rendezvous_env_ranks();
  CHECK((r.rank == 5 && r.world_size == 6 && r.local_rank == 1 && r.local_world_size == 2));
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "2", 1);
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }), "rank 2 is not below the world size 2"));
  setenv("RANK", "x", 1);
  CHECK_THROWS_AS(rendezvous_env_ranks(), UsageError);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2147483648", 1);
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }), "WORLD_SIZE='2147483648' is too large"));
  setenv("WORLD_SIZE", "100000", 1);
  CHECK(contains(error_of([] { rendezvous_env_ranks(); }),
                 "world size 100000 is more than the 65536 ranks a job can have"));
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "0", 1);
  RendezvousOptions o;
  o.init_method = "nccl://x";
  CHECK(contains(error_of([&] { rendezvous(o); }), "unknown init method 'nccl://x'"));
  o.init_method = "env://";
  CHECK(contains(error_of([&] { rendezvous(o); }), "needs MASTER_ADDR and MASTER_PORT"));
}

TEST_CASE("rendezvous env:// with 1, 2 and 4 ranks as processes") {
  test::EnvGuard guard(kRankVars);
  {
    Rendezvous single = rendezvous();  // no launcher: one process, a store on any free port
    CHECK((single.rank == 0 && single.world_size == 1 && single.store));
    CHECK(single.address == "127.0.0.1");
    single.store->set("x", to_bytes("1"));
  }
  for (int world : {2, 4}) {
    CAPTURE(world);
    int port = free_port();
    std::vector<pid_t> kids;
    for (int rank = world - 1; rank >= 0; --rank)  // rank 0 last: clients wait for the server
      kids.push_back(fork_child([=] {
        set_rank_env(rank, world, port);
        RendezvousOptions o;
        o.timeout = 20s;
        Rendezvous r = rendezvous(o);
        if (r.rank != rank || r.world_size != world || r.local_rank != rank ||
            r.local_world_size != world)
          return 2;
        r.store->set("hello/" + std::to_string(rank), to_bytes(std::to_string(rank)));
        std::vector<std::string> all;
        for (int i = 0; i < world; ++i) all.push_back("hello/" + std::to_string(i));
        r.store->wait(all);
        // Rank 0 hosts the store: it leaves only after every rank is done with it.
        if (r.store->add("bye", 1) == world) r.store->set("all-bye", {});
        if (rank == 0) r.store->wait({"all-bye"});
        return 0;
      }));
    for (pid_t k : kids) CHECK(wait_child(k) == 0);
  }
}

TEST_CASE("rendezvous env:// at a bracketed IPv6 MASTER_ADDR, as URLs write it") {
  if (local_address_toward("::1").empty()) {
    MESSAGE("skipped: this machine has no IPv6 loopback");
    return;
  }
  test::EnvGuard guard(kRankVars);
  const int port = free_port();
  std::vector<pid_t> kids;
  for (int rank : {1, 0})
    kids.push_back(fork_child([=] {
      set_rank_env(rank, 2, port, "[::1]");
      RendezvousOptions o;
      o.timeout = 20s;
      Rendezvous r = rendezvous(o);
      if (r.address != "::1") return 2;  // what peers are told: the address, no brackets
      if (r.store->add("bye", 1) == 2) r.store->set("all-bye", {});
      if (rank == 0) r.store->wait({"all-bye"});
      return 0;
    }));
  for (pid_t k : kids) CHECK(wait_child(k) == 0);
}

TEST_CASE("the address a rank offers its peers: its own end of the route to rank 0's node") {
  CHECK(local_address_toward("127.0.0.1") == "127.0.0.1");
  const std::string local = local_address_toward("localhost");
  CHECK_MESSAGE((local.rfind("127.", 0) == 0 || local == "::1"), local);
  CHECK(local_address_toward("no-such-host.invalid").empty());
  // Two nodes in network namespaces: tests/test_multinode.cpp.
}

namespace {

// Ranks as threads, each with its own handle on one file store, as processes would have.
std::vector<NcclPlacement> place(const std::string& dir, const std::string& prefix,
                                 const std::vector<std::string>& buses,
                                 const std::vector<std::string>& addresses) {
  const int size = int(buses.size());
  std::vector<NcclPlacement> out(size_t(size), NcclPlacement{});
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r)
    ranks.emplace_back([&, r] {
      FileStore store(dir, 5s);
      out[size_t(r)] = agree_on_placement(store, prefix, r, size, buses[size_t(r)],
                                          addresses[size_t(r)]);
    });
  for (auto& t : ranks) t.join();
  return out;
}

}  // namespace

TEST_CASE("NCCL placement: ranks on one GPU get a host id each; loopback sockets only when every "
          "rank is on loopback") {
  test::TempDir tmp;
  const std::string dir = tmp.str("store");
  const std::string a = "0000:19:00.0", b = "0000:3b:00.0";
  SUBCASE("three ranks on one GPU, one node") {
    auto p = place(dir, "one/", {a, a, a}, {"127.0.0.1", "127.0.0.1", "127.0.0.1"});
    std::set<std::string> ids;
    for (const auto& q : p) {
      CHECK(q.gpus == 1);
      CHECK(q.shared_gpu);
      CHECK(q.loopback_sockets);
      ids.insert(q.host_id);
    }
    CHECK(ids.size() == 3);
    CHECK(p[2].host_id.find("rank2") != std::string::npos);
  }
  SUBCASE("a GPU per rank: NCCL is told nothing") {
    auto p = place(dir, "two/", {a, b}, {"127.0.0.1", "127.0.0.1"});
    for (const auto& q : p) {
      CHECK(q.gpus == 2);
      CHECK_FALSE(q.shared_gpu);
      CHECK(q.host_id.empty());
    }
  }
  SUBCASE("two ranks on one GPU, one of them alone on another: every rank takes a host id") {
    auto p = place(dir, "three/", {a, a, b}, {"127.0.0.1", "127.0.0.1", "127.0.0.1"});
    for (const auto& q : p) {
      CHECK(q.gpus == 2);
      CHECK(q.shared_gpu);
      CHECK_FALSE(q.host_id.empty());
    }
  }
  SUBCASE("one GPU, ranks in two network namespaces: sockets not on lo") {
    auto p = place(dir, "netns/", {a, a}, {"10.213.0.1", "10.213.0.2"});
    for (const auto& q : p) {
      CHECK(q.shared_gpu);
      CHECK_FALSE(q.loopback_sockets);
    }
  }
}

TEST_CASE("NCCL placement: what NCCL is told, the user's interface kept") {
  test::EnvGuard guard({"NCCL_HOSTID", "NCCL_NET", "NCCL_SOCKET_IFNAME"});
  auto value = [](const char* n) {
    const char* v = std::getenv(n);
    return std::string(v ? v : "-");
  };
  NcclPlacement alone;  // a GPU per rank
  tell_nccl(alone);
  CHECK(value("NCCL_HOSTID") == "-");
  CHECK(value("NCCL_NET") == "-");
  NcclPlacement shared{1, true, "replica-h-rank1", true};
  tell_nccl(shared);
  CHECK(value("NCCL_HOSTID") == "replica-h-rank1");
  CHECK(value("NCCL_NET") == "Socket");
  CHECK(value("NCCL_SOCKET_IFNAME") == "lo");
  setenv("NCCL_SOCKET_IFNAME", "eth1", 1);
  tell_nccl(shared);
  CHECK(value("NCCL_SOCKET_IFNAME") == "eth1");
}

TEST_CASE("rendezvous with a missing rank times out naming it") {
  test::TempDir tmp;
  std::string dir = tmp.str();
  int port = free_port();
  std::vector<pid_t> kids;
  auto t0 = Clock::now();
  for (int rank : {0, 1})  // of 3: rank 2 never starts
    kids.push_back(fork_child([=] {
      set_rank_env(rank, 3, port);
      RendezvousOptions o;
      o.timeout = 2s;
      std::string e = error_of([&] { rendezvous(o); });
      std::ofstream(dir + "/error" + std::to_string(rank)) << e;
      // Rank 0 times out first and takes the store down: rank 1 hears which key was missing.
      return contains(e, "missing rank 2 ") || contains(e, "not set: 'rank/2'") ? 3 : 4;
    }));
  for (pid_t k : kids) CHECK(wait_child(k) == 3);
  CHECK(seconds_since(t0) < 2 + 5);
  INFO(read_text(dir + "/error1"));
  std::string message = read_text(dir + "/error0");
  CHECK_MESSAGE(contains(message,
                         "rendezvous timed out after 2.0 s: 2 of 3 ranks joined, "
                         "missing rank 2 (store 127.0.0.1:" +
                             std::to_string(port) + ")"),
                message);
}

TEST_CASE("rendezvous file:// and tcp:// with explicit ranks; a rank joining twice is an error") {
  test::EnvGuard guard(kRankVars);
  test::TempDir tmp;
  int port = free_port();
  for (std::string method :
       {"file://" + tmp.str("rdzv"), "tcp://127.0.0.1:" + std::to_string(port)}) {
    CAPTURE(method);
    std::vector<std::thread> ranks;
    std::atomic<int> ok{0};
    for (int rank = 0; rank < 3; ++rank)
      ranks.emplace_back([&, rank] {
        RendezvousOptions o;
        o.init_method = method;
        o.rank = rank;
        o.world_size = 3;
        o.timeout = 10s;
        Rendezvous r = rendezvous(o);
        r.store->set("t/" + std::to_string(rank), {});
        r.store->wait({"t/0", "t/1", "t/2"});
        if (r.store->add("t/bye", 1) == 3) r.store->set("t/all-bye", {});
        if (rank == 0) r.store->wait({"t/all-bye"});
        ok += r.rank == rank && r.world_size == 3;
      });
    for (auto& t : ranks) t.join();
    CHECK(ok == 3);
  }
  // The same file:// directory again: rank 0 is already there.
  RendezvousOptions o;
  o.init_method = "file://" + tmp.str("rdzv");
  o.rank = 0;
  o.world_size = 3;
  o.timeout = 1s;
  std::string e = error_of([&] { rendezvous(o); });
  CHECK_MESSAGE(contains(e, "rank 0 joined the rendezvous twice"), e);
  CHECK(contains(e, "earlier run"));
}
