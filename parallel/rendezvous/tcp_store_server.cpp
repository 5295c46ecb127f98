// TcpStoreServer: one poll() thread, non-blocking sockets, waits resolved server-side (a
// waiting connection's later requests stay buffered until it is answered). Protocol and limits:
// tcp_protocol.h.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <list>
#include <map>

#include "parallel/rendezvous/tcp_protocol.h"

namespace replica {
namespace {

using namespace tcp_store;

struct Conn {
  int fd = -1;
  std::string in, out;
  size_t in_off = 0, out_off = 0;
  bool waiting = false;  // a GET/WAIT is pending; later requests stay buffered
  Frame pending;
  Clock::time_point deadline;
  bool closed = false;

  // Sends what it can of the pending replies without blocking; a broken peer closes it.
  void send_pending() {
    const ssize_t sent =
        send(fd, out.data() + out_off, out.size() - out_off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0)
      out_off += static_cast<size_t>(sent);
    else if (errno != EAGAIN && errno != EINTR)
      closed = true;
  }
};

struct ServerState {
  std::map<std::string, std::string> data;
  std::list<Conn> conns;
  bool changed = false;

  void reply(Conn& c, uint8_t status, std::vector<std::string> fields = {}) {
    c.out += encode(Frame{status, std::move(fields)});
  }

  // Answers a GET/WAIT if its keys are set (or its deadline passed, or the server is shutting
  // down); true when answered.
  bool try_resolve(Conn& c, Clock::time_point now, bool shutdown = false) {
    const Frame& f = c.pending;
    std::vector<std::string> missing;
    for (size_t i = 1; i < f.fields.size(); ++i)
      if (!data.count(f.fields[i])) missing.push_back(f.fields[i]);
    if (missing.empty()) {
      if (f.code == kGet)
        reply(c, kOk, {data[f.fields[1]]});
      else
        reply(c, kOk);
    } else if (now >= c.deadline || shutdown) {
      reply(c, shutdown ? kShutdown : kTimeout, std::move(missing));
    } else {
      return false;
    }
    c.waiting = false;
    return true;
  }

  void handle(Conn& c, Frame f, Clock::time_point now) {
    switch (f.code) {
      case kSet:
        data[f.fields[0]] = std::move(f.fields[1]);
        changed = true;
        reply(c, kOk);
        return;
      case kAdd: {
        if (f.fields[1].size() != 8) {
          c.closed = true;
          return;
        }
        auto it = data.find(f.fields[0]);
        int64_t sum = 0;
        const std::string why =
            add_to_counter(it != data.end() ? &it->second : nullptr,
                           static_cast<int64_t>(get_le(f.fields[1].data(), 8)), &sum);
        if (!why.empty()) {
          reply(c, kError, {why});
          return;
        }
        data[f.fields[0]] = std::to_string(sum);
        changed = true;
        reply(c, kOk, {u64_field(static_cast<uint64_t>(sum))});
        return;
      }
      case kCheck: {
        bool all = std::all_of(f.fields.begin(), f.fields.end(),
                               [&](const std::string& k) { return data.count(k) > 0; });
        reply(c, kOk, {all ? "1" : "0"});
        return;
      }
      default: {  // kGet, kWait: [timeout_ms, keys...]
        if (f.fields[0].size() != 8) {
          c.closed = true;
          return;
        }
        int64_t ms = static_cast<int64_t>(get_le(f.fields[0].data(), 8));
        c.deadline = now + milliseconds(std::clamp<int64_t>(ms, 0, int64_t(1) << 40));
        c.pending = std::move(f);
        c.waiting = true;
        try_resolve(c, now);
      }
    }
  }

  // Handles the buffered requests of c until one has to wait.
  void process(Conn& c, Clock::time_point now) {
    while (!c.waiting && !c.closed) {
      Frame f;
      size_t used = 0;
      Parse r = parse_frame(c.in.data() + c.in_off, c.in.size() - c.in_off, true, &f, &used);
      if (r == Parse::kIncomplete) break;
      if (r == Parse::kInvalid) {
        c.closed = true;
        break;
      }
      c.in_off += used;
      handle(c, std::move(f), now);
    }
    if (c.in_off > 0 && (c.in_off == c.in.size() || c.in_off > (size_t(1) << 20))) {
      c.in.erase(0, c.in_off);
      c.in_off = 0;
    }
    if (c.in.size() > 2 * kMaxFrameBytes) c.closed = true;  // a client that floods us
  }

  void settle(Clock::time_point now) {
    for (int round = 0; round < 1000; ++round) {
      changed = false;
      for (auto& c : conns)
        if (!c.closed && (!c.waiting || try_resolve(c, now))) process(c, now);
      if (!changed) break;
    }
  }
};

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, int port) {
  REPLICA_USAGE_CHECK(port >= 0 && port <= 65535, "store port {} is out of range (0-65535)", port);
  AddrList addrs;
  resolve(host, port, true, &addrs);
  int last_err = 0;
  for (addrinfo* a = addrs.head; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_err = errno;
    close(fd);
    REPLICA_USAGE_CHECK(last_err != EADDRINUSE,
                        "master port {} on {} is already in use (address already in use): "
                        "choose another (replica-launch --master-port, MASTER_PORT, or the port "
                        "of --init-method tcp://HOST:PORT)",
                        port, host.empty() ? "*" : host);
  }
  REPLICA_USAGE_CHECK(listen_fd_ >= 0, "cannot listen on {}:{} for the store ({})",
                      host.empty() ? "*" : host, port, errno_text(last_err));
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(listen_fd_);
    throw Error(fmt::format("cannot create the store's wake-up pipe ({})", errno_text(errno)));
  }
  thread_ = std::thread([this] { loop(); });
}

TcpStoreServer::~TcpStoreServer() {
  char b = 1;
  ssize_t ignored = write(wake_pipe_[1], &b, 1);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_pipe_[0]);
  close(wake_pipe_[1]);
}

void TcpStoreServer::loop() {
  ServerState s;
  std::vector<pollfd> fds;
  std::vector<Conn*> polled;
  char buf[1 << 16];
  for (;;) {
    auto now = Clock::now();
    int timeout_ms = 1000;
    fds.assign({{wake_pipe_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    polled.clear();
    for (auto& c : s.conns) {
      short ev = POLLIN;
      if (c.out.size() > c.out_off) ev |= POLLOUT;
      fds.push_back({c.fd, ev, 0});
      polled.push_back(&c);
      if (c.waiting) {
        auto left = std::chrono::duration_cast<milliseconds>(c.deadline - now).count() + 1;
        timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, timeout_ms));
      }
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (fds[0].revents) break;  // shutdown
    now = Clock::now();
    if (fds[1].revents & POLLIN) {
      for (int fd;
           (fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        s.conns.emplace_back().fd = fd;
      }
    }
    for (size_t i = 0; i < polled.size(); ++i) {
      Conn& c = *polled[i];
      short re = fds[i + 2].revents;
      if (re & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t got = recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got > 0)
          c.in.append(buf, static_cast<size_t>(got));
        else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
          // A peer that half-closed after its last request still gets the replies decided
          // so far (what fits in the socket now), as at shutdown.
          if (got == 0 && c.out_off < c.out.size()) c.send_pending();
          c.closed = true;
        }
      }
      if (!c.closed && (re & POLLOUT)) {
        c.send_pending();
        if (c.out_off == c.out.size()) {
          c.out.clear();
          c.out_off = 0;
        }
      }
    }
    s.settle(now);
    s.conns.remove_if([](const Conn& c) {
      if (c.closed) close(c.fd);
      return c.closed;
    });
  }
  // Shutdown: deliver the replies already decided (e.g. the last rank's answer to the barrier
  // that let rank 0 finish), for at most a second, then close everything.
  auto flush_until = Clock::now() + std::chrono::seconds(1);
  for (auto& c : s.conns) {
    if (c.waiting && !c.closed) s.try_resolve(c, Clock::now(), true);
    while (!c.closed && c.out_off < c.out.size() && Clock::now() < flush_until) {
      pollfd p{c.fd, POLLOUT, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      c.send_pending();
    }
    close(c.fd);
  }
}

}  // namespace replica
