// TcpStoreClient: one connection, retried until the deadline; every exchange bounded in time.
// Protocol and limits: tcp_protocol.h; the server: tcp_store_server.cpp.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <thread>

#include "parallel/rendezvous/tcp_protocol.h"

namespace replica {

using namespace tcp_store;

struct TcpStoreClient::Impl {
  std::string host;
  int port;
  int fd = -1;
  std::mutex mu;

  ~Impl() { disconnect(); }
  std::string where() const { return fmt::format("{}:{}", host, port); }

  void disconnect() {
    if (fd >= 0) close(fd);
    fd = -1;
  }

  // One non-blocking connect attempt bounded by `limit`; returns the fd or -1 (errno in *err).
  static int connect_once(const addrinfo* a, milliseconds limit, int* err) {
    int s = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    auto give_up = [&](int why) {
      *err = why;
      if (s >= 0) close(s);
      return -1;
    };
    if (s < 0) return give_up(errno);
    if (connect(s, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) return give_up(errno);
      pollfd p{s, POLLOUT, 0};
      if (poll(&p, 1, static_cast<int>(limit.count())) <= 0) return give_up(ETIMEDOUT);
      int soerr = 0;
      socklen_t len = sizeof soerr;
      getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &len);
      if (soerr != 0) return give_up(soerr);
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return s;
  }

  void connect_until(Clock::time_point deadline, milliseconds timeout) {
    AddrList addrs;
    resolve(host, port, false, &addrs);
    int err = 0;
    milliseconds backoff(20);
    for (;;) {
      for (addrinfo* a = addrs.head; a && fd < 0; a = a->ai_next) {
        auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
        fd = connect_once(a, std::clamp(left, milliseconds(1), milliseconds(5000)), &err);
      }
      if (fd >= 0) return;
      if (Clock::now() + backoff >= deadline)
        throw Error(fmt::format(
            "cannot connect to the store at {} within {} ({}): is rank 0 running, and are "
            "MASTER_ADDR and MASTER_PORT the same on every rank?",
            where(), format_duration(timeout), errno_text(err)));
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, milliseconds(500));
    }
  }

  [[noreturn]] void lost(const std::string& op, const std::string& why) {
    disconnect();
    throw Error(fmt::format("store {}: connection to the store at {} lost ({}): did rank 0 exit?",
                            op, where(), why));
  }

  // Sends one request and reads its reply; `io` bounds the whole exchange.
  Frame request(const std::string& op, const Frame& req, milliseconds io, milliseconds timeout) {
    std::string bytes = encode(req);
    if (bytes.size() > kMaxFrameBytes)
      throw Error(fmt::format("store {}: request of {} bytes is over the {} byte limit", op,
                              bytes.size(), kMaxFrameBytes));
    if (fd < 0) connect_until(Clock::now() + timeout, timeout);
    auto deadline = Clock::now() + io;
    auto wait_for = [&](short ev) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      pollfd p{fd, ev, 0};
      int r = left > 0 ? poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30))) : 0;
      if (r == 0) lost(op, fmt::format("no reply within {}", format_duration(io)));
      if (r < 0 && errno != EINTR) lost(op, errno_text(errno));
    };
    for (size_t off = 0; off < bytes.size();) {
      ssize_t n = send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EINTR) lost(op, errno_text(errno));
      wait_for(POLLOUT);
    }
    std::string in;
    char buf[1 << 16];
    for (;;) {
      Frame reply;
      size_t used = 0;
      Parse r = parse_frame(in.data(), in.size(), false, &reply, &used);
      if (r == Parse::kDone) return reply;
      if (r == Parse::kInvalid) lost(op, "malformed reply");
      ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        in.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n == 0) lost(op, "the server closed the connection");
      if (errno != EAGAIN && errno != EINTR) lost(op, errno_text(errno));
      wait_for(POLLIN);
    }
  }
};

TcpStoreClient::TcpStoreClient(const std::string& host, int port, milliseconds timeout,
                               std::unique_ptr<TcpStoreServer> server)
    : Store(timeout), server_(std::move(server)), impl_(std::make_unique<Impl>()) {
  REPLICA_USAGE_CHECK(port > 0 && port <= 65535, "store port {} is out of range (1-65535)", port);
  impl_->host = host;
  impl_->port = port;
  impl_->connect_until(Clock::now() + timeout, timeout);
}

TcpStoreClient::~TcpStoreClient() = default;  // the connection (impl_) first, then the server

std::string TcpStoreClient::describe() const { return impl_->where(); }

std::unique_ptr<Store> TcpStoreClient::connect_again(milliseconds timeout) const {
  return std::make_unique<TcpStoreClient>(impl_->host, impl_->port, timeout);
}

void TcpStoreClient::set(const std::string& key, const Bytes& value) {
  check_key(key, "set");
  check_value(key, value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::string op = "set('" + key + "')";
  Frame r = impl_->request(op, Frame{kSet, {key, std::string(value.begin(), value.end())}},
                           timeout_, timeout_);
  if (r.code != kOk) impl_->lost(op, "unexpected reply");
}

Bytes TcpStoreClient::get(const std::string& key) {
  check_key(key, "get");
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::string op = "get('" + key + "')";
  Frame r = impl_->request(op, Frame{kGet, {u64_field(timeout_.count()), key}},
                           timeout_ + std::chrono::seconds(10), timeout_);
  if (r.code == kTimeout)
    throw Error(fmt::format("store get('{}') timed out after {}: the key was never set (store {})",
                            key, format_duration(timeout_), describe()));
  if (r.code == kShutdown)
    throw Error(
        fmt::format("store get('{}'): the store at {} shut down before the key was set: "
                    "did rank 0 exit?",
                    key, describe()));
  if (r.code != kOk || r.fields.size() != 1) impl_->lost(op, "unexpected reply");
  return Bytes(r.fields[0].begin(), r.fields[0].end());
}

std::vector<std::string> TcpStoreClient::wait_for(const std::vector<std::string>& keys,
                                                  milliseconds timeout) {
  if (keys.empty()) return {};
  REPLICA_CHECK(keys.size() <= kMaxKeysPerRequest, "store wait: {} keys, at most {}", keys.size(),
                kMaxKeysPerRequest);
  for (const auto& k : keys) check_key(k, "wait");
  std::lock_guard<std::mutex> lock(impl_->mu);
  Frame req{kWait, {u64_field(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)))}};
  req.fields.insert(req.fields.end(), keys.begin(), keys.end());
  std::string op = "wait(" + format_keys(keys) + ")";
  Frame r = impl_->request(op, req, timeout + std::chrono::seconds(10), timeout_);
  if (r.code == kShutdown)
    throw Error(
        fmt::format("store wait: the store at {} shut down while {} of {} keys were not "
                    "set: {}: did rank 0 exit?",
                    describe(), r.fields.size(), keys.size(), format_keys(r.fields)));
  if (r.code == kTimeout) return r.fields;
  if (r.code != kOk) impl_->lost(op, "unexpected reply");
  return {};
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  check_key(key, "add");
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::string op = "add('" + key + "')";
  Frame r = impl_->request(op, Frame{kAdd, {key, u64_field(static_cast<uint64_t>(delta))}},
                           timeout_, timeout_);
  if (r.code == kError && r.fields.size() == 1)
    throw Error(fmt::format("store add('{}'): {}", key, r.fields[0]));
  if (r.code != kOk || r.fields.size() != 1 || r.fields[0].size() != 8)
    impl_->lost(op, "unexpected reply");
  return static_cast<int64_t>(get_le(r.fields[0].data(), 8));
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  if (keys.empty()) return true;
  REPLICA_CHECK(keys.size() <= kMaxKeysPerRequest, "store check: {} keys, at most {}", keys.size(),
                kMaxKeysPerRequest);
  for (const auto& k : keys) check_key(k, "check");
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::string op = "check(" + format_keys(keys) + ")";
  Frame r = impl_->request(op, Frame{kCheck, keys}, timeout_, timeout_);
  if (r.code != kOk || r.fields.size() != 1) impl_->lost(op, "unexpected reply");
  return r.fields[0] == "1";
}

}  // namespace replica
