#include "parallel/engines/engine_steps.h"

#include <algorithm>

#include "engine/ops.h"
#include "engine/trace.h"

namespace replica {

Tensor batch_to_device(DeviceContext& ctx, const Tensor& host) {
  if (!ctx.is_cuda()) return host;
  Tensor t = ctx.alloc(host.shape(), host.dtype());
  ctx.ops().copy(ctx, t, host);
  return t;
}

DeviceBatch batch_rows(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
                       BatchParts parts) {
  if (auto staged = batch.staged->take(ctx, begin, end, parts)) return std::move(*staged);
  const bool images = parts != BatchParts::Labels, labels = parts != BatchParts::Images;
  // Rows of a part on ctx's device; on a GPU the batch then knows the copy may still be reading
  // its pinned buffer (Batch::copies).
  auto rows_of = [&](const Tensor& part) {
    Tensor t = batch_to_device(ctx, part.slice_rows(begin, end));
    batch.copies->add(ctx);
    return t;
  };
  DeviceBatch out;
  if (!batch.resident) {
    if (images) out.images = rows_of(batch.images);
    if (labels) out.labels = rows_of(batch.labels);
    return out;
  }
  const Tensor rows = rows_of(batch.indices);
  if (images) out.images = batch.resident->images(ctx, rows);
  if (labels) out.labels = batch.resident->labels(ctx, rows);
  return out;
}

DeviceBatch whole_batch_to_device(DeviceContext& ctx, const Batch& batch,
                                  const std::string& track) {
  TraceSpan span(track, batch.resident ? "batch_gather" : "h2d", &ctx);
  return batch_rows(ctx, batch, 0, batch.size(), BatchParts::Both);
}

struct BatchPrefetcher::Copier {
  DeviceContext* ctx;    // the device's own context: its stream computes, its allocator holds
  DeviceContext stream;  // the copy stream (a context of the same device)
  StreamEvent allocated;  // where ctx's stream stood when the rows' memory was taken
  explicit Copier(DeviceContext* c) : ctx(c), stream(c->device(), ContextOptions{1}) {}
};

BatchPrefetcher::BatchPrefetcher(const std::vector<DeviceContext*>& contexts, bool stage_on_cpu) {
  for (DeviceContext* c : contexts)
    if (c->is_cuda() || stage_on_cpu) copiers_.push_back(std::make_unique<Copier>(c));
}

BatchPrefetcher::~BatchPrefetcher() = default;

void BatchPrefetcher::stage(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
                            BatchParts parts, const std::string& track) {
  if (batch.resident) return;
  auto it = std::find_if(copiers_.begin(), copiers_.end(),
                         [&](const auto& c) { return c->ctx == &ctx; });
  if (it == copiers_.end()) return;
  Copier& c = **it;
  TraceSpan span(track, "prefetch", &c.stream);
  StagedRows::Rows staged{&ctx, begin, end, parts, {}, std::make_unique<StreamEvent>()};
  const bool images = parts != BatchParts::Labels, labels = parts != BatchParts::Images;
  ctx.run([&] {
    const Tensor host_images = images ? batch.images.slice_rows(begin, end) : Tensor();
    const Tensor host_labels = labels ? batch.labels.slice_rows(begin, end) : Tensor();
    if (images) staged.rows.images = ctx.alloc(host_images.shape(), host_images.dtype());
    if (labels) staged.rows.labels = ctx.alloc(host_labels.shape(), host_labels.dtype());
    // The memory is ctx's from here on: only the work ctx's stream holds so far may still
    // read it as earlier tensors' (the allocator hands out freed blocks at once).
    c.allocated.record(ctx);
    c.allocated.wait(c.stream);
    try {
      if (images) c.stream.ops().copy(c.stream, staged.rows.images, host_images);
      if (labels) c.stream.ops().copy(c.stream, staged.rows.labels, host_labels);
      staged.copied->record(c.stream);
      batch.copies->add(c.stream);
    } catch (...) {
      // Nothing may be freed, nor the pinned rows refilled, while a copy is queued.
      try {
        c.stream.synchronize();
      } catch (...) {
      }
      throw;
    }
  });
  batch.staged->put(std::move(staged));
}

void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Batch& batch, int64_t begin, int64_t end, EvalSums& sums) {
  ctx.run([&] {
    auto [x, y] = batch_rows(ctx, batch, begin, end, BatchParts::Both);
    Tensor logits = model.forward(ctx, x);
    Tensor loss = criterion.forward(ctx, logits, y);
    Tensor hits = ctx.alloc({EvalSums::kTopK}, DType::I32);
    ctx.ops().fill(ctx, hits, 0.f);
    ctx.ops().count_correct(ctx, logits, y, hits);
    Tensor host_loss = to_host(ctx, loss), host_hits = to_host(ctx, hits);
    ctx.synchronize();
    sums.loss_sum += double(host_loss.f32()[0]) * double(end - begin);
    sums.top1 += host_hits.i32()[0];
    sums.top5 += host_hits.i32()[EvalSums::kTopK - 1];
  });
}

OneDeviceEngine::OneDeviceEngine(std::unique_ptr<DeviceContext>&& ctx, std::string track,
                                 const EngineOptions& o)
    : owned_ctx_(std::move(ctx)), ctx_(*owned_ctx_), track_(std::move(track)),
      step_(ctx_, o.optimizer), prefetcher_({&ctx_}, o.prefetch_on_cpu),
      model_(make_model(o.model, o.input_shape, o.num_classes)) {
  ctx_.run([&] { model_->materialize(ctx_, o.seed); });
}

PrimaryStep::PrimaryStep(DeviceContext& ctx, const OptimizerOptions& optimizer_options)
    : optimizer(make_optimizer(optimizer_options)) {
  ctx.run([&] {
    loss = ctx.alloc({1});
    ctx.ops().fill(ctx, loss, 0.f);
  });
}

float PrimaryStep::read_loss(DeviceContext& ctx) {
  Tensor host;
  ctx.run([&] {
    host = to_host(ctx, loss);
    ctx.synchronize();
  });
  return host.f32()[0];
}

}  // namespace replica
