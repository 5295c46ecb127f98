// libFuzzer target for the TCP store's wire protocol (parallel/rendezvous/tcp_protocol.h) and the server's
// handling of it (parallel/rendezvous/tcp_store_server.cpp), built and run by tools/fuzz.sh. Each input is
// the byte stream one client sends:
//   1. parse_frame() reads it frame by frame, as requests (what the server does) and as replies
//      (what the client does); a frame it accepts must encode() back to the same bytes;
//   2. a fresh TcpStoreServer in this process receives it on a connection that is then
//      half-closed: the server must answer with well-formed replies and close it, and still
//      answer a valid SET and GET on a new connection afterwards.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "parallel/rendezvous/store.h"
#include "parallel/rendezvous/tcp_protocol.h"

namespace {

using namespace replica;
using namespace replica::tcp_store;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_store: %s\n", what.c_str());
  std::abort();
}

// Parses the frames of [p, p+n) as the server (request) or the client (reply) would; returns
// how many complete frames came before the end or the first invalid one.
size_t parse_all(const char* p, size_t n, bool request, bool* invalid) {
  size_t off = 0, frames = 0;
  *invalid = false;
  while (off < n) {
    Frame f;
    size_t used = 0;
    Parse r = parse_frame(p + off, n - off, request, &f, &used);
    if (r == Parse::kIncomplete) break;
    if (r == Parse::kInvalid) {
      *invalid = true;
      break;
    }
    if (used == 0 || used > n - off) fail("parse_frame consumed an impossible byte count");
    if (encode(f) != std::string(p + off, used)) fail("a parsed frame does not encode back");
    off += used;
    ++frames;
  }
  return frames;
}

// Sends `bytes` on a new connection, half-closes it and returns everything the server sent
// until it closed the connection. Half-closing first leaves this end in TIME_WAIT for a minute:
// each connection comes from another address of 127.0.0.0/8 (127.1.0.1 to 127.1.255.254), so
// hundreds of them a second do not use up the local ports.
std::string exchange(int port, const std::string& bytes) {
  static uint32_t next = 0;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail(std::string("socket() failed: ") + std::strerror(errno));
  sockaddr_in from{};
  from.sin_family = AF_INET;
  from.sin_addr.s_addr = htonl(0x7f010001 + next++ % 0xfffe);
  int one = 1;
  setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
  if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0)
    fail(std::string("cannot bind a loopback address: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    // libFuzzer's alarm signal (-timeout) can interrupt connect(), which then goes on in the
    // background: wait for it. (send and recv below retry on EINTR for the same reason.)
    int err = errno;
    if (err == EINTR) {
      pollfd w{fd, POLLOUT, 0};
      while (poll(&w, 1, 10000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err != 0) fail(std::string("cannot connect to the store server: ") + std::strerror(err));
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  for (size_t off = 0; off < bytes.size();) {
    ssize_t n = send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the server closed the connection: the rest goes unread
    off += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  std::string in;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) {
      in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      fail("the server neither answered nor closed the connection within 10 s");
    break;  // closed (0) or reset
  }
  close(fd);
  return in;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  bool invalid = false;
  size_t requests = parse_all(p, size, true, &invalid);
  parse_all(p, size, false, &invalid);

  TcpStoreServer server("127.0.0.1", 0);
  std::string replies = exchange(server.port(), std::string(p, size));
  size_t answered = parse_all(replies.data(), replies.size(), false, &invalid);
  if (invalid) fail("the server sent a malformed reply");
  if (answered > requests) fail("the server sent more replies than it got requests");
  for (size_t off = 0, i = 0; i < answered; ++i) {
    Frame f;
    size_t used = 0;
    parse_frame(replies.data() + off, replies.size() - off, false, &f, &used);
    if (f.code > kShutdown) fail("the server sent an unknown status " + std::to_string(f.code));
    off += used;
  }
  // A valid client afterwards: SET then GET of a key of its own.
  const std::string probe = encode(Frame{kSet, {"fuzz/probe", "ok"}}) +
                            encode(Frame{kGet, {u64_field(1000), "fuzz/probe"}});
  const std::string expected = encode(Frame{kOk, {}}) + encode(Frame{kOk, {"ok"}});
  if (exchange(server.port(), probe) != expected)
    fail("the server no longer answers a valid client");
  return 0;
}
