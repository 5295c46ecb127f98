// What every store shares: key and value limits, messages, wait(). The stores: TcpStoreServer
// (tcp_store_server.cpp), TcpStoreClient (tcp_store.cpp; wire format: tcp_protocol.h), FileStore
// (file_store.cpp). rendezvous() is in rendezvous.cpp.
#include "parallel/rendezvous/store.h"

#include <cerrno>
#include <cstdlib>

#include "engine/error.h"

namespace replica {

using std::chrono::milliseconds;

void check_key(const std::string& key, const char* op) {
  REPLICA_CHECK(!key.empty(), "store {}: empty key", op);
  REPLICA_CHECK(key.size() <= Store::kMaxKeyBytes, "store {}: key of {} bytes, at most {}", op,
                key.size(), Store::kMaxKeyBytes);
}

void check_value(const std::string& key, const Bytes& value) {
  REPLICA_CHECK(value.size() <= Store::kMaxValueBytes,
                "store set('{}'): value of {} bytes is over the {} MiB limit", key, value.size(),
                Store::kMaxValueBytes >> 20);
}

std::string add_to_counter(const std::string* old, int64_t delta, int64_t* sum) {
  int64_t value = 0;
  if (old) {
    char* end = nullptr;
    errno = 0;
    value = std::strtoll(old->c_str(), &end, 10);
    if (old->empty() || *end != '\0' || errno != 0)
      return "the key holds a value that is not a counter";
  }
  if (__builtin_add_overflow(value, delta, sum))
    return fmt::format("adding {} to {} overflows the 64-bit counter", delta, value);
  return "";
}

uint64_t text_hash(const std::string& text, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string format_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 8; ++i)
    out += (i ? ", '" : "'") + keys[i].substr(0, 200) + "'";
  if (keys.size() > 8) out += fmt::format(" and {} more", keys.size() - 8);
  return out;
}

std::string format_duration(milliseconds d) { return fmt::format("{:.1f} s", d.count() / 1000.0); }

void Store::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  std::vector<std::string> missing = wait_for(keys, timeout);
  if (!missing.empty())
    throw Error(fmt::format("store wait timed out after {}: {} of {} keys not set: {} (store {})",
                            format_duration(timeout), missing.size(), keys.size(),
                            format_keys(missing), describe()));
}

}  // namespace replica
