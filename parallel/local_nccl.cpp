#include "parallel/local_nccl.h"

#include <set>

#include "engine/error.h"

#ifdef REPLICA_WITH_NCCL
#include <nccl.h>

#include "engine/cuda/cuda_check.h"
#include "parallel/nccl_check.h"
#endif

namespace replica {

bool LocalNccl::usable(const std::vector<DeviceContext*>& contexts) {
#ifdef REPLICA_WITH_NCCL
  if (contexts.size() < 2) return false;
  std::set<int> gpus;
  for (auto* c : contexts) {
    if (!c->is_cuda()) return false;
    gpus.insert(c->device().index);
  }
  return gpus.size() == contexts.size();
#else
  return false;
#endif
}

#ifdef REPLICA_WITH_NCCL

struct LocalNccl::Impl {
  std::vector<DeviceContext*> ctx;
  std::vector<ncclComm_t> comms;
};

LocalNccl::LocalNccl(const std::vector<DeviceContext*>& contexts) : impl_(new Impl) {
  REPLICA_CHECK(usable(contexts), "single-process NCCL needs two or more distinct GPUs");
  impl_->ctx = contexts;
  std::vector<int> ordinals;
  for (auto* c : contexts) ordinals.push_back(c->device().index);
  impl_->comms.resize(contexts.size());
  REPLICA_NCCL_CHECK(
      ncclCommInitAll(impl_->comms.data(), int(ordinals.size()), ordinals.data()));
}

LocalNccl::~LocalNccl() {
  for (auto c : impl_->comms)
    if (c) ncclCommDestroy(c);
}

void LocalNccl::reduce_to_root(std::vector<Tensor>& buffers, int active) {
  const size_t count = size_t(buffers[0].numel());
  if (count == 0 || active < 2) return;
  // Every communicator of the clique takes part; devices without samples this step contribute
  // their zeroed gradients.
  REPLICA_NCCL_CHECK(ncclGroupStart());
  for (size_t i = 0; i < impl_->comms.size(); ++i) {
    impl_->ctx[i]->activate();
    void* data = buffers[i].raw();
    REPLICA_NCCL_CHECK(ncclReduce(data, data, count, ncclFloat, ncclSum, 0, impl_->comms[i],
                                 cuda_state(*impl_->ctx[i]).stream));
  }
  REPLICA_NCCL_CHECK(ncclGroupEnd());
}

void LocalNccl::broadcast_from_root(std::vector<Tensor>& buffers) {
  const size_t count = size_t(buffers[0].numel());
  if (count == 0) return;
  REPLICA_NCCL_CHECK(ncclGroupStart());
  for (size_t i = 0; i < impl_->comms.size(); ++i) {
    impl_->ctx[i]->activate();
    void* data = buffers[i].raw();
    REPLICA_NCCL_CHECK(ncclBroadcast(data, data, count, ncclFloat, 0, impl_->comms[i],
                                    cuda_state(*impl_->ctx[i]).stream));
  }
  REPLICA_NCCL_CHECK(ncclGroupEnd());
}

#else

struct LocalNccl::Impl {};
LocalNccl::LocalNccl(const std::vector<DeviceContext*>&) {
  throw Error("this build of replica has no NCCL");
}
LocalNccl::~LocalNccl() = default;
void LocalNccl::reduce_to_root(std::vector<Tensor>&, int) {}
void LocalNccl::broadcast_from_root(std::vector<Tensor>&) {}

#endif

}  // namespace replica
