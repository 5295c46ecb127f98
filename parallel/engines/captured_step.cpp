#include "parallel/engines/captured_step.h"

#include <cstdio>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "engine/trace.h"

namespace replica {

bool CapturedStep::capture(DeviceContext& ctx, const Tensor& x, const Tensor& y,
                           const Body& body) {
  // Shared-pool tensors, made before the capture: the graph reads them, the host refills them.
  x_ = ctx.alloc(x.shape(), x.dtype());
  y_ = ctx.alloc(y.shape(), y.dtype());
  try {
    graph_ = std::make_unique<StepGraph>(ctx, [&] { loss_ = body(x_, y_); });
    std::fprintf(stderr, "replica: %s: step %lld captured as %s of %zu nodes, replayed from "
                 "here on\n", ctx.device().str().c_str(), (long long)steps_,
                 ctx.is_cuda() ? "a CUDA Graph" : "a recorded graph", graph_->nodes());
    return true;
  } catch (const Error& e) {
    refused_ = true;
    x_ = y_ = loss_ = Tensor();
    std::fprintf(stderr, "replica: --cuda-graphs: the step on %s could not be captured, so it "
                 "runs uncaptured: %s\n", ctx.device().str().c_str(), e.what());
    return false;
  }
}

Tensor CapturedStep::run(DeviceContext& ctx, const Tensor& x, const Tensor& y,
                         const Body& body) {
  auto eager = [&] {
    eager_x_ = x.shape();
    eager_y_ = y.shape();
    return body(x, y);
  };
  if (!enabled_ || refused_ || steps_++ < kEagerSteps) return eager();
  if (graph_ && (x.shape() != x_.shape() || y.shape() != y_.shape())) return eager();
  // A shape is captured only once it has just run eagerly (what it builds once is built).
  if (!graph_ && (x.shape() != eager_x_ || y.shape() != eager_y_)) return eager();
  // Nothing of the capture has run: the replay below is this step.
  if (!graph_ && !capture(ctx, x, y, body)) return body(x, y);
  TraceSpan span(ctx.device().str(), "step_graph", &ctx);
  ctx.ops().copy(ctx, x_, x);
  ctx.ops().copy(ctx, y_, y);
  graph_->replay();
  ++replays_;
  return loss_;
}

void check_cuda_graphs(const std::vector<Device>& devices, const std::string& mode) {
  REPLICA_USAGE_CHECK(mode != "ddp" && devices.size() == 1,
                      "--cuda-graphs captures one device's step: --mode single, or dp on one "
                      "device (DP over several devices and DDP run uncaptured)");
  REPLICA_USAGE_CHECK(devices[0].is_cuda(), "--cuda-graphs captures a GPU's step: {} is not a "
                      "CUDA device", devices[0].str());
}

}  // namespace replica
