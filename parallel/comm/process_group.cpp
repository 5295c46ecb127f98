// The process group's shared parts: the group of one, the factory, failure reports.
#include "parallel/comm/process_group.h"

#include <net/if.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "engine/error.h"
#include "parallel/comm/nccl_plugin.h"
#include "parallel/comm/peer_monitor.h"
#include "parallel/rendezvous/store.h"

namespace replica {

namespace {

class SingleProcessGroup final : public ProcessGroup {
 public:
  SingleProcessGroup() : ProcessGroup(GroupOptions{}, nullptr) {}
  std::string describe() const override { return "none"; }
  void allreduce_sum(DeviceContext&, Tensor&, int) override {}
  void broadcast(DeviceContext&, Tensor&, int) override {}
  void barrier() override {}
  std::vector<int64_t> all_gather(DeviceContext&, const std::vector<int64_t>& mine) override {
    return mine;
  }
};

}  // namespace

CommBackend parse_comm_backend(const std::string& name) {
  if (name == "gloo") return CommBackend::Gloo;
  if (name == "nccl") return CommBackend::Nccl;
  throw UsageError(fmt::format("unknown --backend '{}' (gloo, nccl)", name));
}

ProcessGroup::ProcessGroup(const GroupOptions& o, std::unique_ptr<PeerMonitor> monitor)
    : rank_(o.rank), size_(o.size), monitor_(std::move(monitor)), store_(o.store),
      timeout_(o.timeout) {}

void ProcessGroup::leave(DeviceContext& ctx) {
  if (size_ <= 1 || !store_) return;
  synchronize(ctx);
  // Groups leave in the same order on every rank: the count keeps their keys apart.
  static std::atomic<int> leaves{0};
  const std::string prefix = fmt::format("leave/{}/", leaves++);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto wait_for_all = [&](const std::string& key) {
    int64_t count;
    while ((count = store_->add(key, 0)) < size_) {
      REPLICA_CHECK(std::chrono::steady_clock::now() < deadline,
                    "rank {}: only {} of {} ranks reached the end of the job ({})", rank_, count,
                    size_, key);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  store_->add(prefix + "done", 1);
  wait_for_all(prefix + "done");
  if (monitor_) monitor_->stop();  // every rank is done: no heartbeat after "left"
  store_->add(prefix + "left", 1);
  if (rank_ != 0) return;
  wait_for_all(prefix + "left");
  store_->remove_keys();  // nobody writes to it any more: a file:// directory is clean again
}
ProcessGroup::~ProcessGroup() = default;

void ProcessGroup::entering(const char* what) {
  if (monitor_) monitor_->entering(what);
}

void ProcessGroup::fail(const std::string& what, const std::string& detail) const {
  if (!monitor_)
    throw Error(fmt::format("{} failed on rank {} of {}: {}", what, rank_, size_, detail));
  PeerMonitor::Finding f = monitor_->diagnose();
  throw PeerFailure(fmt::format("{} failed on rank {} of {}: {} ({})", what, rank_, size_,
                                f.text, detail),
                    f.silent);
}

std::string nccl_problem() {
  std::string why;
  return nccl_plugin(&why) ? "" : why;
}

void check_gloo_interface() {
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  REPLICA_USAGE_CHECK(!iface || !*iface || if_nametoindex(iface) != 0,
                      "GLOO_SOCKET_IFNAME={}: this machine has no network interface of that "
                      "name (`ip -br link` lists them)",
                      iface);
}

void check_nccl_usable(const Device& device) {
  // Worded alike on every rank, so a launcher prints it once; the device first, as it is what
  // the user typed.
  REPLICA_USAGE_CHECK(device.is_cuda(), "--backend nccl needs a GPU per rank; these ranks run on "
                      "CPU devices (use --backend gloo)");
  const std::string why = nccl_problem();
  REPLICA_USAGE_CHECK(why.empty(), "--backend nccl: NCCL {}", why);
}

GroupOptions group_options(const Rendezvous& rv, CommBackend backend,
                           std::chrono::milliseconds timeout) {
  return {backend, rv.rank, rv.world_size, rv.store, rv.address, timeout};
}

std::unique_ptr<ProcessGroup> make_process_group(const GroupOptions& o, DeviceContext& ctx) {
  if (o.size <= 1) return std::make_unique<SingleProcessGroup>();
  REPLICA_USAGE_CHECK(o.store != nullptr, "a process group of {} ranks needs a rendezvous store",
                      o.size);
  // Beating before the group connects: a failure while connecting is diagnosed too.
  auto monitor = std::make_unique<PeerMonitor>(
      o.store->connect_again(std::min(o.timeout, std::chrono::milliseconds(5000))), o.rank,
      o.size);
  if (o.backend == CommBackend::Nccl) {
    check_nccl_usable(ctx.device());
    return nccl_plugin(nullptr)->make_group(o, ctx, std::move(monitor));
  }
  return make_gloo_group(o, std::move(monitor));
}

#ifndef REPLICA_WITH_GLOO
bool gloo_available() { return false; }
std::unique_ptr<ProcessGroup> make_gloo_group(const GroupOptions&,
                                              std::unique_ptr<PeerMonitor>) {
  throw UsageError("this build of replica has no Gloo backend (install libgloo-dev, rebuild)");
}
#endif

}  // namespace replica
