// Stores and rendezvous: TCP and file stores across threads and forked processes, timeouts that
// name their keys, size limits, a busy port, clients that start before the server, env://
// rendezvous with 2-4 ranks as processes (and one with a rank missing), and the NCCL ranks'
// agreement on where their GPUs are.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <thread>

#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "env_guard.h"
#include "engine/error.h"
#include "parallel/comm/nccl_placement.h"
#include "parallel/rendezvous/rendezvous.h"

using namespace replica;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A port nothing listens on right now (bind 0, read it back, release it).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Runs body in a forked child; exit code 0 on success, 100 (message on stderr) on an exception.
pid_t fork_child(const std::function<int()>& body) {
  std::fflush(nullptr);  // or the child prints the parent's buffered output again
  pid_t pid = fork();
  if (pid == 0) {
    int code = 100;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", getpid(), e.what());
    }
    std::fflush(nullptr);
    _exit(code);
  }
  return pid;
}

// Exit code of a child, killing it after `limit` (then -9).
int wait_child(pid_t pid, std::chrono::seconds limit = 60s) {
  auto deadline = Clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -9;
    }
    std::this_thread::sleep_for(10ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) { return e.what(); }
  return "";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

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

// The same store semantics for both kinds.
void exercise_basics(Store& s) {
  s.set("a", to_bytes("hello"));
  CHECK(to_string(s.get("a")) == "hello");
  s.set("a", to_bytes("again"));
  CHECK(to_string(s.get("a")) == "again");
  s.set("empty", {});
  CHECK(s.get("empty").empty());
  Bytes binary = {'\0', 'x', '\xff', '\0'};
  s.set("dir/with spaces/key", binary);
  CHECK(s.get("dir/with spaces/key") == binary);
  CHECK(s.check({"a", "empty"}));
  CHECK_FALSE(s.check({"a", "nope"}));
  CHECK(s.add("n", 2) == 2);
  CHECK(s.add("n", -5) == -3);
  CHECK(to_string(s.get("n")) == "-3");
  CHECK(contains(error_of([&] { s.add("a", 1); }), "not a counter"));
  s.wait({"a", "n"}, 100ms);
  std::string long_key(Store::kMaxKeyBytes, 'k');
  s.set(long_key, to_bytes("long"));
  CHECK(to_string(s.get(long_key)) == "long");
  CHECK(contains(error_of([&] { s.set(long_key + "k", {}); }), "at most 4096"));
  CHECK(contains(error_of([&] { s.set("", {}); }), "empty key"));
  CHECK(contains(error_of([&] { s.set("big", Bytes(Store::kMaxValueBytes + 1)); }),
                 "over the 64 MiB limit"));
}

void exercise_timeouts(Store& s) {
  s.set_timeout(300ms);
  s.set("present", to_bytes("1"));
  auto t0 = Clock::now();
  std::string e = error_of([&] { s.wait({"present", "x", "y"}); });
  double took = seconds_since(t0);
  CHECK(took >= 0.25);
  CHECK(took < 3.0);
  CHECK_MESSAGE(contains(e, "store wait timed out after 0.3 s: 2 of 3 keys not set: 'x', 'y'"), e);
  CHECK(s.wait_for({"present", "x"}, 50ms) == std::vector<std::string>{"x"});
  CHECK(s.wait_for({"present"}, 50ms).empty());
  e = error_of([&] { s.get("missing"); });
  CHECK_MESSAGE(contains(e, "get('missing') timed out after 0.3 s"), e);
  // Still usable after a timeout.
  s.set("after", to_bytes("ok"));
  CHECK(to_string(s.get("after")) == "ok");
}

}  // namespace

TEST_CASE("tcp store: set, get, add, check and wait") {
  TcpStoreServer server("127.0.0.1", 0);
  REQUIRE(server.port() > 0);
  TcpStoreClient client("127.0.0.1", server.port(), 5s);
  exercise_basics(client);
  Bytes big(8 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131);
  client.set("big", big);
  CHECK(client.get("big") == big);
}

TEST_CASE("tcp store: timeouts name the keys and the time waited") {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStoreClient client("127.0.0.1", server.port(), 5s);
  exercise_timeouts(client);
}

TEST_CASE("tcp store: get waits for a key another thread sets; add is atomic across threads") {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  auto t0 = Clock::now();
  std::thread setter([&] {
    TcpStoreClient other("127.0.0.1", server.port(), 10s);
    std::this_thread::sleep_for(200ms);
    other.set("late", to_bytes("here"));
  });
  CHECK(to_string(client.get("late")) == "here");
  CHECK(seconds_since(t0) >= 0.15);
  setter.join();

  std::vector<std::thread> adders;
  for (int t = 0; t < 8; ++t)
    adders.emplace_back([&] {
      TcpStoreClient c("127.0.0.1", server.port(), 10s);
      for (int i = 0; i < 100; ++i) c.add("counter", 1);
    });
  for (auto& t : adders) t.join();
  CHECK(client.add("counter", 0) == 800);
}

TEST_CASE("tcp store: set, add and wait across processes") {
  TcpStoreServer server("127.0.0.1", 0);
  int port = server.port();
  std::vector<pid_t> kids;
  for (int i = 0; i < 3; ++i)
    kids.push_back(fork_child([port, i] {
      TcpStoreClient c("127.0.0.1", port, 10s);
      c.add("count", 1);
      c.set("child/" + std::to_string(i), to_bytes(std::to_string(getpid())));
      return to_string(c.get("go")) == "go" ? 0 : 1;
    }));
  TcpStoreClient client("127.0.0.1", port, 10s);
  client.wait({"child/0", "child/1", "child/2"});
  CHECK(client.add("count", 0) == 3);
  client.set("go", to_bytes("go"));
  for (pid_t k : kids) CHECK(wait_child(k) == 0);
}

namespace {

// A client that writes raw bytes to the server, half-closes, and reads what comes back until
// the server closes the connection (or 5 s pass).
std::string raw_exchange(int port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
  shutdown(fd, SHUT_WR);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string replies;
  char buf[256];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) replies.append(buf, size_t(n));
  close(fd);
  return replies;
}

}  // namespace

TEST_CASE("tcp store: oversized or malformed messages close that connection only") {
  TcpStoreServer server("127.0.0.1", 0);
  // Nothing comes back: the server closed the connection.
  auto raw = [&](const std::string& bytes) { return raw_exchange(server.port(), bytes).size(); };
  // SET whose value claims 100 MiB: refused from the header, before any of it arrives.
  std::string huge_set = std::string("\x01\x02\x00\x00\x00", 5) +
                         std::string("\x01\x00\x00\x00", 4) + "k" +
                         std::string("\x00\x00\x40\x06", 4);
  CHECK(raw(huge_set) == 0);
  CHECK(raw(std::string("\x09\x01\x00\x00\x00", 5)) == 0);                  // unknown op
  CHECK(raw(std::string("\x01\x07\x00\x00\x00", 5)) == 0);                  // SET with 7 fields
  CHECK(raw(std::string("\x05\x01\x00\x00\x00\x00\x20\x00\x00", 9)) == 0);  // 8 KiB key
  TcpStoreClient client("127.0.0.1", server.port(), 5s);  // the server still serves
  client.set("fine", to_bytes("yes"));
  CHECK(to_string(client.get("fine")) == "yes");
}

// Two ADDs whose sum overflows int64 (an input that made the server's add() undefined
// behaviour; tools/fuzz/fuzz_store.cpp sends random bytes to the server): the second is
// refused, the counter keeps its value, and the server goes on serving. The raw client
// half-closes after its requests, and still gets both replies.
TEST_CASE("tcp store: an add that overflows the counter is an error, not undefined behaviour") {
  TcpStoreServer server("127.0.0.1", 0);
  const std::string adds(
      "\x04\x02\x00\x00\x00\x01\x00\x00\x00n\x08\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00\x2f"
      "\x04\x02\x00\x00\x00\x01\x00\x00\x00n\x08\x00\x00\x00\xfb\xff\xff\x01\x00\x00\x00\x79",
      44);
  const std::string replies = raw_exchange(server.port(), adds);
  // OK [new value] (1 + 4 + 4 + 8 bytes), then ERROR [message].
  REQUIRE(replies.size() > 17);
  CHECK(replies[0] == 0);
  CHECK(replies[17] == 2);
  CHECK_MESSAGE(contains(replies, "overflows the 64-bit counter"), replies);

  TcpStoreClient client("127.0.0.1", server.port(), 5s);
  CHECK(client.add("n", 0) == 0x2f00000000000300);
  const int64_t max = std::numeric_limits<int64_t>::max();
  CHECK(client.add("max", max) == max);
  std::string e = error_of([&] { client.add("max", 1); });
  CHECK_MESSAGE(contains(e, "store add('max'): adding 1 to 9223372036854775807 overflows"), e);
  CHECK(client.add("max", -1) == max - 1);
  const int64_t min = std::numeric_limits<int64_t>::min();
  CHECK(client.add("min", min) == min);
  CHECK(contains(error_of([&] { client.add("min", -1); }), "overflows the 64-bit counter"));
}

TEST_CASE("file store: an add that overflows the counter is an error") {
  test::TempDir d;
  FileStore store(d.str("store"), 5s);
  const int64_t max = std::numeric_limits<int64_t>::max();
  CHECK(store.add("max", max) == max);
  std::string e = error_of([&] { store.add("max", 1); });
  CHECK_MESSAGE(contains(e, "store add('max'): adding 1 to 9223372036854775807 overflows"), e);
  CHECK(store.add("max", -1) == max - 1);
}

TEST_CASE("tcp store: a port in use is a usage error that says what to do") {
  TcpStoreServer first("127.0.0.1", 0);
  std::string expected = "master port " + std::to_string(first.port()) +
                         " on 127.0.0.1 is already in use (address already in use): choose "
                         "another (replica-launch --master-port, MASTER_PORT, or the port of "
                         "--init-method tcp://HOST:PORT)";
  try {
    TcpStoreServer second("127.0.0.1", first.port());
    FAIL("no error for a port in use");
  } catch (const UsageError& e) { CHECK(std::string(e.what()) == expected); }
}

TEST_CASE("tcp store: the client retries until the server appears, and gives up in time") {
  int port = free_port();
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(500ms);
    server = std::make_unique<TcpStoreServer>("127.0.0.1", port);
  });
  TcpStoreClient client("127.0.0.1", port, 10s);
  starter.join();
  client.set("k", to_bytes("v"));
  CHECK(to_string(client.get("k")) == "v");

  int nobody = free_port();
  auto t0 = Clock::now();
  std::string e = error_of([&] { TcpStoreClient c("127.0.0.1", nobody, 400ms); });
  CHECK(seconds_since(t0) < 3.0);
  CHECK_MESSAGE(contains(e, "cannot connect to the store at 127.0.0.1:" + std::to_string(nobody) +
                                " within 0.4 s (connection refused)"),
                e);
}

TEST_CASE("tcp store: the server shuts down promptly under a waiting client") {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  int port = server->port();
  std::string error;
  std::thread waiter([&] {
    TcpStoreClient c("127.0.0.1", port, 30s);
    error = error_of([&] { c.wait({"never"}); });
  });
  std::this_thread::sleep_for(200ms);
  auto t0 = Clock::now();
  server.reset();
  CHECK(seconds_since(t0) < 2.0);
  waiter.join();
  CHECK(seconds_since(t0) < 5.0);
  CHECK_MESSAGE(contains(error, "shut down while 1 of 1 keys were not set: 'never'"), error);
}

TEST_CASE("file store: the same semantics, across processes") {
  test::TempDir tmp;
  FileStore store(tmp.str("store"), 5s);
  exercise_basics(store);
  exercise_timeouts(store);
  std::string long_key(3000, 'x');
  store.set(long_key + "/1", to_bytes("one"));
  store.set(long_key + "/2", to_bytes("two"));
  CHECK(to_string(store.get(long_key + "/1")) == "one");
  CHECK(to_string(store.get(long_key + "/2")) == "two");

  std::string dir = tmp.str("store");
  std::vector<pid_t> kids;
  for (int i = 0; i < 4; ++i)
    kids.push_back(fork_child([dir, i] {
      FileStore s(dir, 10s);
      for (int k = 0; k < 50; ++k) s.add("shared", 1);
      s.set("done/" + std::to_string(i), to_bytes("1"));
      return to_string(s.get("go")) == "go" ? 0 : 1;
    }));
  store.set_timeout(10s);
  store.wait({"done/0", "done/1", "done/2", "done/3"});
  CHECK(store.add("shared", 0) == 200);
  store.set("go", to_bytes("go"));
  for (pid_t k : kids) CHECK(wait_child(k) == 0);
}

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
  INFO(read_file(dir + "/error1"));
  std::string message = read_file(dir + "/error0");
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
