// Convolution plans through cuDNN's graph API (conv_graph.h). Building one: tensor descriptors
// for x, w and y (unique ids 1, 2, 3, 16-byte aligned), a convolution descriptor (fp32
// accumulation, cross-correlation as PyTorch), the direction's operation, a one-operation graph,
// the heuristics' engine configurations, and an execution plan finalized from the first one the
// rules accept. Every descriptor but the plan is released once the plan exists.
#include "engine/cuda/conv_graph.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "engine/cuda/conv_algo.h"
#include "engine/error.h"

namespace replica {

namespace {

constexpr int64_t kAlignment = 16;  // bytes; ConvGraph::aligned() checks the buffers against it
constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3;
// --cudnn-benchmark times this many acceptable candidates (each twice after one warm-up run).
constexpr int kTimedCandidates = 6;

// One backend descriptor (or none), destroyed with its owner.
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptorType_t type) {
    REPLICA_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  cudnnBackendDescriptor_t release() { return std::exchange(d_, nullptr); }
  // Throws naming the attribute: a rejected attribute is a bug here, not a missing engine.
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    const cudnnStatus_t s = cudnnBackendSetAttribute(d_, name, type, count, values);
    REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: setting attribute {} failed: {}",
                  int(name), cudnnGetErrorString(s));
  }
  void set(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t d = other.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  void finalize(const char* what) {
    const cudnnStatus_t s = cudnnBackendFinalize(d_);
    REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: {} not accepted: {}", what,
                  cudnnGetErrorString(s));
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A tensor of logical dims (n, c, h, w), NCHW or NHWC in memory.
Desc tensor(int64_t uid, int64_t n, int64_t c, int64_t h, int64_t w, bool nhwc, bool bf16) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t dims[4] = {n, c, h, w};
  const int64_t nchw_strides[4] = {c * h * w, h * w, w, 1};
  const int64_t nhwc_strides[4] = {h * w * c, 1, w * c, c};
  const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const int64_t alignment = kAlignment;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, nhwc ? nhwc_strides : nchw_strides);
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  t.finalize("tensor descriptor");
  return t;
}

Desc convolution(const ConvGraphSpec& s) {
  Desc c(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t accumulate = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t dims = 2, stride[2] = {s.stride, s.stride}, pad[2] = {s.padding, s.padding};
  const int64_t dilation[2] = {1, 1};
  c.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &accumulate);
  c.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  c.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
  c.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation);
  c.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  c.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.finalize("convolution descriptor");
  return c;
}

// The direction's operation on x, w, y: (descriptor type, then attributes x, w, y, conv, alpha,
// beta, in the order of the enum's names).
Desc operation(const ConvGraphSpec& s, const Desc& x, const Desc& w, const Desc& y,
               const Desc& conv) {
  struct Names {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
  };
  static const Names kForward = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
  static const Names kData = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
  static const Names kFilter = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  const Names& n = s.direction == ConvDirection::Forward        ? kForward
                   : s.direction == ConvDirection::BackwardData ? kData
                                                                : kFilter;
  Desc op(n.type);
  const float alpha = 1.f, beta = s.beta;  // fp32 accumulation: float scaling factors
  op.set(n.x, x);
  op.set(n.w, w);
  op.set(n.y, y);
  op.set(n.conv, conv);
  op.set(n.alpha, CUDNN_TYPE_FLOAT, 1, &alpha);
  op.set(n.beta, CUDNN_TYPE_FLOAT, 1, &beta);
  op.finalize("convolution operation");
  return op;
}

// The engine configurations the heuristics list in `mode`, best first.
std::vector<Desc> engine_configs(const Desc& graph, cudnnBackendHeurMode_t mode) {
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) return {};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr) !=
          CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return {};
  std::vector<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    raw.push_back(configs.back().get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()) !=
      CUDNN_STATUS_SUCCESS)
    return {};
  configs.resize(size_t(std::clamp<int64_t>(got, 0, count)));
  return configs;
}

// An engine configuration's numerical and behaviour notes.
struct Notes {
  bool tensor_core = false, down_convert = false, nondeterministic = false;
  bool reduced_reduction = false;  // partial sums added in the data type (bf16), not fp32
  bool runtime_compiled = false;
};

Notes notes_of(const Desc& config) {
  Notes out;
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t n = 0;
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) != CUDNN_STATUS_SUCCESS)
    return out;
  cudnnBackendNumericalNote_t numerical[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, numerical) ==
      CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < n; ++i) {
      out.tensor_core |= numerical[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE;
      out.down_convert |= numerical[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS;
      out.nondeterministic |= numerical[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
      out.reduced_reduction |= numerical[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION;
    }
  }
  cudnnBackendBehaviorNote_t behavior[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                               CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, behavior) ==
      CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < n; ++i)
      out.runtime_compiled |= behavior[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION;
  }
  return out;
}

// As the legacy path chooses (conv_algo.h's choose_algo): never inputs converted down to a
// narrower type; sums in fp32 to the end (Precision::Bf16's contract, as the CPU computes it);
// tensor cores only where the precision allows them for fp32 data (bf16 data runs on them);
// nothing non-deterministic when asked.
bool acceptable(const Notes& n, const ConvGraphSpec& s, const ConvEngineRules& rules) {
  if (n.down_convert || n.reduced_reduction) return false;
  if (!s.bf16 && !rules.tensor_ops && n.tensor_core) return false;
  if (rules.deterministic && n.nondeterministic) return false;
  return true;
}

// The finalized plan of one configuration and its workspace, or no Desc when cuDNN
// cannot build it here or it wants more workspace than allowed.
std::pair<Desc, size_t> plan_for(cudnnHandle_t handle, const Desc& config, size_t max_ws) {
  Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
  int64_t ws = 0, n = 0;
  if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &n, &ws) != CUDNN_STATUS_SUCCESS ||
      ws < 0 || size_t(ws) > max_ws)
    return {Desc(), 0};
  return {std::move(plan), size_t(ws)};
}

cudnnStatus_t execute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, const ConvBuffers& b,
                      void* workspace) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* pointers[3] = {const_cast<void*>(b.x), const_cast<void*>(b.w), const_cast<void*>(b.y)};
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  return cudnnBackendExecute(handle, plan, pack.get());
}

// Milliseconds of one run of `plan` (the better of two, after a warm-up), or a negative value
// when it fails to run.
float time_plan(cudnnHandle_t handle, const Desc& plan, size_t ws, const ConvPlanTiming& t) {
  void* workspace = t.workspace(ws);
  if (execute(handle, plan.get(), t.buffers, workspace) != CUDNN_STATUS_SUCCESS) return -1.f;
  cudaEvent_t start = nullptr, stop = nullptr;
  REPLICA_CUDA_CHECK(cudaEventCreate(&start));
  REPLICA_CUDA_CHECK(cudaEventCreate(&stop));
  float best = -1.f;
  for (int round = 0; round < 2; ++round) {
    float ms = 0.f;
    if (cudaEventRecord(start, t.stream) != cudaSuccess ||
        execute(handle, plan.get(), t.buffers, workspace) != CUDNN_STATUS_SUCCESS ||
        cudaEventRecord(stop, t.stream) != cudaSuccess ||
        cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      best = -1.f;
      break;
    }
    best = best < 0.f ? ms : std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

}  // namespace

const char* conv_direction_name(ConvDirection d) {
  switch (d) {
    case ConvDirection::Forward: return "forward";
    case ConvDirection::BackwardData: return "backward data";
    case ConvDirection::BackwardFilter: return "backward filter";
  }
  return "?";
}

namespace {

// The finalized operation graph of `spec` and the descriptors it was made of. Without a handle
// cuDNN still checks every descriptor (shapes, strides, types), which needs no GPU.
struct Described {
  Desc x, w, y, conv, op, graph;
};

Described describe(const ConvGraphSpec& spec, cudnnHandle_t handle) {
  Described d;
  d.x = tensor(kUidX, spec.N, spec.C, spec.H, spec.W, spec.nhwc, spec.bf16);
  d.w = tensor(kUidW, spec.K, spec.C, spec.R, spec.R, spec.nhwc, spec.bf16);
  d.y = tensor(kUidY, spec.N, spec.K, spec.P, spec.Q, spec.nhwc, spec.bf16);
  d.conv = convolution(spec);
  d.op = operation(spec, d.x, d.w, d.y, d.conv);
  d.graph = Desc(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  if (handle) d.graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  d.graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, d.op);
  d.graph.finalize("operation graph");
  return d;
}

}  // namespace

void ConvGraph::check(const ConvGraphSpec& spec) { describe(spec, nullptr); }

std::unique_ptr<ConvGraph> ConvGraph::build(cudnnHandle_t handle, const ConvGraphSpec& spec,
                                            const ConvEngineRules& rules,
                                            const ConvPlanTiming* timing, std::string* why) {
  const Described described = describe(spec, handle);
  const Desc& graph = described.graph;

  // Candidates: mode A's list then the fallback list, acceptable ones only, precompiled engines
  // first (a run-time compiled one costs about a second to build, per shape and direction).
  std::vector<Desc> configs = engine_configs(graph, CUDNN_HEUR_MODE_A);
  for (Desc& c : engine_configs(graph, CUDNN_HEUR_MODE_FALLBACK)) configs.push_back(std::move(c));
  std::vector<const Desc*> candidates, compiled_later;
  for (const Desc& c : configs) {
    const Notes n = notes_of(c);
    if (acceptable(n, spec, rules)) (n.runtime_compiled ? compiled_later : candidates).push_back(&c);
  }
  candidates.insert(candidates.end(), compiled_later.begin(), compiled_later.end());

  Desc best;
  size_t best_ws = 0;
  bool found = false;
  float best_ms = 0.f;
  int timed = 0;
  for (const Desc* c : candidates) {
    auto [plan, ws] = plan_for(handle, *c, rules.max_workspace);
    if (!plan.get()) continue;
    if (!timing) {
      best = std::move(plan);
      best_ws = ws;
      found = true;
      break;
    }
    const float ms = time_plan(handle, plan, ws, *timing);
    if (ms < 0.f) continue;
    if (!found || ms < best_ms) {
      best = std::move(plan);
      best_ws = ws;
      best_ms = ms;
      found = true;
    }
    if (++timed == kTimedCandidates) break;
  }
  if (!found) {
    *why = fmt::format("cuDNN's graph API offers no acceptable engine for this convolution's {} "
                       "({} engine configurations listed, {} acceptable)",
                       conv_direction_name(spec.direction), configs.size(), candidates.size());
    return nullptr;
  }
  return std::unique_ptr<ConvGraph>(new ConvGraph(best.release(), best_ws));
}

ConvGraph::~ConvGraph() {
  if (plan_) cudnnBackendDestroyDescriptor(plan_);
}

bool ConvGraph::aligned(const ConvBuffers& b) {
  for (const void* p : {b.x, b.w, b.y})
    if (reinterpret_cast<uintptr_t>(p) % kAlignment != 0) return false;
  return true;
}

void ConvGraph::run(cudnnHandle_t handle, const ConvBuffers& b, void* workspace) const {
  const cudnnStatus_t s = execute(handle, plan_, b, workspace);
  REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: executing a convolution plan failed: {}",
                cudnnGetErrorString(s));
}

}  // namespace replica
