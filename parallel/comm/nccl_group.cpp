// The NCCL process group, inside libreplica_nccl.so (with local_nccl.cpp).
//
// Communicators are non-blocking (config.blocking = 0), so a missing or stopped peer ends in a
// timeout rather than a hang. NCCL's contract for them: any call may return ncclInProgress ("not
// settled yet"); the communicator must then be polled with ncclCommGetAsyncError until success
// or a real error, before the next NCCL call or stream work. check() does that for every call,
// bounded by the timeout, then aborts the communicator and fails naming the rank, the call and
// (through the peer monitor) the rank that stopped answering.
//
// Collectives run on a stream of the group's own, after an event on the caller's stream (for a
// gradient bucket, the point its grad hook marked with slot_written, not the later one where the
// communication thread launches it); the caller's stream waits for them only when it asks
// (stream_wait), so bucket all-reduces overlap the rest of backward. With --trace each is timed
// on that stream (StreamTimeline, track "rankR cuda:K nccl stream"), beside backward's kernels.
// Ranks that share one GPU: nccl_placement.h.
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/cuda/cuda_check.h"
#include "engine/cuda/stream_timeline.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "engine/plugin_abi.h"
#include "engine/trace.h"
#include "parallel/comm/nccl_placement.h"
#include "parallel/comm/nccl_plugin.h"
#include "parallel/comm/peer_monitor.h"
#include "parallel/rendezvous/store.h"

namespace replica {

namespace {

using Clock = std::chrono::steady_clock;
// Polls for NCCL's progress sleep at most this long: a waiting host that wakes late leaves the
// GPU idle (a 2 ms nap was 2 ms per step), a shorter one only costs a little host time.
constexpr std::chrono::microseconds kLongestNap{200};

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(const GroupOptions& o, DeviceContext& ctx, std::unique_ptr<PeerMonitor> monitor)
      : ProcessGroup(o, std::move(monitor)), ctx_(&ctx),
        timeline_(fmt::format("rank{} {} nccl stream", o.rank, ctx.device().str())) {
    // Groups are made in the same order on every rank: the count keeps their keys apart.
    static std::atomic<int> groups{0};
    const std::string prefix = fmt::format("nccl/{}/", groups++);
    ctx.activate();
    try {
      set_up(*o.store, prefix, o.address);
    } catch (...) {
      release();  // no destructor runs for a constructor that throws
      throw;
    }
  }

  ~NcclGroup() override { release(); }

  std::string describe() const override {
    if (!shared_gpu_) return "nccl";
    return fmt::format("nccl over sockets, {} ranks on {} GPU{} (a correctness mode: no "
                       "interconnect is measured)",
                       size_, gpus_, gpus_ == 1 ? "" : "s");
  }
  bool shared_gpu() const override { return shared_gpu_; }

  void allreduce_sum(DeviceContext& ctx, Tensor& t, int slot) override {
    if (t.numel() == 0) return;
    enqueue("nccl all-reduce", "allreduce", ctx, [&] {
      return ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), ncclFloat, ncclSum, comm_,
                           stream_);
    }, slot);
  }

  // On the training thread, inside backward: its own lock, not mutex_, which the communication
  // thread holds while NCCL settles a launch.
  void slot_written(DeviceContext& ctx, int slot) override {
    std::lock_guard<std::mutex> lock(written_mutex_);
    ctx.activate();
    if (size_t(slot) >= written_.size()) written_.resize(size_t(slot) + 1);
    Written& w = written_[size_t(slot)];
    if (!w.event) REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&w.event, cudaEventDisableTiming));
    REPLICA_CUDA_CHECK(cudaEventRecord(w.event, cuda_state(ctx).stream));
    w.marked = true;
  }

  void broadcast(DeviceContext& ctx, Tensor& t, int root) override {
    if (t.numel() == 0) return;
    enqueue("nccl broadcast", "broadcast", ctx, [&] {
      return ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), ncclFloat, root, comm_, stream_);
    });
  }

  // Every rank must arrive: an all-reduce of one float, then the host waits (with the timeout).
  void barrier() override {
    allreduce_sum(*ctx_, token_, /*slot=*/-1);
    wait_idle("nccl barrier");
  }

  // Through device memory (NCCL moves device buffers only): int64 values as raw bytes.
  std::vector<int64_t> all_gather(DeviceContext& ctx, const std::vector<int64_t>& mine) override {
    std::vector<int64_t> out(mine.size() * size_t(size_));
    if (mine.empty()) return out;
    // A copy from pageable memory may wait for the stream with no timeout: what the stream
    // waits for is first waited for here, timed.
    wait_idle(nullptr);
    const int64_t words = int64_t(mine.size()) * 2;  // float-sized words of the F32 tensors
    Tensor host_in = Tensor::empty(host_allocator(), {words});
    std::memcpy(host_in.raw(), mine.data(), mine.size() * sizeof(int64_t));
    Tensor dev_in = ctx.alloc({words}), dev_out = ctx.alloc({words * size_});
    ctx.ops().copy(ctx, dev_in, host_in);
    enqueue("nccl all-gather", "all_gather", ctx, [&] {
      return ncclAllGather(dev_in.raw(), dev_out.raw(), mine.size(), ncclInt64, comm_, stream_);
    });
    wait_idle("nccl all-gather");
    stream_wait(ctx);
    Tensor host_out = to_host(ctx, dev_out);
    ctx.synchronize();
    std::memcpy(out.data(), host_out.raw(), out.size() * sizeof(int64_t));
    return out;
  }

  void stream_wait(DeviceContext& ctx) override {
    {
      std::lock_guard<std::mutex> lock(written_mutex_);
      for (Written& w : written_) w.marked = false;  // a mark not used this step is stale
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!enqueued_) return;
    ctx.activate();
    REPLICA_CUDA_CHECK(cudaStreamWaitEvent(cuda_state(ctx).stream, done_, 0));
  }

  void synchronize(DeviceContext&) override {
    wait_idle(nullptr);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!comm_) {  // aborted: what was in flight may never finish
      timeline_.drop();
      return;
    }
    // A DDP step starts here: re-anchoring (a host sync on the idle stream) only when traced.
    if (!enqueued_ || !Tracer::global().recording()) return;
    timeline_.flush();
    timeline_.anchor(stream_);  // idle now (wait_idle): a fresh anchor costs nothing
  }

 private:
  // The communicator: every rank's placement agreed, rank 0's unique id through the store, the
  // group's stream and events, then NCCL's non-blocking set-up (polled to the timeout).
  void set_up(Store& store, const std::string& prefix, const std::string& address) {
    char bus[64] = {0};
    REPLICA_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, ctx_->device().index));
    const NcclPlacement placement = agree_on_placement(store, prefix, rank_, size_, bus, address);
    tell_nccl(placement);
    gpus_ = placement.gpus;
    shared_gpu_ = placement.shared_gpu;
    ncclUniqueId id;
    if (rank_ == 0) {
      check("ncclGetUniqueId", ncclGetUniqueId(&id), /*comm_known=*/false);
      store.set(prefix + "unique_id",
                to_bytes(std::string_view(reinterpret_cast<const char*>(&id), sizeof id)));
    }
    const Bytes bytes = store.get(prefix + "unique_id");
    REPLICA_CHECK(bytes.size() == sizeof id, "nccl: malformed unique id in the store");
    std::memcpy(&id, bytes.data(), sizeof id);

    int least = 0, greatest = 0;
    REPLICA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    REPLICA_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    REPLICA_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    timeline_.anchor(stream_);  // the stream is still empty: no wait

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check("ncclCommInitRankConfig (communicator setup)",
          ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), /*comm_known=*/true);
    token_ = ctx_->alloc({1});
    ctx_->ops().fill(*ctx_, token_, 0.f);
  }

  // Finalize flushes what is still in flight; a peer that never comes makes it time out, and
  // then the communicator is aborted instead. Both return at once on a non-blocking
  // communicator: NCCL finishes the teardown on a thread of its own.
  void release() noexcept {
    if (comm_) {
      try {
        ctx_->activate();
        check("ncclCommFinalize", ncclCommFinalize(comm_), true,
              std::min(timeout_, std::chrono::milliseconds(30000)));
        const ncclResult_t r = ncclCommDestroy(comm_);
        if (r != ncclSuccess && r != ncclInProgress)
          std::fprintf(stderr, "rank %d: ncclCommDestroy: %s\n", rank_, ncclGetErrorString(r));
      } catch (...) {
        if (comm_) ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (done_) cudaEventDestroy(done_);
    if (inputs_ready_) cudaEventDestroy(inputs_ready_);
    for (Written& w : written_)
      if (w.event) cudaEventDestroy(w.event);
    written_.clear();
    if (stream_) cudaStreamDestroy(stream_);
    done_ = inputs_ready_ = nullptr;
    stream_ = nullptr;
  }

  // Runs one NCCL call on the group's stream, after the work already on ctx's stream, or for a
  // slot marked this step (slot_written), after the work up to that mark.
  template <class Call>
  void enqueue(const char* what, const char* phase, DeviceContext& ctx, Call&& call,
               int slot = -1) {
    std::lock_guard<std::mutex> lock(mutex_);
    REPLICA_CHECK(comm_ != nullptr, "{} on rank {}: the communicator was aborted by an earlier "
                  "failure", what, rank_);
    entering(what);
    last_ = what;
    ctx.activate();
    cudaEvent_t mark = nullptr;
    if (slot >= 0) {
      std::lock_guard<std::mutex> written_lock(written_mutex_);
      if (size_t(slot) < written_.size() && written_[size_t(slot)].marked) {
        written_[size_t(slot)].marked = false;
        mark = written_[size_t(slot)].event;
      }
    }
    if (mark) {
      REPLICA_CUDA_CHECK(cudaStreamWaitEvent(stream_, mark, 0));
    } else {
      REPLICA_CUDA_CHECK(cudaEventRecord(inputs_ready_, cuda_state(ctx).stream));
      REPLICA_CUDA_CHECK(cudaStreamWaitEvent(stream_, inputs_ready_, 0));
    }
    const bool timed = timeline_.begin(stream_);
    check(what, call(), true);
    if (timed) timeline_.end(stream_, phase);
    REPLICA_CUDA_CHECK(cudaEventRecord(done_, stream_));
    enqueued_ = true;
    timeline_.poll();
  }

  // The non-blocking contract: ncclInProgress -> poll until the communicator settles.
  void check(const char* what, ncclResult_t r, bool comm_known,
             std::chrono::milliseconds limit = std::chrono::milliseconds(0)) {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress || !comm_known || !comm_)
      abort_and_fail(what, fmt::format("{} ({})", ncclGetErrorString(r), last_error()));
    poll(what, limit.count() ? limit : timeout_, "not settled", [&] { return settled(what); });
  }

  // Host wait for the group's stream, watching NCCL's asynchronous errors and the timeout;
  // `what` names the wait in an error (null: the last collective enqueued).
  void wait_idle(const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!comm_ || !enqueued_) return;
    if (!what) what = last_;
    poll(what, timeout_, "not finished", [&] {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return true;
      if (q != cudaErrorNotReady) REPLICA_CUDA_CHECK(q);
      (void)cudaGetLastError();  // "not yet" is no error: no later check may see it
      settled(what);             // fails on an asynchronous error
      return false;
    });
  }

  // Whether the communicator has settled (no call in progress); an asynchronous error aborts
  // it and fails.
  bool settled(const char* what) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) state = q;
    if (state != ncclSuccess && state != ncclInProgress)
      abort_and_fail(what, fmt::format("{} ({})", ncclGetErrorString(state), last_error()));
    return state == ncclSuccess;
  }

  // Polls until `done()`, with naps growing to kLongestNap; past the budget (`late` says what
  // was not), aborts the communicator and fails.
  template <class Done>
  void poll(const char* what, std::chrono::milliseconds budget, const char* late, Done done) {
    const auto deadline = Clock::now() + budget;
    for (auto nap = std::chrono::microseconds(20); !done(); nap = std::min(nap * 2, kLongestNap)) {
      if (Clock::now() > deadline)
        abort_and_fail(what, fmt::format("{} after {:.1f} s", late, budget.count() / 1000.0));
      std::this_thread::sleep_for(nap);
    }
  }

  std::string last_error() const {
    const char* e = ncclGetLastError(comm_);
    return e && *e ? e : "no further detail from NCCL";
  }

  // Aborting stops the kernels still waiting for a peer, so the process can report and exit.
  [[noreturn]] void abort_and_fail(const char* what, const std::string& detail) {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    fail(what, detail + "; communicator aborted");
  }

  DeviceContext* ctx_;  // outlives the group (make_process_group's contract)
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr, done_ = nullptr;
  // Per bucket slot: where backward finished writing it, if marked this step (slot_written).
  struct Written { cudaEvent_t event = nullptr; bool marked = false; };
  std::vector<Written> written_;  // under written_mutex_
  std::mutex written_mutex_;
  std::mutex mutex_;  // one NCCL call sequence at a time (reducer thread, training thread)
  bool enqueued_ = false;
  const char* last_ = "nccl collective";
  bool shared_gpu_ = false;
  int gpus_ = 1;
  Tensor token_;
  StreamTimeline timeline_;  // device-time spans of the collectives (--trace); under mutex_
};

std::unique_ptr<ProcessGroup> make_group(const GroupOptions& options, DeviceContext& ctx,
                                         std::unique_ptr<PeerMonitor> monitor) {
  return std::make_unique<NcclGroup>(options, ctx, std::move(monitor));
}

std::string version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
}

}  // namespace
}  // namespace replica

extern "C" const void* replica_nccl_plugin(int abi) {
  using namespace replica;
  static const NcclPluginApi api = {make_group, nccl::make_local, version};
  return abi == REPLICA_PLUGIN_ABI ? &api : nullptr;
}
