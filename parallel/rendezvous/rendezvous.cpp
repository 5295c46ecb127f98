#include "parallel/rendezvous/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "engine/error.h"

namespace replica {

using std::chrono::milliseconds;

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int parse_int(const std::string& what, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text.c_str(), &end, 10);
  REPLICA_USAGE_CHECK(!text.empty() && *end == '\0' && (errno == 0 || errno == ERANGE) && v >= 0,
                      "{}='{}' is not a non-negative integer", what, text);
  REPLICA_USAGE_CHECK(errno == 0 && v < (1L << 30), "{}='{}' is too large", what, text);
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
  // The rendezvous waits for every rank's key in one request.
  REPLICA_USAGE_CHECK(r.world_size <= int(Store::kMaxKeysPerRequest),
                      "{}: world size {} is more than the {} ranks a job can have", source,
                      r.world_size, Store::kMaxKeysPerRequest);
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

std::string local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return "";
  std::string address;
  for (addrinfo* a = found; a && address.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    // A datagram socket's connect only picks the route (and with it the source address).
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&local);
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&local);
      const void* ip = local.ss_family == AF_INET6 ? static_cast<const void*>(&v6->sin6_addr)
                                                   : static_cast<const void*>(&v4->sin_addr);
      if (inet_ntop(local.ss_family, ip, text, sizeof text)) address = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return address;
}

std::chrono::milliseconds timeout_from_seconds(double s, const char* flag) {
  constexpr double kWeek = 7 * 24 * 3600;
  REPLICA_USAGE_CHECK(std::isfinite(s) && s >= 0.001 && s <= kWeek,
                      "{} must be between 0.001 and {:.0f} seconds (a week), got {}", flag, kWeek,
                      s);
  return std::chrono::milliseconds(std::llround(s * 1000));
}

Rendezvous rendezvous_env_ranks() {
  // Launchers that name all four numbers (torchrun's and replica-launch's, Open MPI's); Slurm
  // gives the local world size in its own notation.
  struct Scheme {
    const char *source, *rank, *world, *local_world, *local_rank;
  };
  static const Scheme kSchemes[] = {
      {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"},
      {"OMPI_COMM_WORLD_*", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
  };
  Rendezvous r;
  for (const Scheme& s : kSchemes) {
    // One without the other is a launcher half set up: neither trains alone.
    REPLICA_USAGE_CHECK(!env(s.rank) == !env(s.world), "{} is set but {} is not: set both",
                        env(s.rank) ? s.rank : s.world, env(s.rank) ? s.world : s.rank);
    if (!env(s.rank)) continue;
    r.rank = env_int(s.rank, 0);
    r.world_size = env_int(s.world, 1);
    r.local_world_size = env_int(s.local_world, r.world_size);
    r.local_rank = env_int(s.local_rank, r.rank % std::max(r.local_world_size, 1));
    validate(r, s.source);
    return r;
  }
  if (env("SLURM_PROCID")) {
    r.rank = env_int("SLURM_PROCID", 0);
    r.world_size = env_int("SLURM_NTASKS", 1);
    int local = slurm_tasks_on_node(env("SLURM_TASKS_PER_NODE"), env_int("SLURM_NODEID", 0));
    r.local_world_size = local > 0 ? local : env_int("SLURM_NNODES", 1) == 1 ? r.world_size : 1;
    r.local_rank = env_int("SLURM_LOCALID", r.rank % std::max(r.local_world_size, 1));
    validate(r, "SLURM_PROCID/SLURM_NTASKS");
  }
  return r;
}

namespace {

// "[::1]" -> "::1": an IPv6 address as URLs write it, in MASTER_ADDR or tcp://[::1]:P.
std::string unbracketed(std::string host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

InitMethod parse_init_method(const std::string& method) {
  InitMethod m;
  if (method == "env://") return m;
  if (method.rfind("tcp://", 0) == 0) {
    const std::string rest = method.substr(6);
    const size_t colon = rest.rfind(':');
    REPLICA_USAGE_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(),
                        "init method '{}': expected tcp://HOST:PORT", method);
    m.kind = InitMethod::Tcp;
    m.host = unbracketed(rest.substr(0, colon));
    m.port = parse_int("tcp:// port", rest.substr(colon + 1));
    REPLICA_USAGE_CHECK(m.port <= 65535, "master port {} is out of range (1-65535)", m.port);
    return m;
  }
  if (method.rfind("file://", 0) == 0) {
    REPLICA_USAGE_CHECK(method.size() > 7, "init method '{}': expected file://DIR", method);
    m.kind = InitMethod::File;
    m.dir = method.substr(7);
    return m;
  }
  throw UsageError(fmt::format(
      "unknown init method '{}': expected env://, tcp://HOST:PORT or file://DIR", method));
}

namespace {

// Connects r to the store every rank uses: a directory for file://, else rank 0's TCP server at
// the address env:// (MASTER_ADDR/MASTER_PORT) or tcp://HOST:PORT names. Sets r.store and
// r.address (the address peers reach r at).
void connect_store(const std::string& method, Rendezvous& r, milliseconds timeout) {
  const InitMethod m = parse_init_method(method);
  std::string host = m.host;
  int port = m.port;
  if (m.kind == InitMethod::Env) {
    const char* a = env("MASTER_ADDR");
    const char* p = env("MASTER_PORT");
    REPLICA_USAGE_CHECK((a && p) || r.world_size == 1,
                        "env:// rendezvous needs MASTER_ADDR and MASTER_PORT (rank 0's address "
                        "and a free port): start the ranks with replica-launch, or set both");
    host = unbracketed(a ? a : "127.0.0.1");
    port = p ? parse_int("MASTER_PORT", p) : 0;  // one process: any free port
  } else if (m.kind == InitMethod::File) {
    r.store = std::make_shared<FileStore>(m.dir, timeout);
    // No server to route to: toward MASTER_ADDR if set; on one node, loopback; across nodes
    // (a shared directory), the host name (GLOO_SOCKET_IFNAME names an interface instead).
    if (const char* a = env("MASTER_ADDR")) {
      r.address = local_address_toward(unbracketed(a));
    } else if (r.local_world_size < r.world_size) {
      char name[256] = {0};
      gethostname(name, sizeof name - 1);
      r.address = name;
    }
    if (r.address.empty()) r.address = "127.0.0.1";
    return;
  }
  REPLICA_USAGE_CHECK(port <= 65535 && (port > 0 || r.world_size == 1),
                      "master port {} is out of range (1-65535)", port);
  // Peers reach this rank where its route to rank 0's node starts (their own node's address,
  // not MASTER_ADDR, which is rank 0's); the host itself if no route is known.
  r.address = local_address_toward(host);
  if (r.address.empty()) r.address = host;
  if (r.rank != 0) {
    r.store = std::make_shared<TcpStoreClient>(host, port, timeout);
    return;
  }
  // One node: bind exactly MASTER_ADDR; several: every interface, as other nodes reach us
  // through whichever address MASTER_ADDR names.
  auto server = std::make_unique<TcpStoreServer>(
      r.local_world_size == r.world_size ? host : std::string(), port);
  const int bound = server->port();
  r.store = std::make_shared<TcpStoreClient>(host, bound, timeout, std::move(server));
}

// Join: each rank marks itself (rank/<r>) and counts in, then waits for every rank's mark (the
// wait's answer names the missing ones). Rank 0 (the server) returns only after every rank has
// acknowledged, so it cannot take the store down under a rank still waiting.
void join(Store& s, const Rendezvous& r, bool file_store, milliseconds timeout) {
  int64_t seen = s.add(fmt::format("rank/{}", r.rank), 1);
  REPLICA_USAGE_CHECK(seen == 1,
                      "rank {} joined the rendezvous twice: two processes have rank {}{}", r.rank,
                      r.rank,
                      file_store ? ", or the file:// directory is left from an earlier run" : "");
  int64_t joined = s.add("join", 1);
  REPLICA_USAGE_CHECK(joined <= r.world_size,
                      "{} ranks joined the rendezvous but the world size is {}: do all ranks have "
                      "the same WORLD_SIZE?{}",
                      joined, r.world_size,
                      file_store ? " (or use a fresh file:// directory)" : "");
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
}

}  // namespace

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
  connect_store(method, r, options.timeout);
  join(*r.store, r, method.rfind("file://", 0) == 0, options.timeout);
  return r;
}

}  // namespace replica
