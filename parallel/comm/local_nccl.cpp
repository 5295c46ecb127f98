// The LocalGroup of distinct GPUs (local_group.h), inside libreplica_nccl.so. Its communicators
// come from ncclCommInitAll and are blocking (its only form): calls return once enqueued. A
// failed call is reported with the GPU it was for; a failed group call asks every communicator
// for its asynchronous error, so the message names the GPU(s) in trouble.
//
// Every GPU's collectives run on a communication stream of its own, so bucket k's reduce neither
// waits behind the backward kernels queued after bucket k was written nor holds them up. Events
// order the two streams of each GPU:
//   compute -> comm   a bucket's "written" event (or the rank's whole backward, for a bucket it
//                     never wrote this step), and before a broadcast everything queued so far;
//   comm -> compute   after the last reduce and after a broadcast, each GPU's compute stream
//                     waits for its communication stream before it touches gradients or
//                     parameters again.
#include <nccl.h>

#include <memory>
#include <mutex>

#include "engine/cuda/cuda_check.h"
#include "engine/error.h"
#include "engine/trace.h"
#include "parallel/comm/nccl_plugin.h"

namespace replica {

namespace {

class LocalNcclGroup final : public LocalGroup {
 public:
  LocalNcclGroup(const std::vector<DeviceContext*>& contexts, int slots)
      : LocalGroup(contexts, slots) {
    for (auto* c : ctx_) {
      ordinals_.push_back(c->device().index);
      auto rank = std::make_unique<Rank>();
      rank->comm = std::make_unique<DeviceContext>(c->device());
      ranks_.push_back(std::move(rank));
    }
    comms_.resize(ctx_.size());
    const ncclResult_t r = ncclCommInitAll(comms_.data(), int(ordinals_.size()), ordinals_.data());
    if (r != ncclSuccess)
      throw Error(fmt::format("DP over {}: ncclCommInitAll failed: {} ({})", gpu_list(),
                              ncclGetErrorString(r), ncclGetLastError(nullptr)));
    ctx_[0]->activate();
  }

  ~LocalNcclGroup() override {
    for (auto c : comms_)
      if (c) ncclCommDestroy(c);
  }

  void reduce(int slot, std::vector<Tensor>& parts) override {
    TraceSpan span("comm", "reduce", ranks_[0]->comm.get());
    const size_t count = size_t(parts[0].numel());
    if (count == 0 || active_ < 2) return;
    // Every communicator of the clique takes part; devices without samples this step contribute
    // their zeroed gradients (their "all written" mark is begin()'s).
    for (size_t i = 0; i < ranks_.size(); ++i) {
      ranks_[i]->comm->activate();
      written(int(i), slot).wait(*ranks_[i]->comm);
    }
    group("ncclReduce", [&](size_t i) {
      void* data = parts[i].raw();
      return ncclReduce(data, data, count, ncclFloat, ncclSum, 0, comms_[i], comm_stream(i));
    });
    ctx_[0]->activate();
  }

  void reduced() override { rejoin(); }

  void broadcast(std::vector<std::vector<Tensor>>& sets) override {
    TraceSpan span(ctx_[0]->device().str(), "broadcast", ranks_[0]->comm.get());
    // Rank 0's parameters are final (its step is queued) and every other rank is done reading
    // its own (its backward is queued): each communication stream starts after both.
    ctx_[0]->activate();
    root_ready_.record(*ctx_[0]);
    for (size_t i = 0; i < ranks_.size(); ++i) {
      Rank& r = *ranks_[i];
      ctx_[i]->activate();
      r.compute_mark.record(*ctx_[i]);
      r.comm->activate();
      r.compute_mark.wait(*r.comm);
      root_ready_.wait(*r.comm);
    }
    for (size_t k = 0; k < sets[0].size(); ++k) {
      const size_t count = size_t(sets[0][k].numel());
      if (count == 0) continue;
      group("ncclBroadcast", [&](size_t i) {
        void* data = sets[i][k].raw();
        return ncclBroadcast(data, data, count, ncclFloat, 0, comms_[i], comm_stream(i));
      });
    }
    rejoin();
  }

 private:
  struct Rank {
    std::unique_ptr<DeviceContext> comm;  // the GPU's communication stream
    StreamEvent compute_mark, comm_mark;
  };

  cudaStream_t comm_stream(size_t i) const { return cuda_state(*ranks_[i]->comm).stream; }

  // Each GPU's compute stream waits for everything on its communication stream so far.
  void rejoin() {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      Rank& r = *ranks_[i];
      r.comm->activate();
      r.comm_mark.record(*r.comm);
      r.comm_mark.wait(*ctx_[i]);
    }
    ctx_[0]->activate();
  }

  std::string gpu_list() const {
    std::string s = "GPUs ";
    for (size_t i = 0; i < ordinals_.size(); ++i)
      s += (i ? "," : "") + std::to_string(ordinals_[i]);
    return s;
  }

  // call(i) for every device inside one group call, each with its GPU current; no cudaFree of
  // the process runs meanwhile (device_free_mutex, engine/cuda/cuda_check.h).
  template <class Call>
  void group(const char* what, Call&& call) {
    std::lock_guard<std::mutex> lock(device_free_mutex());
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) fail(what, "ncclGroupStart", r, -1);
    for (size_t i = 0; i < comms_.size(); ++i) {
      ranks_[i]->comm->activate();
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

  std::vector<int> ordinals_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // StreamEvents do not move
  StreamEvent root_ready_;  // rank 0's compute stream before a broadcast
};

}  // namespace

std::unique_ptr<LocalGroup> nccl::make_local(const std::vector<DeviceContext*>& contexts,
                                             int slots) {
  return std::make_unique<LocalNcclGroup>(contexts, slots);
}

}  // namespace replica
