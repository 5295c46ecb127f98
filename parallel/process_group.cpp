#include "parallel/process_group.h"

#include "engine/error.h"

namespace replica {

namespace {

class SingleProcessGroup final : public ProcessGroup {
 public:
  SingleProcessGroup() : ProcessGroup(0, 1) {}
  std::string backend() const override { return "none"; }
  void allreduce_sum(DeviceContext&, Tensor&, bool) override {}
  void broadcast(DeviceContext&, Tensor&, int) override {}
  void barrier() override {}
};

}  // namespace

std::unique_ptr<ProcessGroup> make_single_process_group() {
  return std::make_unique<SingleProcessGroup>();
}

#ifndef REPLICA_WITH_GLOO
bool gloo_available() { return false; }
std::unique_ptr<ProcessGroup> make_gloo_group(int, int, Store&, const std::string&,
                                              std::chrono::milliseconds) {
  throw UsageError("this build of replica has no Gloo backend (install libgloo-dev, rebuild)");
}
#endif

#ifndef REPLICA_WITH_NCCL
bool nccl_available() { return false; }
std::unique_ptr<ProcessGroup> make_nccl_group(int, int, Store&, DeviceContext&,
                                              std::chrono::milliseconds) {
  throw UsageError("this build of replica has no NCCL backend");
}
#endif

}  // namespace replica
