// Which cuDNN interface runs each convolution (ConvApi, engine/context.h): CudaBackend's
// conv_graph() gives a direction's graph-API plan (conv_graph.h), built on its first use, or
// null where the legacy calls run it (conv.cu).
#include <atomic>
#include <cstdio>
#include <string>

#include "engine/cuda/conv_algo.h"

namespace replica {

namespace {

// Elements of the buffer a direction writes, as staged (bf16: two to a float).
int64_t written_floats(const ConvGraphSpec& s) {
  const int64_t n = s.direction == ConvDirection::Forward        ? s.N * s.K * s.P * s.Q
                    : s.direction == ConvDirection::BackwardData ? s.N * s.C * s.H * s.W
                                                                 : s.K * s.C * s.R * s.R;
  return s.bf16 ? (n + 1) / 2 : n;
}

// The slot of a direction's plan for beta 0 (overwrite) or 1 (add to the buffer).
ConvGraphSlot& graph_slot(ConvPlan& plan, ConvDirection dir, float beta) {
  return plan.graphs[static_cast<int>(dir)][beta != 0.f ? 1 : 0];
}

// Auto's one line when a convolution leaves the graph API for the legacy calls (the first
// such convolution only: a model may have dozens).
void tell_legacy(const ConvGraphSpec& spec, const std::string& why) {
  static std::atomic<bool> told{false};
  if (told.exchange(true)) return;
  std::fprintf(stderr, "replica: conv2d %s [N=%lld C=%lld H=%lld W=%lld K=%lld R=%lld]: %s; "
               "cuDNN's legacy calls run it (and any other such convolution)\n",
               conv_direction_name(spec.direction), (long long)spec.N, (long long)spec.C,
               (long long)spec.H, (long long)spec.W, (long long)spec.K, (long long)spec.R,
               why.c_str());
}

}  // namespace

void CudaBackend::leave_conv_graph(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir,
                                   float beta, const std::string& why) {
  ConvGraphSlot& slot = graph_slot(plan, dir, beta);
  // The plan's earlier runs may still be queued: they finish before it is destroyed.
  REPLICA_CUDA_CHECK(cudaStreamSynchronize(cuda_state(ctx).stream));
  slot.graph.reset();
  ConvGraphSpec spec = plan.spec;
  spec.direction = dir;
  tell_legacy(spec, why);
}

const ConvGraph* CudaBackend::conv_graph(DeviceContext& ctx, ConvPlan& plan, ConvDirection dir,
                                         float beta, const ConvBuffers& buffers) {
  const ConvApi api = ctx.conv_api();
  if (api == ConvApi::Legacy) return nullptr;
  ConvGraphSlot& slot = graph_slot(plan, dir, beta);
  if (!slot.tried) {
    ConvGraphSpec spec = plan.spec;
    spec.direction = dir;
    spec.beta = beta;
    std::string why;
    try {
      slot.graph = build_conv_graph(ctx, spec, buffers, &why);
    } catch (const Error& e) {
      if (api == ConvApi::Graph) throw;
      why = e.what();
    }
    REPLICA_CHECK(slot.graph || api != ConvApi::Graph, "conv2d {} [N={} C={} H={} W={} K={} R={}] "
                  "with REPLICA_CUDNN_API=graph: {}", conv_direction_name(dir), spec.N, spec.C,
                  spec.H, spec.W, spec.K, spec.R, why);
    slot.tried = true;
    if (!slot.graph) tell_legacy(spec, why);
  }
  if (!slot.graph) return nullptr;
  if (ConvGraph::aligned(buffers)) return slot.graph.get();
  // Graph is strict: every convolution on a plan, or an error.
  REPLICA_CHECK(api != ConvApi::Graph, "conv2d {} with REPLICA_CUDNN_API=graph: its buffers are "
                "not 16-byte aligned (a view into a larger tensor); auto runs it through cuDNN's "
                "legacy calls", conv_direction_name(dir));
  return nullptr;
}

std::unique_ptr<ConvGraph> CudaBackend::build_conv_graph(DeviceContext& ctx,
                                                         const ConvGraphSpec& spec,
                                                         const ConvBuffers& buffers,
                                                         std::string* why) {
  const CudaState& s = cuda_state(ctx);
  const ConvEngineRules rules{conv_tensor_ops(ctx), s.deterministic, kMaxConvWorkspace};
  // No device_free_mutex here, unlike cuDNN's Find (conv_algo.h), which frees memory of its
  // own: every buffer below comes from the device's allocator, whose frees take that lock.
  if (!s.benchmark || !ConvGraph::aligned(buffers))
    return ConvGraph::build(s.cudnn, spec, rules, nullptr, why);
  // Timed on the real operands, the written buffer a scratch one, with a trial workspace of its
  // own, grown to the largest candidate's (the op's own later takes only the chosen plan's).
  // Both are freed only once the stream has run every trial, whichever way this returns.
  Tensor written = ctx.alloc({written_floats(spec)}), trial_ws;
  struct Drain {
    cudaStream_t stream;
    ~Drain() {
      if (cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
    }
  } drain{s.stream};
  ConvPlanTiming timing{s.stream, buffers, [&](size_t bytes) -> void* {
                          if (bytes == 0) return nullptr;
                          const int64_t floats = int64_t((bytes + 3) / 4);
                          if (!trial_ws.defined() || trial_ws.numel() < floats) {
                            REPLICA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
                            trial_ws = Tensor();
                            trial_ws = ctx.alloc({floats});
                          }
                          return trial_ws.raw();
                        }};
  const void* out = written.raw();
  (spec.direction == ConvDirection::Forward        ? timing.buffers.y
   : spec.direction == ConvDirection::BackwardData ? timing.buffers.x
                                                   : timing.buffers.w) = out;
  return ConvGraph::build(s.cudnn, spec, rules, &timing, why);
}

}  // namespace replica
