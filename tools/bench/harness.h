// The timing harness every parallel suite shares: preloaded synthetic batches, warm-up steps,
// timed windows (no host sync inside a window; one synchronize() at its end), per-phase times
// from the tracer's spans, and optionally a traced window whose spans become a Chrome trace.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/data/resident_dataset.h"
#include "engine/trace.h"
#include "parallel/engines/train_engine.h"

namespace replica::bench {

struct RunOptions {
  std::string model = "cnn";
  Shape input_shape = {1, 28, 28};
  int64_t batch_per_device = 64;
  int64_t warmup = 10, steps = 50;
  int repeat = 3;
  int64_t trace_steps = 0;  // > 0: a traced window of this many steps after the timed ones
  uint64_t seed = 0;
  int threads_per_device = 1;
  Precision precision = Precision::Fp32;
  bool cudnn_benchmark = false;  // GPUs: convolution algorithms timed per shape
  bool channels_last = false;    // GPUs: convolutions on NHWC operands (--memory-format)
  bool cuda_graphs = false;      // one GPU: the step captured once and replayed
};

// The engine options of a run: its model, shape, seed, threads, precision, how convolution
// algorithms are picked and how their operands are laid out; 10 classes.
EngineOptions engine_options(const RunOptions& run);

// `count` batches of `batch` synthetic samples of `shape`, made once, held where `engine`'s
// devices read them as PyTorch's benchmark does (tools/pytorch_bench.py keeps its batches on the
// GPU): on GPUs in device memory, each step gathering its batch there; on CPU devices (or with
// no engine) in pinned host memory, used in place. Destroy it before `engine` (it may hold
// memory of its devices).
struct Preloaded {
  std::unique_ptr<Dataset> data;
  std::unique_ptr<ResidentDataset> resident;  // on GPUs
  std::vector<Batch> batches;
};
Preloaded preload_batches(const Shape& shape, int64_t batch, uint64_t seed, int count,
                          TrainEngine* engine = nullptr);
// Where preloaded batches are for these devices, as the rows say it.
const char* preloaded_data_name(const std::vector<Device>& devices);

// Steps on the engine, cycling through the preloaded batches.
struct Stepper {
  TrainEngine& engine;
  const std::vector<Batch>& batches;
  std::function<void()> on_step;  // after each step is enqueued (if set)
  size_t next = 0;
  void run(int64_t steps);
  // Runs `steps` and waits for the device: the wall time in seconds.
  double seconds(int64_t steps);
};

// track -> phase -> milliseconds per step. Overlapping spans of one (track, phase) count once
// (their union), so nested spans of one name are not double-counted. The extra track "*" holds,
// per phase, the union over all tracks: the wall time during which some track was in it.
using TrackPhaseMs = std::map<std::string, std::map<std::string, double>>;
TrackPhaseMs per_step_ms(const std::vector<Tracer::Event>& events, int64_t steps);

struct Measurement {
  std::vector<double> window_seconds;  // wall time of each timed window
  int64_t steps_per_window = 0;
  TrackPhaseMs track_ms;               // per step, over every timed window (CUDA: a window
                                       // with device-synchronised spans)
  std::vector<Tracer::Event> trace;    // the traced window's spans (empty without tracing)
  float final_loss = 0;
  std::vector<size_t> peak_memory;     // per device of the engine: bytes in use
  std::vector<size_t> peak_held;       // and bytes held (in use plus cached)
  std::vector<size_t> forward_kept;    // and what a training forward kept for backward
  int64_t comm_bytes = 0;              // engine->comm_bytes_per_step()
  std::string collectives;             // engine->comm_description(): the transport measured
};

// Runs warm-up, `repeat` timed windows of `steps` steps, then the traced window. `batches` are
// this engine's inputs (DP: global batches; DDP: this rank's local batches). `on_step` (if set)
// runs after every step is enqueued (DDP ranks report progress with it).
Measurement measure(TrainEngine& engine, const std::vector<Batch>& batches, const RunOptions& o,
                    const std::function<void()>& on_step = {});

// Seconds of one training step of one device (a single-device engine on `device`, the model
// and batch per device of `o`): 1 untimed step, then the mean of 2. For choosing step counts.
double probe_step_seconds(const Device& device, const RunOptions& o);

// Adds the windows of `next` (same steps per window) to `into`: per-step phase times become
// the mean over both, peaks the maximum, the trace and loss those of `next` when it has them.
void merge(Measurement& into, const Measurement& next);

nlohmann::json to_json(const Measurement& m);
Measurement measurement_from_json(const nlohmann::json& j);

}  // namespace replica::bench
