// The GPU plugins (engine/plugin.h): where the build made them, they must load and hand out
// their tables on every machine, GPU or not (a plugin that fails to load would otherwise only
// show on a GPU machine); without a driver, no program loads them on its own.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "engine/cudart.h"
#include "engine/device.h"
#include "engine/plugin.h"
#include "engine/plugin_abi.h"
#include "parallel/comm/nccl_plugin.h"
#include "parallel/comm/process_group.h"

using namespace replica;

namespace {

// Whether the running process has mapped a shared object whose name contains `name`.
bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("without a driver, counting GPUs loads no GPU library") {
  if (cuda_device_count() > 0) {
    MESSAGE("a GPU is present: nothing to check here");
    return;
  }
  CHECK(cuda_device_count() == 0);
  CHECK_FALSE(mapped("libreplica_cuda"));
  CHECK_FALSE(mapped("libcublas"));
  CHECK_FALSE(mapped("libcudnn"));
  CHECK_FALSE(mapped("libnccl"));
  CHECK_FALSE(cuda_backend_note().empty());
}

TEST_CASE("the CUDA backend plugin loads where it was built") {
  const Plugin& p = Plugin::get("replica_cuda");
  if (!REPLICA_EXPECT_CUDA_PLUGIN) {
    CHECK_FALSE(p.found());
    CHECK(cudart::load_problem().find("is not built") != std::string::npos);
    return;
  }
  INFO(p.problem());
  REQUIRE(p.loaded());
  CHECK(cudart::load_problem().empty());
  CHECK(mapped("libcublas"));
  // The plugin's own answer (no driver here: zero, not a crash).
  const auto* api = static_cast<const CudaPluginApi*>(p.table(REPLICA_PLUGIN_ABI));
  REQUIRE(api != nullptr);
  CHECK(api->device_count() >= 0);
  CHECK(api->versions().find("cuDNN") != std::string::npos);
}

TEST_CASE("a plugin built from other headers is refused with a clear message") {
  const Plugin& p = Plugin::get("replica_cuda");
  if (!p.loaded()) return;
  std::string why;
  CHECK(p.table(REPLICA_PLUGIN_ABI + 1, &why) == nullptr);
  CHECK(why.find("rebuild") != std::string::npos);
}

TEST_CASE("the NCCL plugin loads where it was built") {
  std::string why;
  const NcclPluginApi* api = nccl_plugin(&why);
  if (!REPLICA_EXPECT_NCCL_PLUGIN) {
    CHECK(api == nullptr);
    CHECK_FALSE(nccl_available());
    return;
  }
  INFO(why);
  REQUIRE(api != nullptr);
  CHECK(nccl_available());
  CHECK(nccl_version().find('.') != std::string::npos);
  CHECK(mapped("libnccl"));
}

TEST_CASE("a missing plugin says how to build it") {
  const Plugin& p = Plugin::get("replica_no_such_plugin");
  CHECK_FALSE(p.loaded());
  CHECK(p.problem().find("cmake --build build --target replica_no_such_plugin") !=
        std::string::npos);
  std::string why;
  CHECK(p.table(REPLICA_PLUGIN_ABI, &why) == nullptr);
  CHECK(why == p.problem());
}
