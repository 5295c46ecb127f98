// Reaching the NCCL plugin from the rest of parallel/ (nccl_plugin.h).
#include "parallel/comm/nccl_plugin.h"

#include <set>

#include "engine/error.h"
#include "engine/plugin.h"
#include "engine/plugin_abi.h"

namespace replica {

const NcclPluginApi* nccl_plugin(std::string* why) {
  struct Loaded {
    const NcclPluginApi* api = nullptr;
    std::string problem;
  };
  static const Loaded loaded = [] {
    Loaded l;
    l.api = static_cast<const NcclPluginApi*>(
        Plugin::get("replica_nccl").table(REPLICA_PLUGIN_ABI, &l.problem));
    return l;
  }();
  if (!loaded.api && why) *why = loaded.problem;
  return loaded.api;
}

std::string nccl_version() {
  std::string why;
  const NcclPluginApi* api = nccl_plugin(&why);
  return api ? api->version() : why;
}

bool LocalNccl::usable(const std::vector<DeviceContext*>& contexts) {
  if (contexts.size() < 2) return false;
  std::set<int> gpus;
  for (auto* c : contexts) {
    if (!c->is_cuda()) return false;
    gpus.insert(c->device().index);
  }
  return gpus.size() == contexts.size() && nccl_plugin() != nullptr;
}

std::unique_ptr<LocalNccl> LocalNccl::create(const std::vector<DeviceContext*>& contexts) {
  std::string why;
  const NcclPluginApi* api = nccl_plugin(&why);
  REPLICA_CHECK(api != nullptr, "DP over distinct GPUs needs NCCL, which {}", why);
  REPLICA_CHECK(usable(contexts), "single-process NCCL needs two or more distinct GPUs");
  return api->make_local(contexts);
}

}  // namespace replica
