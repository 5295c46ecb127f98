// DDP: forward and loss on the local batch, backward with bucketed all-reduce launched from the
// grad hook, finalize (wait + average), local optimizer step. BatchNorm buffers are broadcast
// from rank 0 before each training step and before evaluation (PyTorch's broadcast_buffers=True
// does it before every forward), so every rank evaluates with rank 0's running statistics.
#include "parallel/engines/ddp_engine.h"

#include <cstring>

#include "engine/error.h"
#include "engine/env_switch.h"
#include "engine/trace.h"
#include "layers/loss.h"
#include "parallel/comm/bucket_reducer.h"
#include "parallel/comm/rank_agreement.h"
#include "parallel/engines/engine_steps.h"
#include "parallel/engines/scatter.h"

namespace replica {

namespace {

class DdpEngine final : public OneDeviceEngine {
 public:
  DdpEngine(std::unique_ptr<DeviceContext> ctx, std::unique_ptr<ProcessGroup> group,
            const EngineOptions& o, const DdpOptions& d)
      : OneDeviceEngine(std::move(ctx),
                        fmt::format("rank{} {}", group->rank(), ctx->device().str()), o),
        group_(std::move(group)),
        check_sync_(switches::kDdpCheckSync.on()),
        accumulate_(d.accumulate) {
    REPLICA_USAGE_CHECK(d.accumulate >= 1, "--accumulate must be at least 1, got {}", d.accumulate);
    // Buckets of gradients all-reduced during backward (nothing to do for one rank).
    if (group_->size() > 1) {
      reducer_ = std::make_unique<BucketReducer>(
          std::vector<Model*>{model_.get()}, d.first_bucket_bytes, d.bucket_bytes,
          [this](int b) {
            TraceSpan span("comm", "allreduce");
            ctx_.activate();
            const Bucket& bucket = reducer_->buckets()[b];
            Tensor view = model_->flat_grads().view(bucket.offset, {bucket.numel});
            group_->allreduce_sum(ctx_, view, /*slot=*/b);
          },
          "wait_allreduce", [this](int, int b) { group_->slot_written(ctx_, b); });
      model_->set_grad_hook(
          [this](const std::vector<Param*>& ready) { reducer_->on_ready(0, ready); });
      agree_on_model();
    }
    sync_from_rank0();  // identical starting point on every rank
  }

  std::string mode() const override { return "ddp"; }
  std::string comm_description() const override { return group_->describe(); }
  bool shares_gpu() const override { return group_->shared_gpu(); }
  int rank() const override { return group_->rank(); }
  int world_size() const override { return group_->size(); }

  void train_step(const Batch& batch) override {
    REPLICA_CHECK(batch.size() > 0, "empty batch");
    ctx_.run([&] {
      // On a GPU the previous step's kernels wait for its collectives, and the host waits for
      // those kernels untimed in places (a batch's pinned buffer released, a traced span): a
      // stopped peer would hang them there. Waiting here, with the timeout, for what the last
      // step enqueued turns that into the group's error naming the peer. Its all-reduces are
      // done by now unless the host ran ahead: only the optimizer kernels are left on the GPU.
      group_->synchronize(ctx_);
      auto [x, y] = whole_batch_to_device(ctx_, batch, track_);
      broadcast_buffers();
      model_->zero_grad(ctx_);
      // K micro-batches (torch.chunk sizes); the loss gradient of each is scaled by
      // 1/(local batch), so the accumulated gradient is that of the whole local batch.
      const auto micro = scatter_chunks(batch.size(), accumulate_);
      int last = 0;
      for (int k = 0; k < accumulate_; ++k)
        if (micro[k].count > 0) last = k;
      for (int k = 0; k <= last; ++k) {
        Tensor xk = x.slice_rows(micro[k].begin, micro[k].begin + micro[k].count);
        Tensor yk = y.slice_rows(micro[k].begin, micro[k].begin + micro[k].count);
        {
          TraceSpan span(track_, "forward", &ctx_);
          Tensor logits = model_->forward(ctx_, xk);
          Tensor loss = step_.criterion.forward(ctx_, logits, yk);
          if (last == 0) {
            step_.loss = loss;
          } else {
            // Micro-batch losses are summed into a buffer of the step's own.
            if (k == 0) {
              step_.loss = ctx_.alloc({1});
              ctx_.ops().fill(ctx_, step_.loss, 0.f);
            }
            ctx_.ops().add(ctx_, step_.loss, loss, float(micro[k].count) / float(batch.size()));
          }
        }
        if (reducer_) reducer_->begin(1, /*sync=*/k == last);  // no_sync but for the last
        {
          TraceSpan span(track_, "backward", &ctx_);
          model_->backward(ctx_, step_.criterion.backward(ctx_, batch.size()));
        }
      }
      {
        TraceSpan span(track_, "finalize", &ctx_);
        if (reducer_) {
          reducer_->finish();
          group_->stream_wait(ctx_);  // GPU: the step's kernels wait for the last bucket
          ctx_.ops().scale(ctx_, model_->flat_grads(), 1.f / float(group_->size()));  // mean
          settle_for_trace();
        }
      }
      {
        TraceSpan span(track_, "step", &ctx_);
        step_.optimizer->step(ctx_, model_->flat_params(), model_->flat_grads());
      }
      if (check_sync_) verify_in_sync();
    });
    step_.note_forward(model_->last_forward_macs(), batch.size());
  }

  // After the step-start wait for the last step's collectives, which train_step does too: a
  // stopped peer is then named within the timeout, not waited for where staging allocates.
  void prefetch(const Batch& next) override {
    ctx_.run([&] { group_->synchronize(ctx_); });
    prefetcher_.stage(ctx_, next, 0, next.size(), BatchParts::Both, track_);
  }
  float last_loss() override {
    ctx_.run([&] { group_->synchronize(ctx_); });  // a failed collective surfaces here
    return step_.read_loss(ctx_);
  }

  // Sums each rank's evaluation totals, so every rank reports the same metrics.
  // On a GPU a copy to or from pageable host memory blocks the host until the stream gets
  // there, with no timeout; so the collectives the stream waits for (the step's buckets, then
  // this all-reduce) are first waited for by the group, which times out and names a stopped
  // peer instead of hanging.
  void reduce_metrics(std::vector<double>& values) override {
    if (group_->size() <= 1 || values.empty()) return;
    ctx_.run([&] {
      group_->synchronize(ctx_);
      Tensor host = Tensor::empty(host_allocator(), {int64_t(values.size())});
      for (size_t i = 0; i < values.size(); ++i) host.f32()[i] = float(values[i]);
      Tensor dev = batch_to_device(ctx_, host);
      group_->allreduce_sum(ctx_, dev);
      group_->synchronize(ctx_);
      group_->stream_wait(ctx_);
      ctx_.ops().copy(ctx_, host, dev);
      ctx_.synchronize();
      for (size_t i = 0; i < values.size(); ++i) values[i] = host.f32()[i];
    });
  }

  std::vector<int64_t> gather_from_ranks(const std::vector<int64_t>& mine) override {
    std::vector<int64_t> all;
    ctx_.run([&] { all = group_->all_gather(ctx_, mine); });
    return all;
  }

  void synchronize() override {
    ctx_.run([&] {
      group_->synchronize(ctx_);
      ctx_.synchronize();
    });
  }
  void state_loaded() override { sync_from_rank0(); }
  // After the last step each rank's BatchNorm statistics hold its own batch; evaluation reads
  // rank 0's, as PyTorch's DDP (whose eval forwards broadcast them too) and the model rank 0
  // saves.
  void set_training(bool training) override {
    if (!training) ctx_.run([&] { broadcast_buffers(); });
    OneDeviceEngine::set_training(training);
  }
  void finish() override {
    ctx_.run([&] { group_->leave(ctx_); });
  }

  int64_t comm_bytes_per_step() const override {
    // Every rank all-reduces the whole gradient once per step.
    return group_->size() > 1 ? model_->num_params() * int64_t(sizeof(float)) : 0;
  }

 private:
  // A traced span on a GPU ends with an untimed device sync (engine/trace.h); before it, the
  // collectives the stream now waits for are waited for with the timeout.
  void settle_for_trace() {
    if (Tracer::global().sync_device()) group_->synchronize(ctx_);
  }

  // Rank 0's BatchNorm statistics to every rank, before a forward reads them (PyTorch's
  // broadcast_buffers=True). On the context's thread.
  void broadcast_buffers() {
    if (model_->num_buffer_elements() == 0 || group_->size() <= 1) return;
    TraceSpan span(track_, "broadcast_buffers", &ctx_);
    group_->broadcast(ctx_, model_->flat_buffers(), 0);
    group_->stream_wait(ctx_);  // the forward reads them
    settle_for_trace();
  }

  // Debug check (REPLICA_DDP_CHECK_SYNC=1): rank 0's parameters, broadcast, must equal this
  // rank's bit for bit after every step.
  void verify_in_sync() {
    if (group_->size() <= 1) return;
    group_->synchronize(ctx_);  // timed waits before the untimed pageable copies (reduce_metrics)
    Tensor theirs = ctx_.alloc({model_->num_params()});
    ctx_.ops().copy(ctx_, theirs, model_->flat_params());
    group_->broadcast(ctx_, theirs, 0);
    group_->synchronize(ctx_);
    group_->stream_wait(ctx_);
    Tensor mine = to_host(ctx_, model_->flat_params()), host = to_host(ctx_, theirs);
    ctx_.synchronize();
    REPLICA_CHECK(std::memcmp(mine.raw(), host.raw(), mine.bytes()) == 0,
                  "rank {}: parameters differ from rank 0's after step {}", group_->rank(),
                  step_.optimizer->steps());
  }

  // Before the first broadcast: every rank built the same model and buckets, or all stop with
  // one error (rank_agreement.h) instead of Gloo aborting on mismatched sizes.
  void agree_on_model() {
    std::string shapes, bounds;
    for (const Param* p : model_->params()) shapes += p->name + shape_str(p->value.shape()) + ";";
    for (const Bucket& b : reducer_->buckets()) bounds += fmt::format("{}+{};", b.offset, b.numel);
    const std::string same_model =
        "give every rank the same --model, --input-shape and --num-classes";
    const std::string same_buckets = "give every rank the same --bucket-cap-mb";
    const std::vector<Agreed> items = {
        {"the number of parameters", model_->num_params(), true, same_model},
        {"the parameters' names and shapes", int64_t(text_hash(shapes)), false, same_model},
        {"the number of buffer elements", model_->num_buffer_elements(), true, same_model},
        {"the number of gradient buckets", int64_t(reducer_->buckets().size()), true, same_buckets},
        {"the gradient buckets' bounds", int64_t(text_hash(bounds)), false, same_buckets}};
    require_same_on_every_rank(
        items, [this](const std::vector<int64_t>& mine) { return gather_from_ranks(mine); });
  }

  void sync_from_rank0() {
    if (group_->size() <= 1) return;
    ctx_.run([&] {
      group_->broadcast(ctx_, model_->flat_params(), 0);
      if (model_->num_buffer_elements() > 0) group_->broadcast(ctx_, model_->flat_buffers(), 0);
      group_->stream_wait(ctx_);
      group_->synchronize(ctx_);
    });
  }

  // Destroyed in reverse: the reducer (its thread calls the group), the group (NCCL finalizes
  // on the context's device), then the base's model and, last, the context.
  std::unique_ptr<ProcessGroup> group_;
  std::unique_ptr<BucketReducer> reducer_;
  bool check_sync_;
  int accumulate_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_ddp_engine(const Device& device, const GroupOptions& group,
                                             const EngineOptions& options, const DdpOptions& ddp) {
  auto ctx = std::make_unique<DeviceContext>(device,
                                             context_options(options, options.threads_per_device));
  ctx->activate();  // NCCL sets up its communicator on the current device
  auto made = make_process_group(group, *ctx);
  return std::make_unique<DdpEngine>(std::move(ctx), std::move(made), options, ddp);
}

}  // namespace replica
