#include "parallel/comm/nccl_placement.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>

#include "engine/cuda/cuda_check.h"
#include "engine/error.h"

namespace replica {

namespace {

std::string hostname() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

// This boot of this machine's kernel, as NCCL itself tells hosts apart: cloned machines may
// share a hostname, never a boot id.
std::string boot_id() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof buf, f)) id = buf;
    std::fclose(f);
  }
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

// Where this rank's GPU is, "host:boot id/bus id": two ranks with the same string use one GPU.
std::string gpu_identity(int ordinal) {
  char bus[64] = {0};
  REPLICA_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, ordinal));
  return hostname() + ":" + boot_id() + "/" + bus;
}

bool loopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "localhost" || address == "::1";
}

// Set only where the user has not: their setting wins.
void set_default_env(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  if (!v || !*v) setenv(name, value.c_str(), 1);
}

}  // namespace

// Ranks in network namespaces of one machine share its GPU but not its "lo": their sockets go
// over loopback only when every rank's address is a loopback one.
NcclPlacement agree_on_placement(Store& store, const std::string& prefix, int rank, int size,
                                 int ordinal, const std::string& address) {
  store.set(prefix + fmt::format("gpu/{}", rank),
            to_bytes(gpu_identity(ordinal) + " " + address));
  std::set<std::string> gpus;
  bool all_loopback = true;
  for (int r = 0; r < size; ++r) {
    const std::string entry = to_string(store.get(prefix + fmt::format("gpu/{}", r)));
    const size_t space = entry.rfind(' ');
    gpus.insert(entry.substr(0, space));
    all_loopback &= space != std::string::npos && loopback(entry.substr(space + 1));
  }
  NcclPlacement placement{int(gpus.size()), int(gpus.size()) < size};
  if (!placement.shared_gpu) return placement;
  setenv("NCCL_HOSTID", fmt::format("replica-{}-rank{}", hostname(), rank).c_str(), 1);
  setenv("NCCL_NET", "Socket", 1);
  if (all_loopback) set_default_env("NCCL_SOCKET_IFNAME", "lo");
  return placement;
}

}  // namespace replica
