#include "parallel/loop/train_loop.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/data/data_dir.h"
#include "engine/error.h"
#include "engine/trace.h"
#include "parallel/comm/rank_agreement.h"
#include "parallel/loop/run_summary.h"
#include "parallel/rendezvous/rendezvous.h"

namespace replica {

TrainLoop::TrainLoop(const TrainConfig& config) : c_(config), lr_schedule_(c_.lr_schedule) {
  if (c_.synthetic) {
    const auto& in = c_.engine.input_shape;
    const int classes = int(c_.engine.num_classes);
    train_ = make_synthetic(c_.synthetic_size, in, classes, c_.engine.seed);
    test_ = make_synthetic(std::max<int64_t>(c_.synthetic_size / 10, 1), in, classes,
                           c_.engine.seed + 0x7E57ull);
  } else {
    DataSplits d = open_data_dir(c_.data_dir, c_.evaluate,  // --no-eval needs no test files
                                 {c_.engine.input_shape, c_.augment, c_.engine.seed});
    train_ = std::move(d.train);
    test_ = std::move(d.test);
    c_.engine.input_shape = train_->sample_shape();  // the model fits the data
    // A class per directory; MNIST-format labels up to 9 still make a 10-class model.
    if (d.image_folder) c_.engine.num_classes = train_->num_classes();
  }
  c_.engine.num_classes = std::max<int64_t>(c_.engine.num_classes, train_->num_classes());
  std::string device_spec;
  std::vector<Device> devices = resolve_devices(c_, &device_spec);
  engine_ = make_engine(c_, devices);
  world_ = engine_->world_size();
  if (world_ > 1) agree_on_settings();
  // Ranks sharing one GPU each hold their own copy of a resident set.
  const int copies_per_gpu = world_ > 1 && engine_->shares_gpu() ? world_ : 1;
  const DataPlacement placement = resolve_data_placement(
      parse_data_placement(c_.data_placement), *train_, engine_->devices(), copies_per_gpu);
  c_.data_placement = data_placement_name(placement);  // what the metrics record
  report_ = std::make_unique<RunReport>(c_, *engine_, device_spec);
  const int64_t local_batch = c_.batch_size / world_;
  report_->say(fmt::format("replica: {} on {} ({} mode, {}{}{}{}), batch {}, {}",
                           engine_->model().summary(),
                           world_ > 1 ? fmt::format("{} ranks", world_) : device_spec,
                           engine_->mode(), precision_name(c_.engine.precision),
                           c_.engine.channels_last ? ", channels_last" : "",
                           c_.engine.cudnn_benchmark ? ", cuDNN algorithms timed" : "",
                           world_ > 1 ? fmt::format(", {} per rank", local_batch) : "",
                           c_.batch_size, train_->describe()));
  if (world_ > 1) report_->say("collectives: " + engine_->comm_description());
  if (placement == DataPlacement::Device) place_data();

  // Which training samples this process reads: the DistributedSampler's share (DDP). With one
  // process the share is the whole epoch order, epoch_order(n, seed, epoch, shuffle).
  sampler_ = std::make_unique<DistributedSampler>(
      SamplerOptions{train_->size(), world_, engine_->rank(), c_.shuffle, c_.engine.seed,
                     c_.drop_last, world_ > 1 ? rendezvous_env_ranks().local_world_size : 1});
  // An engine that copies batches a step ahead (TrainEngine::prefetch) holds one batch more:
  // a buffer more keeps the loader two batches ahead of it.
  look_ahead_ = engine_->prefetches() && !resident_;
  loader_ = std::make_unique<Loader>(*train_, local_batch, c_.drop_last, look_ahead_ ? 3 : 2,
                                     resident_.get());
  per_epoch_ = loader_->batches_per_epoch(sampler_->num_samples());
  REPLICA_USAGE_CHECK(per_epoch_ > 0, "no complete batch of {} in {} samples with drop_last",
                      c_.batch_size, train_->size());
  // Saturated: `--epochs 1e18 --max-steps 100` means "until --max-steps", not an overflow
  // that plans a negative number of steps and trains nothing.
  epochs_steps_ = c_.epochs > std::numeric_limits<int64_t>::max() / per_epoch_
                      ? std::numeric_limits<int64_t>::max()
                      : per_epoch_ * c_.epochs;
  planned_steps_ = c_.max_steps > 0 ? std::min(c_.max_steps, epochs_steps_) : epochs_steps_;
  if (c_.resume) resume();
}

TrainLoop::~TrainLoop() = default;

// Restores the position, parameters and optimizer state from --checkpoint.
void TrainLoop::resume() {
  pos_ = load_training_checkpoint(c_.checkpoint_dir, *engine_, run_identity());
  report_->say(fmt::format("resumed from {} at epoch {}, step {}",
                           checkpoint_path(c_.checkpoint_dir), pos_.epoch + 1,
                           pos_.global_step));
  const std::string precision = precision_name(c_.engine.precision);
  if (!pos_.precision.empty() && pos_.precision != precision)
    report_->say(fmt::format("the checkpoint was trained in {}; this run goes on in {} (give "
                             "--precision {} to keep it)",
                             pos_.precision, precision, pos_.precision));
  // --epochs and --max-steps count from the run's first step, the resumed ones included.
  const std::string plan =
      fmt::format("--epochs {}{}", c_.epochs,
                  c_.max_steps > 0 ? fmt::format(" --max-steps {}", c_.max_steps) : "");
  REPLICA_USAGE_CHECK(pos_.global_step <= planned_steps_,
                      "--resume: the checkpoint in {} is at step {}, past the {} steps that {} "
                      "plan (they count the resumed steps too): give more to train on",
                      c_.checkpoint_dir, pos_.global_step, planned_steps_, plan);
  if (pos_.global_step == planned_steps_)
    report_->say(fmt::format("nothing left to train: the checkpoint has all {} steps that {} "
                             "plan (give more to train on)",
                             planned_steps_, plan));
}

// DDP: what decides the math and the number of steps is the same on every rank; a rank started
// with another --lr trained apart, one with another --epochs waited alone in an all-reduce until
// the timeout. Paths, devices and threads may differ between nodes.
void TrainLoop::agree_on_settings() {
  const nlohmann::json settings = config_json(c_);
  const std::string hint = "start every rank with the same flags";
  std::vector<Agreed> items;
  for (const char* key : {"model", "input_shape", "num_classes", "synthetic", "synthetic_size",
                          "epochs", "max_steps", "batch_size", "batch_per_device", "optimizer",
                          "lr", "lr_schedule", "momentum", "weight_decay", "nesterov", "seed",
                          "deterministic", "precision", "accumulate", "bucket_cap_mb",
                          "augment"}) {
    std::string flag = std::string("--") + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    items.push_back({flag, int64_t(text_hash(settings.at(key).dump())), false, hint});
  }
  items.push_back({"--no-shuffle", c_.shuffle, false, hint});
  items.push_back({"--drop-last", c_.drop_last, false, hint});
  // These change which collectives run: evaluation all-reduces its sums, resuming broadcasts.
  items.push_back({"--no-eval", c_.evaluate, false, hint});
  items.push_back({"--resume", c_.resume, false, hint});
  items.push_back({"the number of training samples", train_->size(), true,
                   "give every rank the same data"});
  require_same_on_every_rank(
      items, [this](const std::vector<int64_t>& mine) { return engine_->gather_from_ranks(mine); });
}

// The whole training set onto every device's memory, once (shared by the logical devices of a
// GPU): steps then gather their batches there, and the loader thread only hands out indices.
void TrainLoop::place_data() {
  TraceSpan span("host", "place_data");
  const int64_t t0 = Tracer::now_us();
  resident_ = std::make_unique<ResidentDataset>(*train_);
  for (DeviceContext* ctx : engine_->contexts()) resident_->hold_on(*ctx);
  report_->say(fmt::format("data: the training set is held on the device{} ({:.1f} MB{}, {:.1f} s "
                           "to place); each step gathers its batch there",
                           resident_->copies() > 1 ? "s" : "", resident_->bytes() / 1e6,
                           resident_->copies() > 1 ? " each" : "",
                           (Tracer::now_us() - t0) / 1e6));
}

nlohmann::json TrainLoop::run() {
  Tracer::global().reset_totals();
  t_start_us_ = Tracer::now_us();
  const bool finished = pos_.global_step >= planned_steps_;  // resumed at the end
  // The step count ends the run too: --max-steps reached on an epoch's last batch starts no
  // further, empty epoch (which would evaluate and checkpoint the same model again).
  for (int64_t epoch = pos_.epoch;
       epoch < c_.epochs && !stop_ && pos_.global_step < planned_steps_; ++epoch)
    run_epoch(epoch);
  // A run stopped by a signal during its last step saved that step unevaluated: the resumed
  // run has nothing to train and evaluates the trained model (every rank alike).
  if (finished && c_.evaluate) {
    evaluate();
    report_->say(fmt::format("test accuracy {:.4f}{}  test loss {:.4f}", totals_.test_accuracy,
                             report_->top5_note(totals_.test_top5), totals_.test_loss));
    if (keep_if_best(pos_.batch_in_epoch > 0 ? pos_.epoch + 1 : pos_.epoch)) {
      if (!c_.save_best.empty()) report_->say_best_saved(pos_.best_accuracy, pos_.best_epoch);
      write_checkpoint();  // the new best, for the next resume
    }
  }
  totals_.steps = pos_.global_step;
  totals_.best_accuracy = pos_.best_accuracy;
  totals_.best_epoch = pos_.best_epoch;

  report_->gather_ranks();      // every rank takes part
  report_->write_rank_trace();  // DDP: each rank's own, before the ranks part
  engine_->finish();            // DDP: every rank done with its collectives before any leaves
  const nlohmann::json m = report_->metrics(totals_);
  report_->finish(totals_, m);
  return m;
}

TrainLoop::Mark TrainLoop::mark() const {
  return {Tracer::now_us(), Tracer::global().phase_totals_us(), totals_.samples,
          totals_.steps_this_run};
}

void TrainLoop::run_epoch(int64_t epoch) {
  const int64_t first = epoch == pos_.epoch ? pos_.batch_in_epoch : 0;
  sampler_->set_epoch(epoch);
  loader_->start_epoch(sampler_->indices(), epoch, first);
  const Mark start = mark();
  Mark steady = start;  // where this epoch's per-step figures start counting
  const int64_t b = train_batches(epoch, first, start, steady);
  const bool complete = b >= per_epoch_;
  pos_.epoch = complete ? epoch + 1 : epoch;
  pos_.batch_in_epoch = complete ? 0 : b;
  nlohmann::json e = epoch_summary(epoch, complete, start, steady);
  totals_.train_seconds += e["seconds"].get<double>();
  // An interrupted run stops at once: no evaluation (a resumed run evaluates this epoch).
  const bool evaluated = c_.evaluate && !totals_.stop_signal;
  if (evaluated) {
    evaluate();
    e["test_loss"] = totals_.test_loss;
    e["test_accuracy"] = totals_.test_accuracy;
    if (report_->shows_top5()) e["test_top5_accuracy"] = totals_.test_top5;
  }
  // The best model first: the checkpoint's best is then a file already written.
  const bool best = evaluated && keep_if_best(epoch + 1);
  write_checkpoint();
  report_->epoch_done(e, complete                ? "done"
                         : totals_.stop_signal ? "interrupted"
                                               : "ended (--max-steps)");
  if (best && !c_.save_best.empty()) report_->say_best_saved(pos_.best_accuracy, pos_.best_epoch);
}

// With --checkpoint, the lead writes where the run stands (pos_) and the model's state.
void TrainLoop::write_checkpoint() {
  if (c_.checkpoint_dir.empty() || !report_->lead()) return;
  TraceSpan span("host", "checkpoint");
  save_training_checkpoint(c_.checkpoint_dir, *engine_, pos_, run_identity());
}

RunIdentity TrainLoop::run_identity() const {
  return {c_.engine.seed, c_.batch_size,
          fmt::format("{}{} samples{}", c_.synthetic ? "synthetic, " : "", train_->size(),
                      c_.drop_last ? ", drop_last" : ""),
          per_epoch_};
}

int64_t TrainLoop::train_batches(int64_t epoch, int64_t first, const Mark& start, Mark& steady) {
  // Released one step later: a batch's release waits for its device copies (pinned buffers are
  // refilled), and by then they ran long ago, so the host stays a step ahead of the GPU.
  std::shared_ptr<Batch> previous;
  // The batch after this step's, taken from the loader a step early so that the engine copies
  // it to the devices while this step computes (TrainEngine::prefetch), where it does.
  std::shared_ptr<Batch> upcoming;
  const auto next_batch = [&] {
    TraceSpan span("host", "data_wait");
    return loader_->next();
  };
  int64_t b = first;
  for (; b < per_epoch_; ++b) {
    if (c_.max_steps > 0 && pos_.global_step >= c_.max_steps) {
      stop_ = true;
      break;
    }
    engine_->optimizer().set_lr(
        lr_schedule_.at(c_.engine.optimizer.lr, pos_.global_step, planned_steps_, epoch));
    std::shared_ptr<Batch> batch = upcoming ? std::move(upcoming) : next_batch();
    if (!batch) break;
    if (look_ahead_ && b + 1 < per_epoch_ &&
        (c_.max_steps == 0 || pos_.global_step + 1 < c_.max_steps)) {
      upcoming = next_batch();
      if (upcoming) engine_->prefetch(*upcoming);
    }
    engine_->train_step(*batch);
    previous = batch;
    ++pos_.global_step;
    ++totals_.steps_this_run;
    totals_.samples += batch->size() * world_;  // every rank trains a batch of the same size
    const bool interrupted =
        c_.stop_on_signal && stop_agreement_.after_step(*engine_, totals_.steps_this_run);
    const bool last_step =
        (b + 1 == per_epoch_) || pos_.global_step == c_.max_steps || interrupted;
    if (pos_.global_step % c_.log_every == 0 || last_step) log_step(epoch, b, last_step);
    if (totals_.steps_this_run == 1 && !last_step) {  // the steady steps start here
      engine_->synchronize();  // the first step's device work is the first step's time
      steady = mark();
      totals_.first_step = {true, (steady.t_us - start.t_us) / 1e6, totals_.samples,
                            steady.phases};
    }
    if (interrupted) {
      stop_ = true;
      totals_.stop_signal = StopRequest::signal() ? StopRequest::signal() : SIGINT;  // a peer's
      ++b;  // this batch is done
      break;
    }
  }
  engine_->synchronize();
  previous.reset();
  upcoming.reset();  // a stop or --max-steps leaves it untrained
  report_->end_progress();
  return b;
}

// The epoch's line in the metrics: its steps, samples and wall time, and the per-step figures
// from `steady` on (the run's first step left out).
nlohmann::json TrainLoop::epoch_summary(int64_t epoch, bool complete, const Mark& start,
                                        const Mark& steady) const {
  const Mark end = mark();
  const int64_t steady_steps = end.steps - steady.steps;
  const double steady_seconds = (end.t_us - steady.t_us) / 1e6;
  nlohmann::json e = {
      {"epoch", epoch + 1},
      {"complete", complete},
      {"steps", end.steps - start.steps},
      {"train_loss", totals_.final_loss},
      {"lr", engine_->optimizer().lr()},  // the epoch's last step's (--lr-schedule)
      {"samples", end.samples - start.samples},
      {"seconds", (end.t_us - start.t_us) / 1e6},
      {"samples_per_sec", double(end.samples - steady.samples) / std::max(steady_seconds, 1e-9)},
      {"ms_per_step", steady_steps > 0 ? 1e3 * steady_seconds / double(steady_steps) : 0.0},
      {"phase_ms_per_step", phase_ms_per_step(end.phases, steady.phases, steady_steps)}};
  if (steady.steps != start.steps) e["first_step_seconds"] = totals_.first_step.seconds;
  return e;
}

void TrainLoop::log_step(int64_t epoch, int64_t b, bool last_step) {
  const float loss = engine_->last_loss();  // this process's (DDP: its share of the batch)
  totals_.final_loss = loss;
  if (world_ > 1 && last_step) {  // the whole batch's loss: the mean over the ranks
    std::vector<double> v = {loss};
    engine_->reduce_metrics(v);
    totals_.final_loss = float(v[0] / world_);
  }
  REPLICA_USAGE_CHECK(std::isfinite(totals_.final_loss),
                      "training diverged: loss is {} at step {} (lower --lr?)",
                      totals_.final_loss, pos_.global_step);
  const double elapsed = (Tracer::now_us() - t_start_us_) / 1e6;
  const double rate = totals_.samples / std::max(elapsed, 1e-9);
  const double eta = double(planned_steps_ - pos_.global_step) * double(c_.batch_size) / rate;
  // The step counter counts what bounds the run: the epoch's batches, or --max-steps.
  const bool steps_bound = planned_steps_ < epochs_steps_;
  report_->progress(fmt::format("epoch {}/{}  step {:>5}/{}  {} {:.4f}  {:.0f} samples/s  ETA {}",
                                epoch + 1, c_.epochs, steps_bound ? pos_.global_step : b + 1,
                                steps_bound ? planned_steps_ : per_epoch_,
                                world_ > 1 ? "rank-0 loss" : "loss", loss, rate,
                                fmt_duration(eta)));
}

}  // namespace replica
