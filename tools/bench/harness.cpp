#include "tools/bench/harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <csignal>

#include <unistd.h>

#include "engine/allocator.h"
#include "engine/data/dataset.h"
#include "engine/error.h"

namespace replica::bench {

namespace {

using Clock = std::chrono::steady_clock;

// Sum of the union of [start, end) intervals.
double union_us(std::vector<std::pair<int64_t, int64_t>>& spans) {
  std::sort(spans.begin(), spans.end());
  double total = 0;
  int64_t cur_start = 0, cur_end = 0;
  bool open = false;
  for (const auto& [s, e] : spans) {
    if (open && s <= cur_end) {
      cur_end = std::max(cur_end, e);
      continue;
    }
    if (open) total += double(cur_end - cur_start);
    cur_start = s;
    cur_end = e;
    open = true;
  }
  if (open) total += double(cur_end - cur_start);
  return total;
}

// Test hooks: REPLICA_BENCH_KILL_RANK=k makes DDP rank k die by SIGKILL after its warm-up,
// REPLICA_BENCH_STALL_RANK=k makes it stop there forever, so tests can check that a dead or
// stuck rank ends the benchmark with an error instead of a hang.
void maybe_die(const TrainEngine& engine) {
  if (engine.world_size() <= 1) return;
  const char* kill = std::getenv("REPLICA_BENCH_KILL_RANK");
  if (kill && std::atoi(kill) == engine.rank()) std::raise(SIGKILL);
  const char* stall = std::getenv("REPLICA_BENCH_STALL_RANK");
  if (stall && std::atoi(stall) == engine.rank())
    for (;;) pause();
}

}  // namespace

void Stepper::run(int64_t steps) {
  for (int64_t s = 0; s < steps; ++s) {
    engine.train_step(batches[next++ % batches.size()]);
    if (on_step) on_step();
  }
}

double Stepper::seconds(int64_t steps) {
  const auto t0 = Clock::now();
  run(steps);
  engine.synchronize();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Preloaded preload_batches(const Shape& shape, int64_t batch, uint64_t seed, int count,
                          TrainEngine* engine) {
  Preloaded p;
  p.data = make_synthetic(batch * count, shape, 10, seed);
  if (engine && engine->primary().is_cuda()) {
    p.resident = std::make_unique<ResidentDataset>(*p.data);
    for (DeviceContext* ctx : engine->contexts()) p.resident->hold_on(*ctx);
  }
  for (int i = 0; i < count; ++i) {
    std::vector<int64_t> idx(batch);
    for (int64_t s = 0; s < batch; ++s) idx[s] = i * batch + s;
    Batch b;
    if (p.resident) {
      b.indices = Tensor::empty(pinned_allocator(), {batch}, DType::I32);
      for (int64_t s = 0; s < batch; ++s) b.indices.i32()[s] = int32_t(idx[s]);
      b.resident = p.resident.get();
    } else {
      b = read_batch(*p.data, idx);
    }
    b.index = i;
    p.batches.push_back(std::move(b));
  }
  return p;
}

const char* preloaded_data_name(const std::vector<Device>& devices) {
  return !devices.empty() && devices[0].is_cuda()
             ? "synthetic, preloaded in device memory (loader not timed)"
             : "synthetic, preloaded in host memory (loader not timed)";
}

TrackPhaseMs per_step_ms(const std::vector<Tracer::Event>& events, int64_t steps) {
  std::map<std::string, std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>> spans;
  for (const auto& e : events) {
    spans[e.track][e.phase].push_back({e.start, e.end});
    spans["*"][e.phase].push_back({e.start, e.end});
  }
  TrackPhaseMs out;
  for (auto& [track, phases] : spans)
    for (auto& [phase, list] : phases)
      out[track][phase] = steps > 0 ? union_us(list) / 1e3 / double(steps) : 0.0;
  return out;
}

Measurement measure(TrainEngine& engine, const std::vector<Batch>& batches, const RunOptions& o,
                    const std::function<void()>& on_step) {
  REPLICA_CHECK(!batches.empty(), "no batches to train on");
  Tracer& tracer = Tracer::global();
  const bool cuda = engine.primary().is_cuda();
  Stepper stepper{engine, batches, on_step};
  Measurement m;
  m.steps_per_window = o.steps;

  tracer.set_recording(false);
  tracer.set_sync_device(false);
  stepper.run(std::max<int64_t>(o.warmup, 1));  // at least one: buffers, connections, caches
  engine.synchronize();
  maybe_die(engine);

  // Timed windows. On CPU the spans of these very windows give the phase times; on CUDA spans
  // only see the host unless they synchronise, which would serialise the overlap being timed,
  // so there the phases come from a separate window with device-synchronised spans.
  std::vector<Tracer::Event> timed_events;
  for (int r = 0; r < o.repeat; ++r) {
    tracer.clear_events();
    tracer.set_recording(!cuda);
    m.window_seconds.push_back(stepper.seconds(o.steps));
    tracer.set_recording(false);
    auto ev = tracer.events();
    timed_events.insert(timed_events.end(), ev.begin(), ev.end());
  }
  m.final_loss = engine.last_loss();
  REPLICA_CHECK(std::isfinite(m.final_loss), "loss is {} after the timed steps", m.final_loss);
  if (cuda) {
    const int64_t phase_steps = std::min<int64_t>(o.steps, 20);
    tracer.clear_events();
    tracer.set_sync_device(true);
    tracer.set_recording(true);
    stepper.run(phase_steps);
    engine.synchronize();
    tracer.set_recording(false);
    tracer.set_sync_device(false);
    m.track_ms = per_step_ms(tracer.events(), phase_steps);
  } else {
    m.track_ms = per_step_ms(timed_events, o.steps * o.repeat);
  }

  if (o.trace_steps > 0) {
    tracer.clear_events();
    tracer.set_sync_device(cuda);  // spans show device time (as replica-train --trace does)
    tracer.set_recording(true);
    stepper.run(o.trace_steps);
    engine.synchronize();
    tracer.set_recording(false);
    tracer.set_sync_device(false);
    m.trace = tracer.events();
  }
  tracer.clear_events();
  m.peak_memory = engine.peak_memory_bytes();
  m.peak_held = engine.peak_held_bytes();
  for (int64_t b : engine.forward_kept_bytes()) m.forward_kept.push_back(size_t(b));
  m.comm_bytes = engine.comm_bytes_per_step();
  m.collectives = engine.comm_description();
  return m;
}

EngineOptions engine_options(const RunOptions& run) {
  EngineOptions eo;
  eo.model = run.model;
  eo.input_shape = run.input_shape;
  eo.num_classes = 10;
  eo.seed = run.seed;
  eo.threads_per_device = run.threads_per_device;
  eo.precision = run.precision;
  eo.cudnn_benchmark = run.cudnn_benchmark;
  eo.channels_last = run.channels_last;
  eo.cuda_graphs = run.cuda_graphs;
  return eo;
}

double probe_step_seconds(const Device& device, const RunOptions& o) {
  auto engine = make_single_device_engine(device, engine_options(o));
  const Preloaded pre =
      preload_batches(o.input_shape, o.batch_per_device, o.seed, 2, engine.get());
  Stepper stepper{*engine, pre.batches, {}};
  stepper.seconds(1);
  return stepper.seconds(2) / 2;
}

void merge(Measurement& into, const Measurement& next) {
  if (into.window_seconds.empty()) {
    into = next;
    return;
  }
  REPLICA_CHECK(into.steps_per_window == next.steps_per_window,
                "merging windows of {} and {} steps", into.steps_per_window, next.steps_per_window);
  const double a = double(into.window_seconds.size()), b = double(next.window_seconds.size());
  TrackPhaseMs merged;
  const TrackPhaseMs* sources[] = {&into.track_ms, &next.track_ms};
  for (const TrackPhaseMs* src : sources)
    for (const auto& [track, phases] : *src)
      for (const auto& [phase, ms] : phases) merged[track][phase] = 0;
  for (auto& [track, phases] : merged)
    for (auto& [phase, ms] : phases) {
      auto get = [&](const TrackPhaseMs& t) {
        auto it = t.find(track);
        if (it == t.end()) return 0.0;
        auto p = it->second.find(phase);
        return p == it->second.end() ? 0.0 : p->second;
      };
      ms = (get(into.track_ms) * a + get(next.track_ms) * b) / (a + b);
    }
  into.track_ms = merged;
  into.window_seconds.insert(into.window_seconds.end(), next.window_seconds.begin(),
                             next.window_seconds.end());
  if (!next.trace.empty()) into.trace = next.trace;
  into.final_loss = next.final_loss;
  for (auto peaks :
       {&Measurement::peak_memory, &Measurement::peak_held, &Measurement::forward_kept}) {
    std::vector<size_t>& a = into.*peaks;
    const std::vector<size_t>& b = next.*peaks;
    a.resize(std::max(a.size(), b.size()), 0);
    for (size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
  }
  into.comm_bytes = std::max(into.comm_bytes, next.comm_bytes);
  if (!next.collectives.empty()) into.collectives = next.collectives;
}

nlohmann::json to_json(const Measurement& m) {
  nlohmann::json trace = nlohmann::json::array();
  for (const auto& e : m.trace) trace.push_back({e.track, e.phase, e.start, e.end});
  return {{"window_seconds", m.window_seconds}, {"steps_per_window", m.steps_per_window},
          {"track_ms", m.track_ms},             {"trace", trace},
          {"final_loss", m.final_loss},         {"peak_memory", m.peak_memory},
          {"peak_held", m.peak_held},           {"forward_kept", m.forward_kept},
          {"comm_bytes", m.comm_bytes},         {"collectives", m.collectives}};
}

Measurement measurement_from_json(const nlohmann::json& j) {
  Measurement m;
  m.window_seconds = j.at("window_seconds").get<std::vector<double>>();
  m.steps_per_window = j.at("steps_per_window").get<int64_t>();
  m.track_ms = j.at("track_ms").get<TrackPhaseMs>();
  for (const auto& e : j.at("trace"))
    m.trace.push_back({e.at(0).get<std::string>(), e.at(1).get<std::string>(),
                       e.at(2).get<int64_t>(), e.at(3).get<int64_t>()});
  m.final_loss = j.at("final_loss").get<float>();
  m.peak_memory = j.at("peak_memory").get<std::vector<size_t>>();
  m.peak_held = j.at("peak_held").get<std::vector<size_t>>();
  m.forward_kept = j.at("forward_kept").get<std::vector<size_t>>();
  m.comm_bytes = j.at("comm_bytes").get<int64_t>();
  m.collectives = j.value("collectives", "");
  return m;
}

}  // namespace replica::bench
