#include "parallel/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "engine/data/dataset.h"
#include "engine/error.h"
#include "engine/trace.h"
#include "parallel/checkpointing.h"
#include "parallel/ddp_engine.h"
#include "parallel/distributed_sampler.h"
#include "parallel/dp_engine.h"
#include "parallel/run_summary.h"
#include "parallel/stop_request.h"
#include "parallel/store.h"

namespace replica {

namespace {

struct Datasets {
  std::unique_ptr<Dataset> train, test;
};

Datasets open_data(const TrainConfig& c) {
  Datasets d;
  const auto& in = c.engine.input_shape;
  const int classes = int(c.engine.num_classes);
  if (c.synthetic) {
    d.train = make_synthetic(c.synthetic_size, in, classes, c.engine.seed);
    d.test = make_synthetic(std::max<int64_t>(c.synthetic_size / 10, 1), in, classes,
                            c.engine.seed + 0x7E57ull);
  } else {
    d.train = open_mnist(c.data_dir, true);
    d.test = open_mnist(c.data_dir, false);
    REPLICA_USAGE_CHECK(d.test->sample_shape() == d.train->sample_shape(),
                        "{}: train images are {}, test images {}", c.data_dir,
                        shape_str(d.train->sample_shape()), shape_str(d.test->sample_shape()));
  }
  return d;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

// Each process evaluates its interleaved shard (rank, rank+R, ...: no padding, so nothing is
// counted twice); the totals are summed across processes, so every rank reports the same.
EvalResult evaluate(TrainEngine& engine, const Dataset& test, int64_t batch_size) {
  TraceSpan span("host", "evaluate");
  engine.set_training(false);
  Loader loader(test, batch_size, false);
  std::vector<int64_t> shard;
  for (int64_t i = engine.rank(); i < test.size(); i += engine.world_size()) shard.push_back(i);
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  if (!shard.empty()) {
    loader.start_epoch(std::move(shard), 0);
    while (auto batch = loader.next()) {
      engine.eval_batch(*batch, loss_sum, correct);
      seen += batch->size();
    }
  }
  std::vector<double> totals = {loss_sum, double(correct), double(seen)};
  engine.reduce_metrics(totals);
  engine.set_training(true);
  return {totals[2] ? totals[0] / totals[2] : 0.0, totals[2] ? totals[1] / totals[2] : 0.0};
}

// Which training samples this process reads: the DistributedSampler's share (DDP). With one
// process the share is the whole epoch order, epoch_order(n, seed, epoch, shuffle).
DistributedSampler train_sampler(const TrainConfig& c, const TrainEngine& engine, int64_t n) {
  SamplerOptions so;
  so.dataset_size = n;
  so.num_replicas = engine.world_size();
  so.rank = engine.rank();
  so.shuffle = c.shuffle;
  so.seed = c.engine.seed;
  so.drop_last = c.drop_last;
  return DistributedSampler(so);
}

}  // namespace

namespace {

// The engine a config asks for. Sets c.batch_size from --batch-per-device once the number of
// devices (DP) or ranks (DDP) is known.
std::unique_ptr<TrainEngine> make_engine(TrainConfig& c, const std::vector<Device>& devices) {
  // Gradient buckets (DP and DDP): 1 MB first, so communication starts early, then the cap.
  const size_t bucket_bytes = size_t(c.bucket_cap_mb * (1 << 20));
  const size_t first_bucket_bytes = std::min(bucket_bytes, size_t(1) << 20);
  if (c.mode == "single") {
    if (c.batch_per_device > 0) c.batch_size = c.batch_per_device;
    return make_single_device_engine(devices[0], c.engine);
  }
  if (c.mode == "dp") {
    if (c.batch_per_device > 0) c.batch_size = c.batch_per_device * int64_t(devices.size());
    DpOptions dp;
    dp.strategy = parse_reduce_strategy(c.reduce);
    dp.bucket_bytes = bucket_bytes;
    dp.first_bucket_bytes = first_bucket_bytes;
    return make_dp_engine(devices, c.engine, dp);
  }
  Rendezvous rv = rendezvous_env_ranks();
  DdpOptions ddp;
  ddp.timeout = std::chrono::milliseconds(int64_t(c.timeout_s * 1000));
  if (rv.world_size > 1) {
    RendezvousOptions ro;
    ro.init_method = c.init_method;
    ro.timeout = ddp.timeout;
    rv = rendezvous(ro);
  }
  if (c.batch_per_device > 0) c.batch_size = c.batch_per_device * rv.world_size;
  REPLICA_USAGE_CHECK(c.batch_size % rv.world_size == 0,
                      "--batch-size {} is the global batch: it must divide by the {} ranks",
                      c.batch_size, rv.world_size);
  ddp.accumulate = c.accumulate;
  ddp.rank = rv.rank;
  ddp.world_size = rv.world_size;
  ddp.store = rv.store;
  if (const char* addr = std::getenv("MASTER_ADDR")) ddp.host = addr;
  ddp.bucket_bytes = bucket_bytes;
  ddp.first_bucket_bytes = first_bucket_bytes;
  const bool own_gpu = devices[0].is_cuda() && cuda_device_count() >= rv.local_world_size;
  ddp.backend = parse_comm_backend(c.backend != "auto" ? c.backend : own_gpu ? "nccl" : "gloo");
  if (devices[0].is_cpu() && c.engine.threads_per_device == 0)
    c.engine.threads_per_device = std::max(1, cpu_cores() / std::max(1, rv.local_world_size));
  return make_ddp_engine(devices[0], c.engine, ddp);
}

// Whether to stop after this step: this process got SIGINT/SIGTERM, or (DDP) any rank did.
// The ranks must stop after the same step (the checkpoint holds a position every rank reached),
// so they agree through a small all-reduce. That all-reduce is a synchronisation point: every
// step it cost 12% of a 2-rank CNN step on 2 cores. So the ranks agree every step only for the
// first steps, time them, and then every K steps with K (rank 0's choice, shared through the
// same all-reduce) making the interval about kStopCheckSeconds: < 1% of the time, and a stop
// that lands within a fraction of a second.
class StopAgreement {
 public:
  static constexpr double kStopCheckSeconds = 0.25;
  static constexpr int64_t kCalibrationSteps = 10;

  bool after_step(TrainEngine& engine, int64_t steps_run) {
    if (engine.world_size() <= 1) return StopRequest::requested();
    if (steps_run == 1) t_first_ = Tracer::now_us();
    const bool calibrate = steps_run == kCalibrationSteps;
    if (!calibrate && steps_run % every_ != 0) return false;
    std::vector<double> v = {StopRequest::requested() ? 1.0 : 0.0, 0.0};
    if (calibrate && engine.rank() == 0) {
      const double step_s = (Tracer::now_us() - t_first_) / 1e6 / double(kCalibrationSteps - 1);
      v[1] = double(std::clamp<int64_t>(int64_t(std::ceil(kStopCheckSeconds / step_s)), 1, 1000));
    }
    engine.reduce_metrics(v);
    if (calibrate) every_ = std::max<int64_t>(1, int64_t(v[1]));
    return v[0] > 0;
  }

 private:
  int64_t every_ = 1;
  int64_t t_first_ = 0;
};

// Rank 0's trace, with the other ranks' (FILE.rankR, written by them on this machine) merged
// in: one process row per rank, on one time axis.
template <class Say>
void write_merged_trace(const std::string& path, int world, Say&& say) {
  nlohmann::json events = Tracer::global().chrome_events(1, world > 1 ? "rank 0" : "replica");
  int merged = 1;
  for (int r = 1; r < world; ++r) {
    std::ifstream in(fmt::format("{}.rank{}", path, r));
    if (!in) continue;  // another machine's rank: its file stays there
    const nlohmann::json other = nlohmann::json::parse(in, nullptr, false);
    if (other.is_discarded() || !other.contains("traceEvents")) continue;
    for (const auto& e : other["traceEvents"]) events.push_back(e);
    ++merged;
  }
  write_trace_file(path, events);
  say(world > 1 ? fmt::format("trace: {} ({} of {} ranks merged; rank R>0 alone: {}.rank<R>)",
                              path, merged, world, path)
                : fmt::format("trace: {} ({} spans)", path, Tracer::global().event_count()));
}

// Restores the signal handlers however run_training ends.
struct StopHandlers {
  explicit StopHandlers(bool on) : on_(on) {
    if (on_) StopRequest::install();
  }
  ~StopHandlers() {
    if (on_) StopRequest::uninstall();
  }
  bool on_;
};

}  // namespace

nlohmann::json run_training(const TrainConfig& config) {
  validate(config);
  TrainConfig c = config;
  Tracer& tracer = Tracer::global();
  tracer.set_recording(!c.trace_file.empty());
  tracer.set_sync_device(!c.trace_file.empty());
  StopHandlers handlers(c.stop_on_signal);

  Datasets data = open_data(c);
  if (!c.synthetic) c.engine.input_shape = data.train->sample_shape();  // the model fits the data
  c.engine.num_classes = std::max<int64_t>(c.engine.num_classes, data.train->num_classes());
  std::string device_spec;
  std::vector<Device> devices = resolve_devices(c, &device_spec);
  std::unique_ptr<TrainEngine> engine = make_engine(c, devices);
  const bool lead = engine->rank() == 0;  // only rank 0 prints and writes files
  const int world = engine->world_size();
  const int64_t local_batch = c.batch_size / world;
  if (!lead) c.quiet = true;
  const bool tty = isatty(fileno(stdout));
  auto say = [&](const std::string& line) {
    if (!c.quiet) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  };
  say(fmt::format("replica: {} on {} ({} mode{}), batch {}, {}", engine->model().summary(),
                  world > 1 ? fmt::format("{} ranks", world) : device_spec, engine->mode(),
                  world > 1 ? fmt::format(", {} per rank", local_batch) : "", c.batch_size,
                  data.train->describe()));

  if (world > 1) say("collectives: " + engine->comm_description());

  Loader loader(*data.train, local_batch, c.drop_last);
  DistributedSampler sampler = train_sampler(c, *engine, data.train->size());
  const int64_t per_epoch = loader.batches_per_epoch(sampler.num_samples());
  REPLICA_USAGE_CHECK(per_epoch > 0, "no complete batch of {} in {} samples with drop_last",
                      c.batch_size, data.train->size());
  const int64_t planned_steps =
      c.max_steps > 0 ? std::min(c.max_steps, per_epoch * c.epochs) : per_epoch * c.epochs;

  RunPosition pos;
  if (c.resume) {
    pos = load_training_checkpoint(c.checkpoint_dir, *engine, c.engine.seed, c.batch_size);
    say(fmt::format("resumed from {} at epoch {}, step {}", checkpoint_path(c.checkpoint_dir),
                    pos.epoch + 1, pos.global_step));
  }

  tracer.reset_totals();
  int64_t samples = 0, steps_run = 0;
  float final_loss = std::nanf("");
  EvalResult eval;
  nlohmann::json epochs_json = nlohmann::json::array();
  const int64_t t_start = Tracer::now_us();
  double train_seconds = 0;
  bool stop = false, evaluated = false;
  StopAgreement stop_agreement;
  int stop_signal = 0;
  for (int64_t epoch = pos.epoch; epoch < c.epochs && !stop; ++epoch) {
    const int64_t first = epoch == pos.epoch ? pos.batch_in_epoch : 0;
    sampler.set_epoch(epoch);
    loader.start_epoch(sampler.indices(), epoch, first);
    const int64_t t_epoch = Tracer::now_us();
    const PhaseTotals phases_before = tracer.phase_totals_us();
    int64_t epoch_samples = 0, epoch_steps = 0;
    // Released one step later: a batch's release waits for its device copies (pinned buffers are
    // refilled), and by then they ran long ago, so the host stays a step ahead of the GPU.
    std::shared_ptr<Batch> previous;
    int64_t b = first;
    for (; b < per_epoch; ++b) {
      if (c.max_steps > 0 && pos.global_step >= c.max_steps) {
        stop = true;
        break;
      }
      engine->optimizer().set_lr(
          scheduled_lr(c.lr_schedule, c.engine.optimizer.lr, pos.global_step, planned_steps));
      std::shared_ptr<Batch> batch;
      {
        TraceSpan span("host", "data_wait");
        batch = loader.next();
      }
      if (!batch) break;
      engine->train_step(*batch);
      previous = batch;
      ++pos.global_step;
      ++steps_run;
      ++epoch_steps;
      samples += batch->size() * world;  // every rank trains a batch of the same size
      epoch_samples += batch->size() * world;
      const bool interrupted = c.stop_on_signal && stop_agreement.after_step(*engine, steps_run);
      const bool last_step =
          (b + 1 == per_epoch) || pos.global_step == c.max_steps || interrupted;
      if (pos.global_step % c.log_every == 0 || last_step) {
        const float loss = engine->last_loss();  // this process's (DDP: its share of the batch)
        final_loss = loss;
        if (world > 1 && last_step) {  // the whole batch's loss: the mean over the ranks
          std::vector<double> v = {loss};
          engine->reduce_metrics(v);
          final_loss = float(v[0] / world);
        }
        REPLICA_USAGE_CHECK(std::isfinite(final_loss),
                            "training diverged: loss is {} at step {} (lower --lr?)", final_loss,
                            pos.global_step);
        const double elapsed = (Tracer::now_us() - t_start) / 1e6;
        const double rate = samples / std::max(elapsed, 1e-9);
        const double eta = (planned_steps - pos.global_step) * c.batch_size / rate;
        // The step counter counts what bounds the run: the epoch's batches, or --max-steps.
        const bool steps_bound = planned_steps < per_epoch * c.epochs;
        std::string line = fmt::format(
            "epoch {}/{}  step {:>5}/{}  {} {:.4f}  {:.0f} samples/s  ETA {}", epoch + 1,
            c.epochs, steps_bound ? pos.global_step : b + 1,
            steps_bound ? planned_steps : per_epoch, world > 1 ? "rank-0 loss" : "loss", loss,
            rate, fmt_duration(eta));
        if (!c.quiet) {
          if (tty) std::printf("\r%s\033[K", line.c_str());
          else std::printf("%s\n", line.c_str());
          std::fflush(stdout);
        }
      }
      if (interrupted) {
        stop = true;
        stop_signal = StopRequest::signal() ? StopRequest::signal() : SIGINT;  // a peer's
        ++b;  // this batch is done
        break;
      }
    }
    engine->synchronize();
    previous.reset();
    if (!c.quiet && tty) std::printf("\n");
    const double epoch_seconds = (Tracer::now_us() - t_epoch) / 1e6;
    train_seconds += epoch_seconds;
    const bool epoch_complete = b >= per_epoch;
    pos.epoch = epoch_complete ? epoch + 1 : epoch;
    pos.batch_in_epoch = epoch_complete ? 0 : b;
    nlohmann::json ej = {
        {"epoch", epoch + 1},
        {"complete", epoch_complete},
        {"steps", epoch_steps},
        {"train_loss", final_loss},
        {"samples", epoch_samples},
        {"seconds", epoch_seconds},
        {"samples_per_sec", epoch_samples / std::max(epoch_seconds, 1e-9)},
        {"phase_ms_per_step",
         phase_ms_per_step(tracer.phase_totals_us(), phases_before, epoch_steps)}};
    // An interrupted run stops at once: no evaluation (a resumed run evaluates this epoch).
    if (c.evaluate && !stop_signal) {
      // The same global evaluation batch in every mode: DDP ranks take their share of it.
      eval = evaluate(*engine, *data.test,
                      std::max<int64_t>(1, std::max<int64_t>(c.batch_size, 256) / world));
      evaluated = true;
      ej["test_loss"] = eval.loss;
      ej["test_accuracy"] = eval.accuracy;
    }
    if (!c.checkpoint_dir.empty() && lead) {
      TraceSpan span("host", "checkpoint");
      save_training_checkpoint(c.checkpoint_dir, *engine, pos, c.engine.seed, c.batch_size);
    }
    epochs_json.push_back(ej);
    const char* how = epoch_complete ? "done" : stop_signal ? "interrupted" : "ended (--max-steps)";
    if (!stop_signal || epoch_steps > 0)
      say(fmt::format("epoch {} {}: train loss {:.4f}{}, {:.0f} samples/s, {}", epoch + 1, how,
                      final_loss,
                      ej.contains("test_accuracy")
                          ? fmt::format(", test loss {:.4f}, test accuracy {:.4f}", eval.loss,
                                        eval.accuracy)
                          : "",
                      epoch_samples / std::max(epoch_seconds, 1e-9), fmt_duration(epoch_seconds)));
  }

  // DDP: each rank's device and peak memory, for rank 0's report (every rank takes part).
  std::vector<std::string> device_names;
  std::vector<size_t> peaks = engine->peak_memory_bytes();
  for (const auto& d : engine->devices()) device_names.push_back(d.str());
  if (world > 1) {
    // Floats carry the numbers: bytes as MiB and remainder, exact below 16 TiB.
    std::vector<double> v(size_t(4 * world), 0.0);
    const size_t r = size_t(engine->rank());
    v[4 * r] = double(peaks[0] >> 20);
    v[4 * r + 1] = double(peaks[0] & ((1u << 20) - 1));
    v[4 * r + 2] = double(engine->devices()[0].index);
    v[4 * r + 3] = double(engine->devices()[0].slot);
    engine->reduce_metrics(v);
    peaks.assign(size_t(world), 0);
    device_names.assign(size_t(world), "");
    for (size_t i = 0; i < size_t(world); ++i) {
      peaks[i] = (size_t(v[4 * i]) << 20) + size_t(v[4 * i + 1]);
      Device d = engine->devices()[0];
      d.index = int(v[4 * i + 2]);
      d.slot = int(v[4 * i + 3]);
      device_names[i] = fmt::format("rank {} {}", i, d.str());
    }
  }
  // DDP traces: every rank writes its own before the ranks part; rank 0 then merges them.
  if (!c.trace_file.empty() && !lead)
    tracer.write_chrome_json(fmt::format("{}.rank{}", c.trace_file, engine->rank()),
                             engine->rank() + 1, fmt::format("rank {}", engine->rank()));

  engine->finish();  // DDP: every rank done with its collectives before any leaves

  const nlohmann::json phase_ms = phase_ms_per_step(tracer.phase_totals_us(), {}, steps_run);
  const double macs = engine->forward_macs_per_sample();
  const double sps = samples / std::max(train_seconds, 1e-9);
  nlohmann::json devices_json = nlohmann::json::array();
  for (const auto& d : engine->devices()) devices_json.push_back(d.str());
  // DDP: one entry per rank, "rank R cpu:R" (DP: one per device of this process).
  nlohmann::json memory_devices = device_names;
  nlohmann::json m = {
      {"model", c.engine.model},
      {"mode", engine->mode()},
      {"devices", devices_json},
      {"world_size", world},
      // Logical devices on one GPU: a correctness run, not a scaling measurement.
      {"devices_share_gpu", engine->shares_gpu()},
      {"collectives", world > 1 ? nlohmann::json(engine->comm_description()) : nlohmann::json()},
      {"reduce", c.mode == "dp" ? nlohmann::json(c.reduce) : nlohmann::json(nullptr)},
      {"comm_bytes_per_step", engine->comm_bytes_per_step()},
      {"device_spec", device_spec},
      {"threads_per_device", engine->primary().threads()},
      {"batch_size", c.batch_size},
      {"optimizer", c.engine.optimizer.name},
      {"lr", c.engine.optimizer.lr},
      {"seed", c.engine.seed},
      {"steps", pos.global_step},
      {"steps_this_run", steps_run},
      {"epochs", epochs_json.size()},
      {"epoch_summaries", epochs_json},
      {"samples_per_sec", sps},
      {"train_seconds", train_seconds},
      {"final_loss", final_loss},
      {"phase_ms_per_step", phase_ms},  // summed over devices (and the communication thread)
      {"phase_share", phase_shares(phase_ms)},
      // BatchNorm normalises each device's (rank's) share of the batch: DP's contiguous chunks
      // and DDP's interleaved sampler shares are different groups of samples.
      {"has_batchnorm", !engine->model().buffers().empty()},
      {"forward_gflop_per_sample", 2 * macs / 1e9},
      // Training = forward + backward (data and weight gradients): ~3x the forward FLOPs.
      {"train_gflops", 3 * 2 * macs * sps / 1e9},
      {"peak_memory_bytes", peaks},
      {"peak_memory_devices", memory_devices},
      {"interrupted", stop_signal != 0},
      {"config", config_json(c)},
  };
  if (evaluated) {
    m["test_accuracy"] = eval.accuracy;
    m["test_loss"] = eval.loss;
  }
  if (stop_signal) m["stop_signal"] = stop_signal;
  if (!c.trace_file.empty() && lead) write_merged_trace(c.trace_file, world, say);
  if (lead && !c.save_model.empty() && !stop_signal) {
    save_model_weights(c.save_model, *engine);
    say(fmt::format("model saved to {}", c.save_model));
  }
  if (!c.metrics_json.empty() && lead) write_json_file(c.metrics_json, m);

  if (stop_signal) {
    say(c.checkpoint_dir.empty()
            ? fmt::format("interrupted: stopped after step {} (no --checkpoint DIR: nothing saved)",
                          pos.global_step)
            : fmt::format("interrupted: stopped after step {}; checkpoint {} written, continue "
                          "with --resume",
                          pos.global_step, checkpoint_path(c.checkpoint_dir)));
    return m;
  }
  // DP's phases run on every device's thread and the communication thread; DDP's are rank 0's.
  const std::string scope = world > 1 ? "rank 0" : "summed over devices and threads";
  say("\n" + epoch_table(epochs_json, scope));
  std::string memory;
  for (size_t i = 0; i < peaks.size(); ++i)
    memory += fmt::format("  {} {:.1f} MB", device_names[i], peaks[i] / 1e6);
  say("time per step by phase (" + scope + "):" + phase_line(phase_ms));
  say(std::string(world > 1 ? "peak memory per rank:" : "peak memory per device:") + memory);
  if (m.contains("test_accuracy"))
    say(fmt::format("test accuracy {:.4f}  test loss {:.4f}  ({} steps, {:.0f} samples/s, "
                    "{:.1f} GFLOP/s)",
                    eval.accuracy, eval.loss, pos.global_step, sps, 3 * 2 * macs * sps / 1e9));
  return m;
}

}  // namespace replica
