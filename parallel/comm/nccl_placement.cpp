#include "parallel/comm/nccl_placement.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>

#include <fmt/format.h>

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

bool loopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "localhost" || address == "::1";
}

}  // namespace

std::string machine_id() { return hostname() + ":" + boot_id(); }

NcclPlacement agree_on_placement(Store& store, const std::string& prefix, int rank, int size,
                                 const std::string& gpu_bus_id, const std::string& address) {
  // "host:boot/bus address": two ranks with the same text before the space use one GPU.
  const std::string gpu = machine_id() + "/" + gpu_bus_id;
  store.set(prefix + fmt::format("gpu/{}", rank), to_bytes(gpu + " " + address));
  std::set<std::string> gpus;
  bool all_loopback = true;
  for (int r = 0; r < size; ++r) {
    const std::string entry = to_string(store.get(prefix + fmt::format("gpu/{}", r)));
    const size_t space = entry.rfind(' ');
    gpus.insert(entry.substr(0, space));
    all_loopback &= space != std::string::npos && loopback(entry.substr(space + 1));
  }
  NcclPlacement p;
  p.gpus = int(gpus.size());
  p.shared_gpu = p.gpus < size;
  if (p.shared_gpu) {
    p.host_id = fmt::format("replica-{}-rank{}", hostname(), rank);
    p.loopback_sockets = all_loopback;
  }
  return p;
}

void tell_nccl(const NcclPlacement& p) {
  if (!p.shared_gpu) return;
  setenv("NCCL_HOSTID", p.host_id.c_str(), 1);
  setenv("NCCL_NET", "Socket", 1);
  const char* ifname = std::getenv("NCCL_SOCKET_IFNAME");
  if (p.loopback_sockets && (!ifname || !*ifname)) setenv("NCCL_SOCKET_IFNAME", "lo", 1);
}

}  // namespace replica
