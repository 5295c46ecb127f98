#include "parallel/comm/root_reducer.h"

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
  cuda_ = ctx_[0]->is_cuda() && !nccl_;
  buckets_ = std::make_unique<BucketReducer>(
      models_, first_bucket_bytes, bucket_bytes,
      [this](int b) {
        TraceSpan span("comm", "reduce");
        const Bucket& bucket = buckets_->buckets()[b];
        if (nccl_) {
          std::vector<Tensor> views;
          for (auto* m : models_) views.push_back(m->flat_grads().view(bucket.offset, {bucket.numel}));
          nccl_->reduce_to_root(views, active_);
        } else {
          reduce_bucket_cpu(bucket);
        }
      },
      "wait_reduce");
  if (cuda_) {
    for (size_t r = 0; r < ctx_.size(); ++r) grads_written_.push_back(std::make_unique<StreamEvent>());
    bool other_gpu = false;
    for (auto* c : ctx_) other_gpu |= c->device().index != ctx_[0]->device().index;
    if (other_gpu) staging_ = ctx_[0]->alloc({models_[0]->num_params()});
  }
}

RootReducer::~RootReducer() = default;

int64_t RootReducer::bytes_per_step(int active) const {
  return int64_t(active - 1) * models_[0]->num_params() * int64_t(sizeof(float));
}

void RootReducer::begin(int active) {
  active_ = active;
  // One replica has nothing to reduce; CUDA logical devices reduce after backward.
  buckets_->begin(active, /*sync=*/active > 1 && !cuda_);
}

void RootReducer::on_ready(int replica, const std::vector<Param*>& params) {
  buckets_->on_ready(replica, params);
}

void RootReducer::backward_done(int replica) {
  if (cuda_) grads_written_[replica]->record(*ctx_[replica]);
}

void RootReducer::reduce_bucket_cpu(const Bucket& b) {
  auto range = [&](int r) { return models_[r]->flat_grads().view(b.offset, {b.numel}); };
  auto add_into = [&](int dst, int src) {
    Tensor d = range(dst);
    ctx_[dst]->ops().add(*ctx_[dst], d, range(src), 1.f);
  };
  sum_in_order(strategy_ == ReduceStrategy::Tree, active_, add_into);
}

void RootReducer::reduce_all_cuda() {
  DeviceContext& root = *ctx_[0];
  for (int r = 1; r < active_; ++r) grads_written_[r]->wait(root);
  // Logical devices share the GPU's memory: add in place. Other GPUs: stage, then add.
  auto add_from = [&](int dst, int src) {
    Tensor d = models_[dst]->flat_grads();
    Tensor s = models_[src]->flat_grads();
    if (ctx_[src]->device().index != root.device().index) {
      root.ops().copy(root, staging_, s);
      s = staging_;
    }
    root.ops().add(root, d, s, 1.f);
  };
  // The tree adds between non-root replicas, which needs them on the root's GPU.
  sum_in_order(strategy_ == ReduceStrategy::Tree && !staging_.defined(), active_, add_from);
}

void RootReducer::finish() {
  if (active_ <= 1) return;
  if (cuda_) {
    TraceSpan span(ctx_[0]->device().str(), "reduce", ctx_[0]);
    reduce_all_cuda();
    return;
  }
  buckets_->finish();  // the buckets of unused parameters too; rethrows a failed reduction
}

}  // namespace replica
