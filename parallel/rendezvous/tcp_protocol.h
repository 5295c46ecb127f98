// The wire format shared by TcpStoreServer (tcp_store_server.cpp) and TcpStoreClient
// (tcp_store.cpp). Internal: include only from those two files.
//
// Both directions: u8 op-or-status, u32 field count, then per field u32 length + bytes
// (little-endian). Requests: SET [key, value], GET [timeout_ms, key], WAIT [timeout_ms, keys...],
// ADD [key, delta], CHECK [keys...]. Replies: OK [result...], TIMEOUT [missing keys...],
// ERROR [message], SHUTDOWN [missing keys] (a wait cut short by the server's end). A field over
// its limit, an unknown op or a wrong field count closes the connection: the server never
// trusts a length before it has checked it.
#pragma once
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "parallel/rendezvous/store.h"

namespace replica {
namespace tcp_store {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Op : uint8_t { kSet = 1, kGet = 2, kWait = 3, kAdd = 4, kCheck = 5 };
enum Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2, kShutdown = 3 };
constexpr size_t kMaxFrameBytes = Store::kMaxValueBytes + (size_t(1) << 20);

struct Frame {
  uint8_t code = 0;
  std::vector<std::string> fields;
};

inline std::string put_le(uint64_t v, int bytes) {
  std::string s(size_t(bytes), '\0');
  for (int i = 0; i < bytes; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
inline uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
inline std::string u64_field(uint64_t v) { return put_le(v, 8); }
inline std::string encode(const Frame& f) {
  std::string out(1, static_cast<char>(f.code));
  out += put_le(f.fields.size(), 4);
  for (const auto& field : f.fields) out += put_le(field.size(), 4) + field;
  return out;
}

// Limits of field i of a request with this op (the server side of the size checks).
inline bool request_header_ok(uint8_t op, uint32_t n) {
  switch (op) {
    case kSet:
    case kGet:
    case kAdd:
      return n == 2;
    case kWait:
      return n >= 2 && n <= Store::kMaxKeysPerRequest + 1;
    case kCheck:
      return n >= 1 && n <= Store::kMaxKeysPerRequest;
    default:
      return false;
  }
}
inline size_t request_field_limit(uint8_t op, uint32_t i) {
  return op == kSet && i == 1 ? Store::kMaxValueBytes : Store::kMaxKeyBytes;
}

enum class Parse { kIncomplete, kDone, kInvalid };

// Parses one frame from [p, p+n). request: apply the request limits; else the reply limits.
inline Parse parse_frame(const char* p, size_t n, bool request, Frame* out, size_t* used) {
  if (n < 5) return Parse::kIncomplete;
  uint8_t code = static_cast<uint8_t>(p[0]);
  uint32_t count = static_cast<uint32_t>(get_le(p + 1, 4));
  if (request ? !request_header_ok(code, count) : count > Store::kMaxKeysPerRequest)
    return Parse::kInvalid;
  size_t pos = 5;
  std::vector<std::pair<size_t, size_t>> spans;
  for (uint32_t i = 0; i < count; ++i) {
    if (n - pos < 4) return Parse::kIncomplete;
    size_t len = get_le(p + pos, 4);
    size_t limit = request ? request_field_limit(code, i) : Store::kMaxValueBytes;
    if (len > limit || pos + 4 + len > kMaxFrameBytes) return Parse::kInvalid;
    pos += 4;
    if (n - pos < len) return Parse::kIncomplete;
    spans.emplace_back(pos, len);
    pos += len;
  }
  out->code = code;
  out->fields.clear();
  for (auto [off, len] : spans) out->fields.emplace_back(p + off, len);
  *used = pos;
  return Parse::kDone;
}

inline std::string errno_text(int err) {
  std::string s = std::strerror(err);
  if (!s.empty()) s[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return s;
}

struct AddrList {
  addrinfo* head = nullptr;
  ~AddrList() {
    if (head) freeaddrinfo(head);
  }
};

inline void resolve(const std::string& host, int port, bool passive, AddrList* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const char* node = host.empty() || (passive && host == "*") ? nullptr : host.c_str();
  int rc = getaddrinfo(node, std::to_string(port).c_str(), &hints, &out->head);
  REPLICA_USAGE_CHECK(rc == 0, "cannot resolve the store address '{}' ({}): check MASTER_ADDR",
                      host, gai_strerror(rc));
}

}  // namespace tcp_store
}  // namespace replica
