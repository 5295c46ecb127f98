// Stores: TCP and file stores across threads and forked processes, timeouts that name their
// keys, size limits, malformed messages, counters that overflow, a busy port, clients that
// start before the server. (Rendezvous over them: test_rendezvous.cpp.)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <limits>
#include <thread>

#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "env_guard.h"
#include "process_helpers.h"
#include "engine/error.h"
#include "parallel/rendezvous/store.h"

using namespace replica;
using namespace test;

namespace {

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
