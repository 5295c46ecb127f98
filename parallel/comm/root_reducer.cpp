#include "parallel/comm/root_reducer.h"

#include <algorithm>

#include "engine/error.h"
#include "engine/trace.h"

namespace replica {

ReduceStrategy parse_reduce_strategy(const std::string& name) {
  if (name == "root") return ReduceStrategy::ToRoot;
  if (name == "tree") return ReduceStrategy::Tree;
  throw UsageError(fmt::format("unknown reduction '{}' (root, tree)", name));
}

namespace {

// The fixed order of the adds: add(dst, src) sums replica src into replica dst. To-root: replica
// 0 adds 1, 2, ... in turn; tree: pairs at stride 1, 2, 4, ... (log2(active) rounds).
template <class Add>
void sum_in_order(bool tree, int active, Add&& add) {
  if (!tree) {
    for (int r = 1; r < active; ++r) add(0, r);
    return;
  }
  for (int stride = 1; stride < active; stride *= 2)
    for (int r = 0; r + stride < active; r += 2 * stride) add(r, r + stride);
}

}  // namespace

RootReducer::RootReducer(std::vector<DeviceContext*> contexts, std::vector<Model*> models,
                         ReduceStrategy strategy, size_t first_bucket_bytes, size_t bucket_bytes)
    : ctx_(std::move(contexts)), models_(std::move(models)), strategy_(strategy) {
  if (LocalNccl::usable(ctx_)) nccl_ = LocalNccl::create(ctx_);
  if (ctx_[0]->is_cuda() && !nccl_) {
    ContextOptions lean;
    lean.reserve_workspace = false;  // it copies and adds: no cuDNN workspace
    comm_ctx_ = std::make_unique<DeviceContext>(ctx_[0]->device(), lean);
  }
  buckets_ = std::make_unique<BucketReducer>(
      models_, first_bucket_bytes, bucket_bytes,
      [this](int b) {
        TraceSpan span("comm", "reduce", comm_ctx_.get());
        const Bucket& bucket = buckets_->buckets()[b];
        if (nccl_) {
          std::vector<Tensor> views;
          for (auto* m : models_) views.push_back(m->flat_grads().view(bucket.offset, {bucket.numel}));
          nccl_->reduce_to_root(views, active_);
          return;
        }
        if (comm_ctx_) wait_for_bucket(b);
        reduce_bucket(bucket);
      },
      "wait_reduce",
      [this](int r, int b) {
        if (!comm_ctx_) return;
        bucket_written_[r][b]->record(*ctx_[r]);  // on r's thread, r's device current
        written_this_step_[r][b] = 1;
      });
  if (comm_ctx_) {
    const size_t n = buckets_->buckets().size();
    int64_t largest = 0;
    for (const Bucket& b : buckets_->buckets()) largest = std::max(largest, b.numel);
    for (size_t r = 0; r < ctx_.size(); ++r) {
      grads_written_.push_back(std::make_unique<StreamEvent>());
      bucket_written_.emplace_back();
      for (size_t b = 0; b < n; ++b) bucket_written_[r].push_back(std::make_unique<StreamEvent>());
    }
    written_this_step_.assign(ctx_.size(), std::vector<char>(n, 0));
    bool other_gpu = false;
    for (auto* c : ctx_) other_gpu |= c->device().index != ctx_[0]->device().index;
    // From device 0's allocator, so the engine's peak memory counts it.
    if (other_gpu) staging_ = ctx_[0]->alloc({largest});
  }
}

// The communication thread (inside buckets_) may still be running a bucket when backward threw
// and finish() never ran: it stops before the contexts, events and buffers it uses go.
RootReducer::~RootReducer() { buckets_.reset(); }

int64_t RootReducer::bytes_per_step(int active) const {
  return int64_t(active - 1) * models_[0]->num_params() * int64_t(sizeof(float));
}

void RootReducer::begin(int active) {
  active_ = active;
  for (auto& row : written_this_step_) std::fill(row.begin(), row.end(), 0);
  buckets_->begin(active, /*sync=*/active > 1);  // one replica has nothing to reduce
}

void RootReducer::on_ready(int replica, const std::vector<Param*>& params) {
  buckets_->on_ready(replica, params);
}

void RootReducer::backward_done(int replica) {
  if (comm_ctx_) grads_written_[replica]->record(*ctx_[replica]);
}

void RootReducer::wait_for_bucket(int b) {
  comm_ctx_->activate();
  for (int r = 0; r < active_; ++r) {
    // A bucket launched by finish() (parameters without gradients) was not recorded this step:
    // the replica's whole backward is what it waits for then.
    StreamEvent& written = written_this_step_[r][b] ? *bucket_written_[r][b] : *grads_written_[r];
    written.wait(*comm_ctx_);
  }
}

void RootReducer::reduce_bucket(const Bucket& b) {
  auto range = [&](int r) { return models_[r]->flat_grads().view(b.offset, {b.numel}); };
  auto add_into = [&](int dst, int src) {
    Tensor d = range(dst);
    Tensor s = range(src);
    DeviceContext& on = comm_ctx_ ? *comm_ctx_ : *ctx_[dst];
    if (staging_.defined() && ctx_[src]->device().index != on.device().index) {
      Tensor stage = staging_.view(0, {b.numel});
      on.ops().copy(on, stage, s);
      s = stage;
    }
    on.ops().add(on, d, s, 1.f);
  };
  // The tree adds between non-root replicas, which needs them on one GPU (or on the CPU).
  sum_in_order(strategy_ == ReduceStrategy::Tree && !staging_.defined(), active_, add_into);
}

void RootReducer::finish() {
  if (active_ <= 1) return;
  buckets_->finish();  // the buckets of unused parameters too; rethrows a failed reduction
  if (comm_ctx_) {
    reduced_.record(*comm_ctx_);
    reduced_.wait(*ctx_[0]);
  }
}

}  // namespace replica
