// Reaching the NCCL plugin from the rest of parallel/ (nccl_plugin.h).
#include "parallel/comm/nccl_plugin.h"

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

}  // namespace replica
