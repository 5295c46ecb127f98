// The NCCL process group: one GPU per rank. Collectives are enqueued on the context's stream,
// so they order after the backward that produced the gradients and before the optimizer step
// without any host sync. Hangs are caught where the host does wait (loss readback,
// end of epoch): wait_idle() polls the stream and ncclCommGetAsyncError until the timeout,
// then aborts the communicator and throws.
#ifdef REPLICA_WITH_NCCL
#include <nccl.h>

#include <cstring>
#include <thread>

#include "engine/cuda/cuda_check.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "parallel/nccl_check.h"
#include "parallel/process_group.h"
#include "parallel/store.h"

namespace replica {

namespace {

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(int rank, int size, Store& store, DeviceContext& ctx, std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size), ctx_(&ctx), timeout_(timeout) {
    ncclUniqueId id;
    if (rank == 0) {
      REPLICA_NCCL_CHECK(ncclGetUniqueId(&id));
      store.set("nccl/unique_id", to_bytes(std::string_view(reinterpret_cast<const char*>(&id),
                                                            sizeof id)));
    }
    const Bytes bytes = store.get("nccl/unique_id");
    REPLICA_CHECK(bytes.size() == sizeof id, "nccl: malformed unique id in the store");
    std::memcpy(&id, bytes.data(), sizeof id);
    ctx.activate();
    // Non-blocking init so a missing peer ends in a timeout, not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    REPLICA_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    poll_until_ready("communicator setup");
    token_ = ctx.alloc({1});
    ctx.ops().fill(ctx, token_, 0.f);
  }

  ~NcclGroup() override {
    if (comm_) ncclCommDestroy(comm_);
  }

  std::string backend() const override { return "nccl"; }

  void allreduce_sum(DeviceContext& ctx, Tensor& t, bool) override {
    if (t.numel() == 0) return;
    REPLICA_NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), ncclFloat, ncclSum,
                                     comm_, cuda_state(ctx).stream));
  }

  void broadcast(DeviceContext& ctx, Tensor& t, int root) override {
    if (t.numel() == 0) return;
    REPLICA_NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), ncclFloat, root, comm_,
                                     cuda_state(ctx).stream));
    wait_idle(ctx, "broadcast");
  }

  // Every rank must arrive: an all-reduce of one float, then wait (with the timeout).
  void barrier() override {
    ctx_->activate();
    allreduce_sum(*ctx_, token_, false);
    wait_idle(*ctx_, "barrier");
  }

  void synchronize(DeviceContext& ctx) override { wait_idle(ctx, "collective"); }

  // Waits until the stream is idle, watching for NCCL errors and the timeout.
  void wait_idle(DeviceContext& ctx, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      cudaError_t q = cudaStreamQuery(cuda_state(ctx).stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) REPLICA_CUDA_CHECK(q);
      check_async(what);
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(fmt::format("nccl {}: rank {} of {} waited more than {} s (a peer died or "
                                "hangs); communicator aborted",
                                what, rank_, size_, timeout_.count() / 1000.0));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  void check_async(const char* what) {
    ncclResult_t async = ncclSuccess;
    REPLICA_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      throw Error(fmt::format("nccl {} failed on rank {}: {}", what, rank_,
                              ncclGetErrorString(async)));
    }
  }

  void poll_until_ready(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      REPLICA_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(fmt::format("nccl {} failed on rank {}: {}", what, rank_,
                                ncclGetErrorString(state)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(fmt::format("nccl {}: rank {} of {} timed out after {} s waiting for peers",
                                what, rank_, size_, timeout_.count() / 1000.0));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  DeviceContext* ctx_;  // outlives the group (both owned by the DDP engine)
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  Tensor token_;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<ProcessGroup> make_nccl_group(int rank, int size, Store& store, DeviceContext& ctx,
                                              std::chrono::milliseconds timeout) {
  return std::make_unique<NcclGroup>(rank, size, store, ctx, timeout);
}

}  // namespace replica
#endif
