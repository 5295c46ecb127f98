// The NCCL plugin (libreplica_nccl.so, built from nccl_group.cpp and local_nccl.cpp): the table it
// hands out, and how the rest of parallel/ reaches it. Loaded the first time a program asks for
// NCCL, so no other program loads NCCL or the CUDA stack (engine/plugin.h).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/context.h"
#include "parallel/comm/local_group.h"
#include "parallel/comm/process_group.h"

namespace replica {

class PeerMonitor;

struct NcclPluginApi {
  std::unique_ptr<ProcessGroup> (*make_group)(const GroupOptions& options, DeviceContext& ctx,
                                              std::unique_ptr<PeerMonitor> monitor);
  // DP over distinct GPUs; `slots`: how many buckets a step reduces (local_group.h).
  std::unique_ptr<LocalGroup> (*make_local)(const std::vector<DeviceContext*>& contexts,
                                            int slots);
  std::string (*version)();  // "2.28.9"
};

// The plugin's table, or null when NCCL cannot be used here (*why: one line saying why).
const NcclPluginApi* nccl_plugin(std::string* why = nullptr);

// NCCL's version ("2.28.9"), or why there is none ("not built (...)").
std::string nccl_version();

// DP's group over distinct GPUs (local_nccl.cpp), put in the table by nccl_group.cpp.
namespace nccl {
std::unique_ptr<LocalGroup> make_local(const std::vector<DeviceContext*>& contexts, int slots);
}  // namespace nccl

}  // namespace replica
