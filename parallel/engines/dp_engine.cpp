// DataParallel: one process, one long-lived worker thread per device, one model replica each.
// An iteration: scatter the batch (each worker copies its own chunk), forward on every replica,
// gather the outputs on device 0, loss and its gradient there, scatter the output gradient,
// backward on every replica while buckets of gradients are summed into replica 0, optimizer
// step on device 0, broadcast the parameters and buffers (BatchNorm statistics follow device 0).
// The collectives are a LocalGroup's (parallel/comm/local_group.h), launched bucket by bucket by
// the BucketReducer that DDP uses too.
#include <algorithm>
#include <optional>

#include "engine/error.h"
#include "engine/trace.h"
#include "layers/loss.h"
#include "parallel/comm/bucket_reducer.h"
#include "parallel/comm/worker_pool.h"
#include "parallel/engines/dp_engine.h"
#include "parallel/engines/engine_steps.h"
#include "parallel/engines/scatter.h"

namespace replica {

namespace {

class DataParallelEngine final : public TrainEngine {
 public:
  DataParallelEngine(const std::vector<Device>& devices, const EngineOptions& o,
                     const DpOptions& dp)
      : pool_(static_cast<int>(devices.size())) {
    const int n = static_cast<int>(devices.size());
    const int threads =
        o.threads_per_device > 0 ? o.threads_per_device : std::max(1, cpu_cores() / n);
    replicas_.resize(n);
    // Contexts and replicas are created on their own worker threads (CUDA: current device).
    pool_.run([&](int i) {
      Replica& r = replicas_[i];
      r.ctx = std::make_unique<DeviceContext>(devices[i], context_options(o, threads));
      r.track = devices[i].str();
      r.model = make_model(o.model, o.input_shape, o.num_classes);
      r.ctx->run([&] { r.model->materialize(*r.ctx, o.seed); });
      r.model->set_grad_hook([this, i](const std::vector<Param*>& ready) {
        reducer_->on_ready(i, ready);
      });
    });
    build_reduction(dp);
    step_.emplace(primary(), o.optimizer);
    prefetcher_ = std::make_unique<BatchPrefetcher>(contexts(), o.prefetch_on_cpu);
  }

  // Buckets of gradients summed into replica 0 as backward finishes them on every replica.
  void build_reduction(const DpOptions& dp) {
    std::vector<Model*> models;
    for (auto& r : replicas_) models.push_back(r.model.get());
    reducer_ = std::make_unique<BucketReducer>(
        models, dp.first_bucket_bytes, dp.bucket_bytes,
        [this](int b) {  // on the communication thread, one bucket at a time
          const Bucket& bucket = reducer_->buckets()[b];
          for (size_t r = 0; r < replicas_.size(); ++r)
            bucket_parts_[r] = replicas_[r].model->flat_grads().view(bucket.offset, {bucket.numel});
          group_->reduce(b, bucket_parts_);
        },
        "wait_reduce", [this](int r, int b) { group_->slot_written(r, b); });
    bucket_parts_.resize(replicas_.size());
    int64_t largest = 0;
    for (const Bucket& b : reducer_->buckets()) largest = std::max(largest, b.numel);
    group_ = make_local_group(contexts(), pool_, dp.strategy, int(reducer_->buckets().size()),
                              largest);
  }

  std::string mode() const override { return "dp"; }
  std::vector<Device> devices() const override {
    std::vector<Device> d;
    for (const auto& r : replicas_) d.push_back(r.ctx->device());
    return d;
  }
  std::vector<DeviceContext*> contexts() override {
    std::vector<DeviceContext*> c;
    for (auto& r : replicas_) c.push_back(r.ctx.get());
    return c;
  }

  void train_step(const Batch& batch) override {
    const int64_t total = batch.size();
    REPLICA_CHECK(total > 0, "empty batch");
    const int n = static_cast<int>(replicas_.size());
    const auto chunks = scatter_chunks(total, n);
    int active = 0;
    while (active < n && chunks[active].count > 0) ++active;
    last_active_ = active;

    scatter_forward(batch, chunks, active);
    const Tensor dlogits = gather_loss(batch, chunks, active);
    backward_reduce(dlogits, chunks, active);
    DeviceContext& c0 = primary();
    c0.run([&] {
      TraceSpan span(replicas_[0].track, "step", &c0);
      step_->optimizer->step(c0, replicas_[0].model->flat_params(),
                             replicas_[0].model->flat_grads());
    });
    if (n > 1) broadcast();
    double macs = 0;
    for (int i = 0; i < active; ++i) macs += replicas_[i].model->last_forward_macs();
    step_->note_forward(macs, total);
  }

  // Each replica's chunk of the images, and the labels on device 0, as train_step asks for
  // them; staged from this thread between steps, when no worker touches the contexts.
  void prefetch(const Batch& next) override {
    const auto chunks = scatter_chunks(next.size(), static_cast<int>(replicas_.size()));
    for (size_t i = 0; i < replicas_.size(); ++i) {
      const int64_t b = chunks[i].begin, e = b + chunks[i].count;
      if (e > b) prefetcher_->stage(*replicas_[i].ctx, next, b, e, BatchParts::Images,
                                    replicas_[i].track);
    }
    prefetcher_->stage(primary(), next, 0, next.size(), BatchParts::Labels, replicas_[0].track);
  }

  bool prefetches() const override { return prefetcher_->active(); }

  float last_loss() override { return step_->read_loss(primary()); }

  // Evaluation: each replica takes its chunk of the batch (every replica holds the same
  // parameters); the per-chunk loss sums and hit counts are added up, in device order.
  void eval_batch(const Batch& batch, EvalSums& sums) override {
    const int n = static_cast<int>(replicas_.size());
    const auto chunks = scatter_chunks(batch.size(), n);
    std::vector<EvalSums> per_replica(n);
    pool_.run([&](int i) {
      if (chunks[i].count == 0) return;
      Replica& r = replicas_[i];
      const int64_t b = chunks[i].begin, e = b + chunks[i].count;
      CrossEntropyLoss criterion;  // per worker: the criterion keeps state between calls
      evaluate_batch(*r.ctx, *r.model, criterion, batch, b, e, per_replica[i]);
    });
    for (const EvalSums& s : per_replica) sums += s;
  }

  void set_training(bool training) override {
    for (auto& r : replicas_) r.model->set_training(training);
  }
  void synchronize() override {
    pool_.run([&](int i) { replicas_[i].ctx->synchronize(); });
  }
  Model& model() override { return *replicas_[0].model; }
  std::vector<Model*> models() override {
    std::vector<Model*> out;
    for (Replica& r : replicas_) out.push_back(r.model.get());
    return out;
  }
  DeviceContext& primary() override { return *replicas_[0].ctx; }
  Optimizer& optimizer() override { return *step_->optimizer; }
  void state_loaded() override { broadcast(); }
  double forward_macs_per_sample() const override { return step_->macs_per_sample; }
  // Gradient bytes moved to device 0 in one step.
  int64_t comm_bytes_per_step() const override {
    return int64_t(last_active_ - 1) * replicas_[0].model->num_params() * int64_t(sizeof(float));
  }

 private:
  struct Replica {
    std::unique_ptr<DeviceContext> ctx;
    std::unique_ptr<Model> model;
    std::string track;
    Tensor x, logits;
    std::unique_ptr<StreamEvent> forward_done = std::make_unique<StreamEvent>();
  };

  // Scatter + forward: each worker copies its own chunk of the host batch and runs forward.
  void scatter_forward(const Batch& batch, const std::vector<Chunk>& chunks, int active) {
    pool_.run([&](int i) {
      Replica& r = replicas_[i];
      if (i >= active) {
        // Idle this step (small batch): zero gradients, which a NCCL reduce still includes.
        r.ctx->run([&] { r.model->zero_grad(*r.ctx); });
        return;
      }
      const int64_t b = chunks[i].begin, e = b + chunks[i].count;
      r.ctx->run([&] {
        {
          TraceSpan span(r.track, "scatter", r.ctx.get());
          r.x = batch_rows(*r.ctx, batch, b, e, BatchParts::Images).images;
        }
        TraceSpan span(r.track, "forward", r.ctx.get());
        r.model->zero_grad(*r.ctx);
        r.logits = r.model->forward(*r.ctx, r.x);
        r.forward_done->record(*r.ctx);
      });
    });
  }

  // Gathers the outputs on device 0; the loss and its gradient over the whole batch there.
  Tensor gather_loss(const Batch& batch, const std::vector<Chunk>& chunks, int active) {
    DeviceContext& c0 = primary();
    Tensor dlogits;
    c0.run([&] {
      TraceSpan span(replicas_[0].track, "gather_loss", &c0);
      const int64_t classes = replicas_[0].logits.dim(1);
      Tensor all = active == 1 ? replicas_[0].logits
                               : c0.alloc({batch.size(), classes}, replicas_[0].logits.dtype());
      if (active > 1) {
        for (int i = 0; i < active; ++i) {
          replicas_[i].forward_done->wait(c0);
          Tensor rows = all.slice_rows(chunks[i].begin, chunks[i].begin + chunks[i].count);
          c0.ops().copy(c0, rows, replicas_[i].logits);
        }
      }
      Tensor labels = batch_rows(c0, batch, 0, batch.size(), BatchParts::Labels).labels;
      step_->loss = step_->criterion.forward(c0, all, labels);
      dlogits = step_->criterion.backward(c0);
      loss_done_.record(c0);
    });
    return dlogits;
  }

  // Backward on every replica from its rows of the output gradient; buckets reduce into
  // replica 0 as they complete, and device 0 waits for the last one.
  void backward_reduce(const Tensor& dlogits, const std::vector<Chunk>& chunks, int active) {
    reducer_->begin(active, /*sync=*/active > 1);  // one replica has nothing to reduce
    group_->begin(active);
    pool_.run([&](int i) {
      Replica& r = replicas_[i];
      if (i >= active) return;
      r.ctx->run([&] {
        Tensor dl = dlogits.slice_rows(chunks[i].begin, chunks[i].begin + chunks[i].count);
        {
          TraceSpan span(r.track, "scatter_grad", r.ctx.get());
          loss_done_.wait(*r.ctx);
          if (r.ctx->is_cuda() && i > 0) {
            Tensor local = r.ctx->alloc(dl.shape(), dl.dtype());
            r.ctx->ops().copy(*r.ctx, local, dl);
            dl = local;
          }
        }
        TraceSpan span(r.track, "backward", r.ctx.get());
        r.logits = Tensor();
        r.model->backward(*r.ctx, dl);
        group_->all_written(i);
        r.x = Tensor();
      });
    });
    DeviceContext& c0 = primary();
    TraceSpan span(replicas_[0].track, "reduce", &c0);
    if (active <= 1) return;
    c0.run([&] {
      reducer_->finish();  // the buckets of unused parameters too; rethrows a failed reduction
      group_->reduced();
    });
  }

  // Parameters and buffers of replica 0 to every other replica.
  void broadcast() {
    if (replicas_.size() < 2) return;  // one device: no copies
    std::vector<std::vector<Tensor>> sets;
    for (auto& r : replicas_) sets.push_back({r.model->flat_params(), r.model->flat_buffers()});
    group_->broadcast(sets);
  }

  WorkerPool pool_;
  std::vector<Replica> replicas_;
  std::unique_ptr<LocalGroup> group_;
  std::vector<Tensor> bucket_parts_;  // the bucket being reduced, one view per replica
  std::unique_ptr<BucketReducer> reducer_;
  std::optional<PrimaryStep> step_;  // on device 0, made once the replicas are
  std::unique_ptr<BatchPrefetcher> prefetcher_;  // likewise
  StreamEvent loss_done_;
  int last_active_ = 1;
};

}  // namespace

std::unique_ptr<TrainEngine> make_dp_engine(const std::vector<Device>& devices,
                                            const EngineOptions& options, const DpOptions& dp) {
  REPLICA_CHECK(!devices.empty(), "DP needs at least one device");
  for (const auto& d : devices)
    REPLICA_USAGE_CHECK(d.type == devices[0].type,
                        "DP devices must all be CPU or all CUDA (got {} and {})",
                        devices[0].str(), d.str());
  // One device with CUDA Graphs: nothing to scatter, gather or reduce, so the step is the
  // single-device one (as DataParallel runs the module itself for one device), captured once.
  if (devices.size() == 1 && options.cuda_graphs)
    return make_single_device_engine(devices[0], options, "dp");
  return std::make_unique<DataParallelEngine>(devices, options, dp);
}

}  // namespace replica
