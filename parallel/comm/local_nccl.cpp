// The LocalGroup of distinct GPUs (local_group.h), inside libreplica_nccl.so. Its communicators
// come from ncclCommInitAll and are blocking (its only form): calls return once enqueued. A
// failed call is reported with the GPU it was for; a failed group call asks every communicator
// for its asynchronous error, so the message names the GPU(s) in trouble.
#include <nccl.h>

#include "engine/cuda/cuda_check.h"
#include "engine/error.h"
#include "engine/trace.h"
#include "parallel/comm/nccl_plugin.h"

namespace replica {

namespace {

class LocalNcclGroup final : public LocalGroup {
 public:
  explicit LocalNcclGroup(const std::vector<DeviceContext*>& contexts) : LocalGroup(contexts) {
    for (auto* c : ctx_) ordinals_.push_back(c->device().index);
    comms_.resize(ctx_.size());
    const ncclResult_t r = ncclCommInitAll(comms_.data(), int(ordinals_.size()), ordinals_.data());
    if (r != ncclSuccess)
      throw Error(fmt::format("DP over {}: ncclCommInitAll failed: {} ({})", gpu_list(),
                              ncclGetErrorString(r), ncclGetLastError(nullptr)));
  }

  ~LocalNcclGroup() override {
    for (auto c : comms_)
      if (c) ncclCommDestroy(c);
  }

  std::string describe() const override { return "nccl (single process, " + gpu_list() + ")"; }

  // Each device's part is enqueued on its own stream, after the backward that wrote it; the
  // step on device 0's stream comes after the reduce: no events needed.
  void reduce(int, std::vector<Tensor>& parts) override {
    TraceSpan span("comm", "reduce");
    const size_t count = size_t(parts[0].numel());
    if (count == 0 || active_ < 2) return;
    // Every communicator of the clique takes part; devices without samples this step contribute
    // their zeroed gradients.
    group("ncclReduce", [&](size_t i) {
      void* data = parts[i].raw();
      return ncclReduce(data, data, count, ncclFloat, ncclSum, 0, comms_[i],
                        cuda_state(*ctx_[i]).stream);
    });
  }

  void broadcast(std::vector<std::vector<Tensor>>& sets) override {
    TraceSpan span(ctx_[0]->device().str(), "broadcast");
    for (size_t k = 0; k < sets[0].size(); ++k) {
      const size_t count = size_t(sets[0][k].numel());
      if (count == 0) continue;
      group("ncclBroadcast", [&](size_t i) {
        void* data = sets[i][k].raw();
        return ncclBroadcast(data, data, count, ncclFloat, 0, comms_[i],
                             cuda_state(*ctx_[i]).stream);
      });
    }
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

std::unique_ptr<LocalGroup> nccl::make_local(const std::vector<DeviceContext*>& contexts) {
  return std::make_unique<LocalNcclGroup>(contexts);
}

}  // namespace replica
