// Which engine runs a convolution's graph (conv_graph.h): cuDNN's heuristics list engine
// configurations (mode A, then its fallback list); each one's notes say how it computes, and the
// rules (ConvEngineRules) refuse what the precision or --deterministic forbids; the first
// acceptable configuration that finalizes into a plan is kept, or with --cudnn-benchmark the
// fastest of the first few, timed on the call's operands. Every descriptor but the plan is
// released once the plan exists.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/cuda/conv_graph_desc.h"
#include "engine/env_switch.h"

namespace replica {

namespace {

// --cudnn-benchmark times this many acceptable candidates (each twice after one warm-up run),
// at most kTimedCompiled of them compiled at run time (about a second each to build).
constexpr int kTimedCandidates = 6, kTimedCompiled = 2;

// The engine configurations the heuristics list in `mode`, best first.
std::vector<BackendDesc> engine_configs(const BackendDesc& graph, cudnnBackendHeurMode_t mode) {
  BackendDesc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) return {};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr) !=
          CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return {};
  std::vector<BackendDesc> configs;
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

// An engine configuration's numerical and behaviour notes, and its engine's global index.
struct Notes {
  bool known = false;  // the engine and its numerical notes could be read (else: refused)
  bool tensor_core = false, down_convert = false, nondeterministic = false;
  bool reduced_reduction = false;  // partial sums added in the data type (bf16), not fp32
  bool runtime_compiled = false;
  int64_t engine = -1;
};

Notes notes_of(const BackendDesc& config) {
  Notes out;
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t n = 0;
  cudnnBackendNumericalNote_t numerical[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, numerical) !=
          CUDNN_STATUS_SUCCESS)
    return out;
  out.known = true;
  // cuDNN reports how many notes there are, which may exceed what fits in the array.
  for (int64_t i = 0; i < std::min<int64_t>(n, CUDNN_NUMERICAL_NOTE_TYPE_COUNT); ++i) {
    out.tensor_core |= numerical[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE;
    out.down_convert |= numerical[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS;
    out.nondeterministic |= numerical[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    out.reduced_reduction |= numerical[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION;
  }
  cudnnBackendBehaviorNote_t behavior[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                               CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, behavior) ==
      CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < std::min<int64_t>(n, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT); ++i)
      out.runtime_compiled |= behavior[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION;
  }
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                               &out.engine) != CUDNN_STATUS_SUCCESS)
    out.engine = -1;
  return out;
}

// Why the rules refuse an engine (null: they accept it). As the legacy path chooses
// (conv_algo.h's choose_algo): never inputs converted down to a narrower type; sums in fp32 to
// the end (Precision::Bf16's contract, as the CPU computes it); tensor cores only where the
// precision allows them for fp32 data (bf16 data runs on them); nothing non-deterministic when
// asked; an engine whose notes cannot be read is refused, not trusted.
const char* refusal(const Notes& n, const ConvGraphSpec& s, const ConvEngineRules& rules) {
  if (!n.known) return "notes unreadable";
  if (n.down_convert) return "inputs converted down";
  if (n.reduced_reduction) return "sums in bf16";
  if (!s.bf16 && !rules.tensor_ops && n.tensor_core) return "tensor cores in strict fp32";
  if (rules.deterministic && n.nondeterministic) return "non-deterministic";
  return nullptr;
}

// The finalized plan of one configuration and its workspace, or no BackendDesc when cuDNN
// cannot build it here or it wants more workspace than allowed.
std::pair<BackendDesc, size_t> plan_for(cudnnHandle_t handle, const BackendDesc& config,
                                        size_t max_ws) {
  BackendDesc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
  int64_t ws = 0, n = 0;
  if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &n, &ws) != CUDNN_STATUS_SUCCESS ||
      ws < 0 || size_t(ws) > max_ws)
    return {BackendDesc(), 0};
  return {std::move(plan), size_t(ws)};
}

// Milliseconds of one run of `plan` (the better of two, after a warm-up), or a negative value
// when cuDNN refuses to run it (after the stream has drained what it queued, so the plan can be
// destroyed). A CUDA error (a fault of an earlier kernel, say) throws: it is no candidate's.
float time_plan(cudnnHandle_t handle, const BackendDesc& plan, size_t ws,
                const ConvPlanTiming& t) {
  void* workspace = t.workspace(ws);
  struct Events {  // destroyed on every way out
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } e;
  REPLICA_CUDA_CHECK(cudaEventCreate(&e.start));
  REPLICA_CUDA_CHECK(cudaEventCreate(&e.stop));
  float best = -1.f;
  for (int round = 0; round < 3; ++round) {  // round 0 warms up
    REPLICA_CUDA_CHECK(cudaEventRecord(e.start, t.stream));
    if (execute_conv_plan(handle, plan.get(), t.buffers, workspace) != CUDNN_STATUS_SUCCESS) {
      REPLICA_CUDA_CHECK(cudaStreamSynchronize(t.stream));
      return -1.f;
    }
    REPLICA_CUDA_CHECK(cudaEventRecord(e.stop, t.stream));
    REPLICA_CUDA_CHECK(cudaEventSynchronize(e.stop));
    float ms = 0.f;
    REPLICA_CUDA_CHECK(cudaEventElapsedTime(&ms, e.start, e.stop));
    if (round > 0) best = best < 0.f ? ms : std::min(best, ms);
  }
  return best;
}

// The engine configurations worth trying, in order, and what the rules refused: mode A's
// precompiled engines, then its run-time compiled ones (about a second each to build, per shape
// and direction), then the fallback list's, in the same two groups. With
// REPLICA_CUDNN_HEURISTIC_ORDER=1 each list keeps the heuristics' own order, run-time compiled
// engines where they rank (as PyTorch takes them): an experiment, for the shapes whose best
// ranked engine is compiled (REPLICA_CUDNN_LOG=1 says which kind each plan is).
struct Candidates {
  std::vector<BackendDesc> configs;  // every configuration listed
  std::vector<const BackendDesc*> ordered;  // the acceptable ones, in the order they are tried
  std::vector<Notes> notes;          // ordered[i]'s
  std::vector<bool> fallback;        // ordered[i] came from the fallback list
  size_t listed_a = 0;
  std::map<std::string, int> refused;  // why -> how many
};

Candidates candidates_of(const BackendDesc& graph, const ConvGraphSpec& spec,
                         const ConvEngineRules& rules) {
  Candidates c;
  c.configs = engine_configs(graph, CUDNN_HEUR_MODE_A);
  c.listed_a = c.configs.size();
  for (BackendDesc& d : engine_configs(graph, CUDNN_HEUR_MODE_FALLBACK))
    c.configs.push_back(std::move(d));
  std::vector<Notes> notes;
  for (const BackendDesc& d : c.configs) notes.push_back(notes_of(d));
  const bool heuristic_order = switches::kCudnnHeuristicOrder.on();  // once per plan built
  for (const size_t first : {size_t(0), c.listed_a}) {
    const size_t last = first == 0 ? c.listed_a : c.configs.size();
    for (const bool compiled : {false, true})
      for (size_t i = first; i < last; ++i) {
        // In the heuristics' order: every configuration in the first round, none in the second.
        if (heuristic_order ? compiled : notes[i].runtime_compiled != compiled) continue;
        if (const char* why = refusal(notes[i], spec, rules)) {
          ++c.refused[why];
          continue;
        }
        c.ordered.push_back(&c.configs[i]);
        c.notes.push_back(notes[i]);
        c.fallback.push_back(first > 0);
      }
  }
  return c;
}

// REPLICA_CUDNN_LOG=1: one line per plan built (or not), on stderr.
void log_choice(const ConvGraphSpec& spec, const Candidates& c, const std::string& chosen) {
  if (!switches::kCudnnLog.on()) return;
  std::string refused;
  for (const auto& [why, count] : c.refused)
    refused += fmt::format("{}{} {}", refused.empty() ? "" : ", ", count, why);
  std::fprintf(stderr, "replica: cuDNN graph: conv2d %s [N=%lld C=%lld H=%lld W=%lld K=%lld "
               "R=%lld stride %d padding %d] %s%s%s: %zu engine configurations listed (%zu by "
               "mode A), %zu acceptable%s%s; %s\n",
               conv_direction_name(spec.direction), (long long)spec.N, (long long)spec.C,
               (long long)spec.H, (long long)spec.W, (long long)spec.K, (long long)spec.R,
               spec.stride, spec.padding, spec.bf16 ? "bf16" : "fp32", spec.nhwc ? " NHWC" : "",
               spec.beta != 0.f ? " adding (beta 1)" : "",
               c.configs.size(), c.listed_a, c.ordered.size(), refused.empty() ? "" : ", refused: ",
               refused.c_str(), chosen.c_str());
}

}  // namespace

std::unique_ptr<ConvGraph> ConvGraph::build(cudnnHandle_t handle, const ConvGraphSpec& spec,
                                            const ConvEngineRules& rules,
                                            const ConvPlanTiming* timing, std::string* why) {
  const ConvGraphDescs described = describe_conv_graph(spec, handle);
  const Candidates candidates = candidates_of(described.graph, spec, rules);
  BackendDesc best;
  size_t best_ws = 0, best_at = 0;
  float best_ms = -1.f;
  int tried = 0, timed = 0, timed_compiled = 0;
  std::set<int64_t> built;  // engines with a plan: the fallback list's copies are not timed again
  for (size_t i = 0; i < candidates.ordered.size() && timed < kTimedCandidates; ++i) {
    const Notes& n = candidates.notes[i];
    if (candidates.fallback[i] && n.engine >= 0 && built.count(n.engine)) continue;
    // Timing compiles each candidate: at most kTimedCompiled of those per convolution.
    if (timing && n.runtime_compiled && timed_compiled == kTimedCompiled) continue;
    BackendDesc plan;
    size_t ws = 0;
    {
      // Finalizing may load a module: kept apart from NCCL group launches as cudaFree is.
      std::lock_guard<std::mutex> lock(device_free_mutex());
      std::tie(plan, ws) = plan_for(handle, *candidates.ordered[i], rules.max_workspace);
    }
    if (!plan.get()) continue;
    ++tried;
    if (n.engine >= 0) built.insert(n.engine);
    const float ms = timing ? time_plan(handle, plan, ws, *timing) : 0.f;
    if (ms < 0.f) continue;
    if (!best.get() || ms < best_ms) {
      best = std::move(plan);
      best_ws = ws, best_ms = ms, best_at = i;
    }
    if (!timing) break;
    ++timed;
    timed_compiled += n.runtime_compiled;
  }
  if (!best.get()) {
    *why = fmt::format("cuDNN's graph API offers no acceptable engine for this convolution's {} "
                       "({} engine configurations listed, {} acceptable, {} of them built)",
                       conv_direction_name(spec.direction), candidates.configs.size(),
                       candidates.ordered.size(), tried);
    log_choice(spec, candidates, "none could be built");
    return nullptr;
  }
  const bool compiled = candidates.notes[best_at].runtime_compiled;
  log_choice(spec, candidates,
             fmt::format("took number {} of them ({}), workspace {:.1f} MB{}", best_at + 1,
                         compiled ? "compiled at run time" : "precompiled", best_ws / 1e6,
                         timing ? fmt::format(", {:.3f} ms, fastest of {} timed", best_ms, timed)
                                : std::string()));
  return std::unique_ptr<ConvGraph>(new ConvGraph(best.release(), best_ws));
}

}  // namespace replica
