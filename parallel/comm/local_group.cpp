// LocalGroup by copies and adds (CPU devices; logical devices of one GPU; GPUs without NCCL),
// and the factory that picks NCCL for distinct GPUs (local_group.h).
#include "parallel/comm/local_group.h"

#include <algorithm>
#include <set>

#include "engine/error.h"
#include "engine/ops.h"
#include "engine/trace.h"
#include "parallel/comm/nccl_plugin.h"
#include "parallel/comm/worker_pool.h"

namespace replica {

ReduceStrategy parse_reduce_strategy(const std::string& name) {
  if (name == "root") return ReduceStrategy::ToRoot;
  if (name == "tree") return ReduceStrategy::Tree;
  throw UsageError(fmt::format("unknown --reduce '{}' (root, tree)", name));
}

namespace {

// The fixed order of the adds: add(dst, src) sums rank src into rank dst. To-root: rank 0 adds
// 1, 2, ... in turn (PyTorch's); tree: pairs at stride 1, 2, 4, ... (Caffe's, log2 rounds).
template <class Add>
void sum_in_order(bool tree, int active, Add&& add) {
  if (!tree) {
    for (int r = 1; r < active; ++r) add(0, r);
    return;
  }
  for (int stride = 1; stride < active; stride *= 2)
    for (int r = 0; r + stride < active; r += 2 * stride) add(r, r + stride);
}

class CopyGroup final : public LocalGroup {
 public:
  CopyGroup(std::vector<DeviceContext*> contexts, WorkerPool& pool, ReduceStrategy strategy,
            int slots, int64_t largest_slot)
      : LocalGroup(std::move(contexts)), pool_(pool), strategy_(strategy) {
    if (!ctx_[0]->is_cuda()) return;
    comm_ctx_ = std::make_unique<DeviceContext>(ctx_[0]->device());
    for (size_t r = 0; r < ctx_.size(); ++r) {
      all_written_.push_back(std::make_unique<StreamEvent>());
      slot_written_.emplace_back();
      for (int s = 0; s < slots; ++s) slot_written_[r].push_back(std::make_unique<StreamEvent>());
    }
    written_this_step_.assign(ctx_.size(), std::vector<char>(size_t(slots), 0));
    bool other_gpu = false;
    for (auto* c : ctx_) other_gpu |= c->device().index != ctx_[0]->device().index;
    // From device 0's allocator, so the engine's peak memory counts it.
    if (other_gpu) staging_ = ctx_[0]->alloc({largest_slot});
  }

  void begin(int active) override {
    active_ = active;
    for (auto& row : written_this_step_) std::fill(row.begin(), row.end(), 0);
  }

  void slot_written(int rank, int slot) override {
    if (!comm_ctx_) return;
    slot_written_[rank][slot]->record(*ctx_[rank]);
    written_this_step_[rank][slot] = 1;
  }

  void all_written(int rank) override {
    if (comm_ctx_) all_written_[rank]->record(*ctx_[rank]);
  }

  void reduce(int slot, std::vector<Tensor>& parts) override {
    TraceSpan span("comm", "reduce", comm_ctx_.get());
    if (comm_ctx_) wait_for_slot(slot);
    auto add_into = [&](int dst, int src) {
      Tensor s = parts[src];
      DeviceContext& on = comm_ctx_ ? *comm_ctx_ : *ctx_[dst];
      if (staging_.defined() && ctx_[src]->device().index != on.device().index) {
        Tensor stage = staging_.view(0, {s.numel()});
        on.ops().copy(on, stage, s);
        s = stage;
      }
      on.ops().add(on, parts[dst], s, 1.f);
    };
    // The tree adds between ranks other than 0, which needs them on one GPU (or on the CPU).
    sum_in_order(strategy_ == ReduceStrategy::Tree && !staging_.defined(), active_, add_into);
  }

  void reduced() override {
    if (!comm_ctx_) return;
    reduced_.record(*comm_ctx_);
    reduced_.wait(*ctx_[0]);
  }

  // Each rank copies on its own worker, its stream waiting for device 0's work so far.
  void broadcast(std::vector<std::vector<Tensor>>& sets) override {
    DeviceContext& c0 = *ctx_[0];
    if (comm_ctx_) c0.run([&] { root_ready_.record(c0); });
    pool_.run([&](int r) {
      if (r == 0) return;
      DeviceContext& c = *ctx_[r];
      c.run([&] {
        TraceSpan span(c.device().str(), "broadcast", &c);
        root_ready_.wait(c);
        for (size_t k = 0; k < sets[r].size(); ++k)
          if (sets[r][k].numel() > 0) c.ops().copy(c, sets[r][k], sets[0][k]);
      });
    });
  }

 private:
  // The communication stream waits until every active rank has written `slot`. A slot reduced
  // without having been recorded this step (parameters that got no gradient) waits for the
  // rank's whole backward instead.
  void wait_for_slot(int slot) {
    comm_ctx_->activate();
    for (int r = 0; r < active_; ++r) {
      StreamEvent& written =
          written_this_step_[r][slot] ? *slot_written_[r][slot] : *all_written_[r];
      written.wait(*comm_ctx_);
    }
  }

  WorkerPool& pool_;
  ReduceStrategy strategy_;
  // CUDA: the communication context (device 0, a stream of its own) and the events that order
  // it: per rank and slot "written" ([r][s], with whether it was recorded this step), per rank
  // "all written", "reduced" (-> device 0) and "root ready" (-> the broadcast's copies).
  std::unique_ptr<DeviceContext> comm_ctx_;
  std::vector<std::vector<std::unique_ptr<StreamEvent>>> slot_written_;
  std::vector<std::vector<char>> written_this_step_;
  std::vector<std::unique_ptr<StreamEvent>> all_written_;
  StreamEvent reduced_, root_ready_;
  Tensor staging_;  // a rank on another GPU lands here before the add (one slot at a time)
};

// Two or more distinct GPUs, and an NCCL plugin that loads.
bool nccl_fits(const std::vector<DeviceContext*>& contexts) {
  if (contexts.size() < 2) return false;
  std::set<int> gpus;
  for (auto* c : contexts) {
    if (!c->is_cuda()) return false;
    gpus.insert(c->device().index);
  }
  return gpus.size() == contexts.size() && nccl_plugin() != nullptr;
}

}  // namespace

std::unique_ptr<LocalGroup> make_local_group(std::vector<DeviceContext*> contexts,
                                             WorkerPool& pool, ReduceStrategy strategy,
                                             int slots, int64_t largest_slot) {
  REPLICA_CHECK(int(contexts.size()) == pool.size(), "{} devices but {} workers",
                contexts.size(), pool.size());
  if (nccl_fits(contexts)) return nccl_plugin()->make_local(contexts, slots);
  return std::make_unique<CopyGroup>(std::move(contexts), pool, strategy, slots, largest_slot);
}

}  // namespace replica
