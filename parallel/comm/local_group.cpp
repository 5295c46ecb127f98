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

LocalGroup::LocalGroup(std::vector<DeviceContext*> contexts, int slots)
    : ctx_(std::move(contexts)), active_(int(ctx_.size())), marks_(ctx_.size()) {
  for (Marks& m : marks_) {
    m.slot = std::vector<StreamEvent>(size_t(slots));
    m.this_step.assign(size_t(slots), 0);
  }
}

void LocalGroup::begin(int active) {
  active_ = active;
  for (size_t r = 0; r < marks_.size(); ++r) {
    std::fill(marks_[r].this_step.begin(), marks_[r].this_step.end(), 0);
    if (int(r) < active) continue;
    ctx_[r]->activate();
    all_written(int(r));
  }
  ctx_[0]->activate();
}

void LocalGroup::slot_written(int rank, int slot) {
  Marks& m = marks_[size_t(rank)];
  m.slot[size_t(slot)].record(*ctx_[size_t(rank)]);
  m.this_step[size_t(slot)] = 1;
}

StreamEvent& LocalGroup::written(int rank, int slot) {
  Marks& m = marks_[size_t(rank)];
  return m.this_step[size_t(slot)] ? m.slot[size_t(slot)] : m.all;
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
      : LocalGroup(std::move(contexts), slots), pool_(pool), strategy_(strategy) {
    if (!ctx_[0]->is_cuda()) return;
    comm_ctx_ = std::make_unique<DeviceContext>(ctx_[0]->device());
    bool other_gpu = false;
    for (auto* c : ctx_) other_gpu |= c->device().index != ctx_[0]->device().index;
    // From device 0's allocator, so the engine's peak memory counts it.
    if (other_gpu) staging_ = ctx_[0]->alloc({largest_slot});
  }

  void reduce(int slot, std::vector<Tensor>& parts) override {
    TraceSpan span("comm", "reduce", comm_ctx_.get());
    if (comm_ctx_) {  // the communication stream waits until every active rank wrote `slot`
      comm_ctx_->activate();
      for (int r = 0; r < active_; ++r) written(r, slot).wait(*comm_ctx_);
    }
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
  WorkerPool& pool_;
  ReduceStrategy strategy_;
  // CUDA: the communication context (device 0, a stream of its own) and the events that order
  // it beside the ranks' "written" marks: "reduced" (-> device 0) and "root ready" (-> the
  // broadcast's copies).
  std::unique_ptr<DeviceContext> comm_ctx_;
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
