// Store helpers, FileStore and rendezvous(). TcpStoreServer: tcp_store_server.cpp; TcpStoreClient:
// tcp_store.cpp; their wire format: tcp_protocol.h.
#include "parallel/rendezvous/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "engine/error.h"

namespace replica {

using Clock = std::chrono::steady_clock;
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

// ---------------------------------------------------------------------------------- FileStore

namespace {

std::string errno_text() { return std::strerror(errno); }

// Polls `ready` with a growing sleep (1 ms .. 50 ms) until it returns true or the deadline.
template <typename F>
bool poll_until(Clock::time_point deadline, F ready) {
  milliseconds nap(1);
  for (;;) {
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::min(
        nap, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()) + milliseconds(1)));
    nap = std::min(nap * 2, milliseconds(50));
  }
}

bool read_file(const std::string& path, Bytes* out) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    REPLICA_CHECK(errno == ENOENT, "file store: cannot read '{}' ({})", path, errno_text());
    return false;
  }
  out->clear();
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out->insert(out->end(), buf, buf + n);
  int err = errno;
  close(fd);
  REPLICA_CHECK(n == 0, "file store: cannot read '{}' ({})", path, std::strerror(err));
  return true;
}

void write_atomically(const std::string& dir, const std::string& path, const Bytes& value) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = fmt::format("{}/.tmp-{}-{}", dir, getpid(), counter++);
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REPLICA_CHECK(fd >= 0, "file store: cannot create '{}' ({})", tmp, errno_text());
  size_t off = 0;
  while (off < value.size()) {
    ssize_t n = write(fd, value.data() + off, value.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string why = errno_text();
      close(fd);
      unlink(tmp.c_str());
      throw Error(fmt::format("file store: cannot write '{}' ({})", tmp, why));
    }
    off += static_cast<size_t>(n);
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    unlink(tmp.c_str());
    throw Error(fmt::format("file store: cannot rename '{}' to '{}' ({})", tmp, path, why));
  }
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

FileStore::FileStore(const std::string& dir, milliseconds timeout) : Store(timeout), dir_(dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  REPLICA_USAGE_CHECK(std::filesystem::is_directory(dir),
                      "cannot create the file store directory '{}' ({})", dir,
                      ec ? ec.message() : "not a directory");
}

// Safe characters stay, others become %XX; long keys become two 64-bit hashes.
std::string FileStore::path_for(const std::string& key) const {
  std::string name = "k-";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-')
      name += static_cast<char>(c);
    else
      name += fmt::format("%{:02X}", c);
  }
  if (name.size() > 200)
    name = fmt::format("h-{:016x}{:016x}", fnv1a(key, 14695981039346656037ull),
                       fnv1a(key, 0x9e3779b97f4a7c15ull));
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  check_key(key, "set");
  check_value(key, value);
  write_atomically(dir_, path_for(key), value);
}

Bytes FileStore::get(const std::string& key) {
  check_key(key, "get");
  Bytes out;
  std::string path = path_for(key);
  if (!poll_until(Clock::now() + timeout_, [&] { return read_file(path, &out); }))
    throw Error(fmt::format("store get('{}') timed out after {}: the key was never set (store {})",
                            key, format_duration(timeout_), describe()));
  return out;
}

std::vector<std::string> FileStore::wait_for(const std::vector<std::string>& keys,
                                             milliseconds timeout) {
  for (const auto& k : keys) check_key(k, "wait");
  std::vector<std::string> missing;
  poll_until(Clock::now() + timeout, [&] {
    missing.clear();
    for (const auto& k : keys)
      if (access(path_for(k).c_str(), F_OK) != 0) missing.push_back(k);
    return missing.empty();
  });
  return missing;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    check_key(k, "check");
    if (access(path_for(k).c_str(), F_OK) != 0) return false;
  }
  return true;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  check_key(key, "add");
  std::string path = path_for(key);
  std::string lock_path = dir_ + "/l" + path.substr(dir_.size() + 2);
  int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  REPLICA_CHECK(fd >= 0, "file store: cannot open the lock '{}' ({})", lock_path, errno_text());
  while (flock(fd, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    std::string why = errno_text();
    close(fd);
    throw Error(fmt::format("file store: cannot lock '{}' ({})", lock_path, why));
  }
  try {
    Bytes old;
    int64_t value = 0;
    if (read_file(path, &old)) {
      std::string text = to_string(old);
      char* end = nullptr;
      errno = 0;
      value = std::strtoll(text.c_str(), &end, 10);
      REPLICA_CHECK(!text.empty() && *end == '\0' && errno == 0,
                    "store add('{}'): key '{}' holds a value that is not a counter", key, key);
    }
    int64_t sum = 0;
    REPLICA_CHECK(!__builtin_add_overflow(value, delta, &sum),
                  "store add('{}'): adding {} to {} overflows the 64-bit counter", key, delta,
                  value);
    write_atomically(dir_, path, to_bytes(std::to_string(sum)));
    close(fd);  // releases the lock
    return sum;
  } catch (...) {
    close(fd);
    throw;
  }
}

// ---------------------------------------------------------------------------------- rendezvous

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int parse_int(const std::string& what, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text.c_str(), &end, 10);
  REPLICA_USAGE_CHECK(!text.empty() && *end == '\0' && errno == 0 && v >= 0 && v < (1L << 30),
                      "{}='{}' is not a non-negative integer", what, text);
  return static_cast<int>(v);
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  return v ? parse_int(name, v) : fallback;
}

// Tasks on node `node` from Slurm's "2(x3),1" notation; -1 when it cannot tell.
int slurm_tasks_on_node(const char* spec, int node) {
  if (!spec) return -1;
  std::string s = spec;
  size_t pos = 0;
  int index = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int count = std::atoi(item.c_str()), repeat = 1;
    size_t x = item.find("(x");
    if (x != std::string::npos) repeat = std::atoi(item.c_str() + x + 2);
    if (node < index + repeat) return count;
    index += repeat;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return -1;
}

void validate(const Rendezvous& r, const std::string& source) {
  REPLICA_USAGE_CHECK(r.world_size >= 1, "{}: world size {} must be at least 1", source,
                      r.world_size);
  REPLICA_USAGE_CHECK(r.rank < r.world_size, "{}: rank {} is not below the world size {}", source,
                      r.rank, r.world_size);
  REPLICA_USAGE_CHECK(r.local_world_size >= 1 && r.local_world_size <= r.world_size,
                      "{}: local world size {} must be between 1 and the world size {}", source,
                      r.local_world_size, r.world_size);
  REPLICA_USAGE_CHECK(r.local_rank < r.local_world_size,
                      "{}: local rank {} is not below the local world size {}", source,
                      r.local_rank, r.local_world_size);
}

}  // namespace

Rendezvous rendezvous_env_ranks() {
  Rendezvous r;
  std::string source = "the environment";
  if (env("RANK")) {
    source = "RANK/WORLD_SIZE";
    REPLICA_USAGE_CHECK(env("WORLD_SIZE"), "RANK is set but WORLD_SIZE is not: set both");
    r.rank = env_int("RANK", 0);
    r.world_size = env_int("WORLD_SIZE", 1);
    r.local_world_size = env_int("LOCAL_WORLD_SIZE", r.world_size);
    r.local_rank = env_int("LOCAL_RANK", r.rank % std::max(r.local_world_size, 1));
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    source = "OMPI_COMM_WORLD_*";
    r.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    r.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    r.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", r.world_size);
    r.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", r.rank % std::max(r.local_world_size, 1));
  } else if (env("SLURM_PROCID")) {
    source = "SLURM_PROCID/SLURM_NTASKS";
    r.rank = env_int("SLURM_PROCID", 0);
    r.world_size = env_int("SLURM_NTASKS", 1);
    int local = slurm_tasks_on_node(env("SLURM_TASKS_PER_NODE"), env_int("SLURM_NODEID", 0));
    r.local_world_size = local > 0 ? local : env_int("SLURM_NNODES", 1) == 1 ? r.world_size : 1;
    r.local_rank = env_int("SLURM_LOCALID", r.rank % std::max(r.local_world_size, 1));
  }
  validate(r, source);
  return r;
}

Rendezvous rendezvous(const RendezvousOptions& options) {
  Rendezvous r = rendezvous_env_ranks();
  if (options.world_size >= 0) r.world_size = options.world_size;
  if (options.rank >= 0) r.rank = options.rank;
  if (r.local_world_size > r.world_size || r.local_rank >= r.local_world_size) {
    r.local_world_size = r.world_size;  // explicit ranks that do not match the environment
    r.local_rank = r.rank;
  }
  validate(r, "rendezvous");
  const std::string& method = options.init_method.empty() ? "env://" : options.init_method;
  milliseconds timeout = options.timeout;

  std::string host;
  int port = 0;
  if (method == "env://") {
    const char* a = env("MASTER_ADDR");
    const char* p = env("MASTER_PORT");
    REPLICA_USAGE_CHECK((a && p) || r.world_size == 1,
                        "env:// rendezvous needs MASTER_ADDR and MASTER_PORT (rank 0's address "
                        "and a free port): start the ranks with replica-launch, or set both");
    host = a ? a : "127.0.0.1";
    port = p ? parse_int("MASTER_PORT", p) : 0;  // one process: any free port
  } else if (method.rfind("tcp://", 0) == 0) {
    std::string rest = method.substr(6);
    size_t colon = rest.rfind(':');
    REPLICA_USAGE_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(),
                        "init method '{}': expected tcp://HOST:PORT", method);
    host = rest.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    port = parse_int("tcp:// port", rest.substr(colon + 1));
  } else if (method.rfind("file://", 0) == 0) {
    REPLICA_USAGE_CHECK(method.size() > 7, "init method '{}': expected file://DIR", method);
    r.store = std::make_shared<FileStore>(method.substr(7), timeout);
  } else {
    throw UsageError(fmt::format(
        "unknown init method '{}': expected env://, tcp://HOST:PORT or file://DIR", method));
  }
  if (!r.store) {
    REPLICA_USAGE_CHECK(port <= 65535 && (port > 0 || r.world_size == 1),
                        "master port {} is out of range (1-65535)", port);
    if (r.rank == 0) {
      // One node: bind exactly MASTER_ADDR; several: every interface, as other nodes reach us
      // through whichever address MASTER_ADDR names.
      auto server = std::make_unique<TcpStoreServer>(
          r.local_world_size == r.world_size ? host : std::string(), port);
      auto client = std::make_shared<TcpStoreClient>(host, server->port(), timeout);
      client->adopt_server(std::move(server));
      r.store = client;
    } else {
      r.store = std::make_shared<TcpStoreClient>(host, port, timeout);
    }
  }

  // Join: each rank marks itself (rank/<r>) and counts in, then waits for every rank's mark (the
  // wait's answer names the missing ones). Rank 0 (the server) returns only after every rank has
  // acknowledged, so it cannot take the store down under a rank still waiting.
  Store& s = *r.store;
  bool file = method.rfind("file://", 0) == 0;
  int64_t seen = s.add(fmt::format("rank/{}", r.rank), 1);
  REPLICA_USAGE_CHECK(seen == 1,
                      "rank {} joined the rendezvous twice: two processes have rank {}{}", r.rank,
                      r.rank, file ? ", or the file:// directory is left from an earlier run" : "");
  int64_t joined = s.add("join", 1);
  REPLICA_USAGE_CHECK(joined <= r.world_size,
                      "{} ranks joined the rendezvous but the world size is {}: do all ranks have "
                      "the same WORLD_SIZE?{}",
                      joined, r.world_size, file ? " (or use a fresh file:// directory)" : "");
  std::vector<std::string> rank_keys;
  for (int i = 0; i < r.world_size; ++i) rank_keys.push_back(fmt::format("rank/{}", i));
  std::vector<std::string> missing;
  try {
    missing = s.wait_for(rank_keys, timeout);
  } catch (const Error& e) {
    throw Error(fmt::format("rendezvous of rank {} failed: {}", r.rank, e.what()));
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 16; ++i)
      list += (i ? ", " : "") + missing[i].substr(5);  // "rank/7" -> "7"
    if (missing.size() > 16) list += fmt::format(" and {} more", missing.size() - 16);
    throw Error(fmt::format(
        "rendezvous timed out after {}: {} of {} ranks joined, missing rank{} {} (store {}): did "
        "every rank start, with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT?",
        format_duration(timeout), r.world_size - static_cast<int>(missing.size()), r.world_size,
        missing.size() == 1 ? "" : "s", list, s.describe()));
  }
  if (s.add("join/ack", 1) == r.world_size) s.set("join/acked", to_bytes("1"));
  if (r.rank == 0) s.wait({"join/acked"}, timeout);
  return r;
}

}  // namespace replica
