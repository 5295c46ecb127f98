// LocalNccl's implementation, inside libreplica_nccl.so. These communicators come from
// ncclCommInitAll and are blocking (its only form): calls return once enqueued. A failed call
// is reported with the GPU it was for; a failed group call asks every communicator for its
// asynchronous error, so the message names the GPU(s) in trouble.
#include <nccl.h>

#include "engine/cuda/cuda_check.h"
#include "engine/error.h"
#include "parallel/comm/nccl_plugin.h"

namespace replica {

namespace {

class LocalNcclImpl final : public LocalNccl {
 public:
  explicit LocalNcclImpl(const std::vector<DeviceContext*>& contexts) : ctx_(contexts) {
    for (auto* c : contexts) ordinals_.push_back(c->device().index);
    comms_.resize(contexts.size());
    const ncclResult_t r = ncclCommInitAll(comms_.data(), int(ordinals_.size()), ordinals_.data());
    if (r != ncclSuccess)
      throw Error(fmt::format("DP over {}: ncclCommInitAll failed: {} ({})", gpu_list(),
                              ncclGetErrorString(r), ncclGetLastError(nullptr)));
  }

  ~LocalNcclImpl() override {
    for (auto c : comms_)
      if (c) ncclCommDestroy(c);
  }

  void reduce_to_root(std::vector<Tensor>& buffers, int active) override {
    const size_t count = size_t(buffers[0].numel());
    if (count == 0 || active < 2) return;
    // Every communicator of the clique takes part; devices without samples this step contribute
    // their zeroed gradients.
    group("ncclReduce", [&](size_t i) {
      void* data = buffers[i].raw();
      return ncclReduce(data, data, count, ncclFloat, ncclSum, 0, comms_[i],
                        cuda_state(*ctx_[i]).stream);
    });
  }

  void broadcast_from_root(std::vector<Tensor>& buffers) override {
    const size_t count = size_t(buffers[0].numel());
    if (count == 0) return;
    group("ncclBroadcast", [&](size_t i) {
      void* data = buffers[i].raw();
      return ncclBroadcast(data, data, count, ncclFloat, 0, comms_[i],
                           cuda_state(*ctx_[i]).stream);
    });
  }

 private:
  std::string gpu_list() const {
    std::string s = "GPUs ";
    for (size_t i = 0; i < ordinals_.size(); ++i) s += (i ? "," : "") + std::to_string(ordinals_[i]);
    return s;
  }

  // call(i) for every device inside one group call.
  template <class Call>
  void group(const char* what, Call&& call) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) fail(what, "ncclGroupStart", r, -1);
    for (size_t i = 0; i < comms_.size(); ++i) {
      ctx_[i]->activate();
      r = call(i);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        fail(what, what, r, int(i));
      }
    }
    r = ncclGroupEnd();
    if (r != ncclSuccess) fail(what, "ncclGroupEnd", r, -1);
  }

  // Names the GPU of a failed per-device call, or every GPU whose communicator reports an
  // asynchronous error after a failed group call.
  [[noreturn]] void fail(const char* what, const char* call, ncclResult_t r, int device) {
    std::string where;
    if (device >= 0) {
      where = fmt::format("GPU {}", ordinals_[size_t(device)]);
    } else {
      for (size_t i = 0; i < comms_.size(); ++i) {
        ncclResult_t a = ncclSuccess;
        if (ncclCommGetAsyncError(comms_[i], &a) == ncclSuccess && a != ncclSuccess)
          where += fmt::format("{}GPU {}: {}", where.empty() ? "" : "; ", ordinals_[i],
                               ncclGetErrorString(a));
      }
      if (where.empty()) where = "no GPU reports an error of its own";
    }
    throw Error(fmt::format("DP over {}: {} ({}) failed: {} ({}): {}", gpu_list(), what, call,
                            ncclGetErrorString(r), ncclGetLastError(nullptr), where));
  }

  std::vector<DeviceContext*> ctx_;
  std::vector<int> ordinals_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<LocalNccl> nccl::make_local(const std::vector<DeviceContext*>& contexts) {
  return std::make_unique<LocalNcclImpl>(contexts);
}

}  // namespace replica
