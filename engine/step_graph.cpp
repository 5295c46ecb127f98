#include "engine/step_graph.h"

#include <tuple>
#include <utility>

#include "engine/context.h"
#include "engine/cudart.h"
#include "engine/error.h"
#include "engine/ops.h"

namespace replica {

namespace {

// A recorded call keeps copies of its arguments: tensors share their blocks (so the memory a
// captured step used lives as long as the graph, as a CUDA graph's pool does), numbers and
// window parameters are the values the capture saw. The context is kept by address.
template <class T>
T keep(const T& value) {
  return value;
}
DeviceContext* keep(DeviceContext& ctx) { return &ctx; }
template <class T>
T& use(T& kept) {
  return kept;
}
DeviceContext& use(DeviceContext* ctx) { return *ctx; }

template <class... Args>
auto keep_all(Args&... args) {
  return std::make_tuple(keep(args)...);
}

// The CPU's stand-in for stream capture: each op becomes a call on the real backend, made at
// replay, in the order the capture saw.
class RecordingBackend final : public Backend {
 public:
  RecordingBackend(Backend& inner, std::vector<std::function<void()>>& calls)
      : inner_(inner), calls_(calls) {}

#define REPLICA_OP(name, params, args)                                                  \
  void name params override {                                                           \
    calls_.push_back([&inner = inner_, kept = keep_all args]() mutable {                \
      std::apply([&inner](auto&... a) { inner.name(use(a)...); }, kept);                \
    });                                                                                 \
  }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

 private:
  Backend& inner_;
  std::vector<std::function<void()>>& calls_;
};

}  // namespace

StepGraph::StepGraph(DeviceContext& ctx, const std::function<void()>& body) : ctx_(ctx) {
  REPLICA_CHECK(!ctx.capturing(), "{}: a step is already being captured", ctx.device().str());
  REPLICA_CHECK(!ctx.profiling(), "{}: ops timed one by one cannot be captured in a graph",
                ctx.device().str());
  Allocator& allocator = ctx.allocator();
  pool_ = allocator.new_pool();
  std::unique_ptr<Backend> recorder;
  if (!ctx.is_cuda()) recorder = std::make_unique<RecordingBackend>(ctx.ops(), calls_);
  // Puts the context back as it was, whichever way the capture ends.
  struct Capture {
    DeviceContext& ctx;
    bool open = true;
    Capture(DeviceContext& c, Backend* recorder, int pool) : ctx(c) {
      ctx.allocator().use_pool(pool);
      ctx.begin_capture(recorder);
    }
    // `captured`: the body ran to its end (what it enqueued may be replayed from now on).
    void close(bool captured = false) {
      if (!open) return;
      open = false;
      ctx.end_capture(captured);
      ctx.allocator().use_pool(0);
    }
    ~Capture() { close(); }
  };
  try {
    Capture capture(ctx, recorder.get(), pool_);
    if (ctx.is_cuda()) {
      cudart::capture_begin(ctx.cuda());
      try {
        body();
      } catch (...) {
        cudart::capture_abort(ctx.cuda());  // leaves capture; what was recorded is dropped
        throw;
      }
      graph_ = cudart::capture_end(ctx.cuda(), &nodes_);
      capture.close(true);
    } else {
      body();
      capture.close(true);
      nodes_ = calls_.size();
    }
  } catch (...) {
    calls_.clear();
    allocator.close_pool(pool_);
    throw;
  }
}

StepGraph::~StepGraph() {
  if (graph_) {
    try {
      ctx_.synchronize();
    } catch (...) {
    }
    cudart::graph_destroy(graph_);
  }
  calls_.clear();
  try {
    ctx_.allocator().close_pool(pool_);
  } catch (...) {
  }
}

void StepGraph::replay() {
  if (graph_) {
    cudart::graph_launch(ctx_.cuda(), graph_);
    return;
  }
  for (auto& call : calls_) call();
}

}  // namespace replica
