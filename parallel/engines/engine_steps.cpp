#include "parallel/engines/engine_steps.h"

#include "engine/ops.h"
#include "engine/trace.h"

namespace replica {

Tensor batch_to_device(DeviceContext& ctx, const Tensor& host) {
  if (!ctx.is_cuda()) return host;
  Tensor t = ctx.alloc(host.shape(), host.dtype());
  ctx.ops().copy(ctx, t, host);
  return t;
}

Tensor batch_to_device(DeviceContext& ctx, const Batch& batch, const Tensor& part) {
  Tensor t = batch_to_device(ctx, part);
  batch.copies->add(ctx);
  return t;
}

namespace {

using Gather = Tensor (ResidentDataset::*)(DeviceContext&, const Tensor&) const;

// Rows [begin, end) of `host` (the batch's images or labels), or the same rows gathered on the
// device by the batch's indices.
Tensor batch_rows(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end,
                  const Tensor& host, Gather gather) {
  if (!batch.resident) return batch_to_device(ctx, batch, host.slice_rows(begin, end));
  const Tensor rows = batch_to_device(ctx, batch, batch.indices.slice_rows(begin, end));
  return (batch.resident->*gather)(ctx, rows);
}

}  // namespace

Tensor batch_images(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end) {
  return batch_rows(ctx, batch, begin, end, batch.images, &ResidentDataset::images);
}

Tensor batch_labels(DeviceContext& ctx, const Batch& batch, int64_t begin, int64_t end) {
  return batch_rows(ctx, batch, begin, end, batch.labels, &ResidentDataset::labels);
}

DeviceBatch whole_batch_to_device(DeviceContext& ctx, const Batch& batch,
                                  const std::string& track) {
  TraceSpan span(track, batch.resident ? "batch_gather" : "h2d", &ctx);
  return {batch_images(ctx, batch, 0, batch.size()), batch_labels(ctx, batch, 0, batch.size())};
}

void evaluate_batch(DeviceContext& ctx, Model& model, CrossEntropyLoss& criterion,
                    const Batch& batch, int64_t begin, int64_t end, double& loss_sum,
                    int64_t& correct) {
  ctx.run([&] {
    Tensor x = batch_images(ctx, batch, begin, end), y = batch_labels(ctx, batch, begin, end);
    Tensor logits = model.forward(ctx, x);
    Tensor loss = criterion.forward(ctx, logits, y);
    Tensor hits = ctx.alloc({1}, DType::I32);
    ctx.ops().fill(ctx, hits, 0.f);
    ctx.ops().count_correct(ctx, logits, y, hits);
    Tensor host_loss = Tensor::empty(host_allocator(), {1});
    Tensor host_hits = Tensor::empty(host_allocator(), {1}, DType::I32);
    ctx.ops().copy(ctx, host_loss, loss);
    ctx.ops().copy(ctx, host_hits, hits);
    ctx.synchronize();
    loss_sum += double(host_loss.f32()[0]) * double(end - begin);
    correct += host_hits.i32()[0];
  });
}

}  // namespace replica
