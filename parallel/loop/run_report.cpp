#include "parallel/loop/run_report.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include <fmt/format.h>

#include "engine/trace.h"
#include "parallel/engines/captured_step.h"
#include "parallel/loop/checkpointing.h"

namespace replica {

namespace {

// Rank 0's trace, with the other ranks' (FILE.rankR, written by them on this machine) merged
// in: one process row per rank, on one time axis.
std::string write_merged_trace(const std::string& path, int world) {
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
  return world > 1 ? fmt::format("trace: {} ({} of {} ranks merged; rank R>0 alone: {}.rank<R>)",
                                 path, merged, world, path)
                   : fmt::format("trace: {} ({} spans)", path, Tracer::global().event_count());
}

}  // namespace

RunReport::RunReport(const TrainConfig& config, TrainEngine& engine, std::string device_spec)
    : c_(config),
      engine_(engine),
      device_spec_(std::move(device_spec)),
      lead_(engine.rank() == 0),
      quiet_(config.quiet || !lead_),
      tty_(isatty(fileno(stdout))),
      world_(engine.world_size()) {}

void RunReport::say(const std::string& line) const {
  if (quiet_) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void RunReport::progress(const std::string& line) const {
  if (quiet_) return;
  if (tty_) std::printf("\r%s\033[K", line.c_str());
  else std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void RunReport::end_progress() const {
  if (!quiet_ && tty_) std::printf("\n");
}

void RunReport::epoch_done(const nlohmann::json& e, const char* how) {
  epochs_.push_back(e);
  if (std::string(how) == "interrupted" && e.value("steps", int64_t(0)) == 0) return;
  const double seconds = e.value("seconds", 0.0);
  say(fmt::format("epoch {} {}: train loss {:.4f}{}, {:.0f} samples/s, {}", e.value("epoch", 0),
                  how, e.value("train_loss", std::nan("")),
                  e.contains("test_accuracy")
                      ? fmt::format(", test loss {:.4f}, test accuracy {:.4f}{}",
                                    e["test_loss"].get<double>(), e["test_accuracy"].get<double>(),
                                    top5_note(e.value("test_top5_accuracy", 0.0)))
                      : "",
                  e.value("samples_per_sec", 0.0), fmt_duration(seconds)));
}

bool RunReport::shows_top5() const { return engine_.model().spec().num_classes > 5; }

std::string RunReport::top5_note(double top5) const {
  return shows_top5() ? fmt::format(" (top-5 {:.4f})", top5) : "";
}

void RunReport::say_best_saved(double accuracy, int64_t epoch) const {
  say(fmt::format("best test accuracy so far ({:.4f}, epoch {}): model saved to {}", accuracy,
                  epoch, c_.save_best));
}

void RunReport::gather_ranks() {
  device_names_.clear();
  peaks_.clear();
  held_.clear();
  for (const auto& d : engine_.devices()) device_names_.push_back(d.str());
  for (size_t p : engine_.peak_memory_bytes()) peaks_.push_back(int64_t(p));
  for (size_t p : engine_.peak_held_bytes()) held_.push_back(int64_t(p));
  kept_ = engine_.forward_kept_bytes();
  if (world_ <= 1) return;
  const Device mine = engine_.devices()[0];
  constexpr size_t kFields = 5;
  const std::vector<int64_t> all =
      engine_.gather_from_ranks({peaks_[0], held_[0], kept_[0], mine.index, mine.slot});
  peaks_.clear();
  held_.clear();
  kept_.clear();
  device_names_.clear();
  for (size_t r = 0; r < size_t(world_); ++r) {
    const int64_t* rank = &all[kFields * r];
    peaks_.push_back(rank[0]);
    held_.push_back(rank[1]);
    kept_.push_back(rank[2]);
    Device d = mine;
    d.index = int(rank[3]);
    d.slot = int(rank[4]);
    device_names_.push_back(fmt::format("rank {} {}", r, d.str()));
  }
}

void RunReport::write_rank_trace() const {
  if (c_.trace_file.empty() || lead_) return;
  Tracer::global().write_chrome_json(fmt::format("{}.rank{}", c_.trace_file, engine_.rank()),
                                     engine_.rank() + 1, fmt::format("rank {}", engine_.rank()));
}

nlohmann::json RunReport::metrics(const RunTotals& t) const {
  Tracer& tracer = Tracer::global();
  const FirstStep& first = t.first_step;  // left out of the per-step figures when excluded
  const nlohmann::json phase_ms = phase_ms_per_step(
      tracer.phase_totals_us(), first.phases, t.steps_this_run - (first.excluded ? 1 : 0));
  const double macs = engine_.forward_macs_per_sample();
  const double sps =
      double(t.samples - first.samples) / std::max(t.train_seconds - first.seconds, 1e-9);
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : engine_.devices()) devices.push_back(d.str());
  const CapturedStep* captured =
      engine_.captured_step() && engine_.captured_step()->captured() ? engine_.captured_step()
                                                                     : nullptr;
  nlohmann::json m = {
      {"model", c_.engine.model},
      {"mode", engine_.mode()},
      {"devices", devices},
      {"world_size", world_},
      // Logical devices on one GPU: a correctness run, not a scaling measurement.
      {"devices_share_gpu", engine_.shares_gpu()},
      {"precision", precision_name(c_.engine.precision)},
      {"cudnn_benchmark", c_.engine.cudnn_benchmark},
      // GPUs: cuDNN's interface for convolutions (REPLICA_CUDNN_API; engine/context.h)
      {"cudnn_api", engine_.primary().is_cuda()
                        ? nlohmann::json(conv_api_name(engine_.primary().conv_api()))
                        : nlohmann::json()},
      {"memory_format", memory_format_name(c_.engine.channels_last)},
      // --cuda-graphs: the captured step's nodes and how many steps replayed it
      {"cuda_graph_nodes", captured ? nlohmann::json(captured->nodes()) : nlohmann::json()},
      {"cuda_graph_replays", captured ? nlohmann::json(captured->replays()) : nlohmann::json()},
      {"collectives", world_ > 1 ? nlohmann::json(engine_.comm_description()) : nlohmann::json()},
      {"reduce", c_.mode == "dp" ? nlohmann::json(c_.reduce) : nlohmann::json(nullptr)},
      {"comm_bytes_per_step", engine_.comm_bytes_per_step()},
      {"device_spec", device_spec_},
      {"threads_per_device", engine_.primary().threads()},
      {"batch_size", c_.batch_size},
      {"optimizer", c_.engine.optimizer.name},
      {"lr", c_.engine.optimizer.lr},
      {"seed", c_.engine.seed},
      {"steps", t.steps},
      {"steps_this_run", t.steps_this_run},
      {"epochs", epochs_.size()},
      {"epoch_summaries", epochs_},
      {"samples_per_sec", sps},
      {"train_seconds", t.train_seconds},
      {"first_step_excluded", first.excluded},  // from samples_per_sec and phase_ms_per_step
      {"first_step_seconds", first.excluded ? nlohmann::json(first.seconds) : nlohmann::json()},
      {"final_loss", t.final_loss},
      {"phase_ms_per_step", phase_ms},  // summed over devices (and the communication thread)
      {"phase_share", phase_shares(phase_ms)},
      // BatchNorm normalises each device's (rank's) share of the batch: DP's contiguous chunks
      // and DDP's interleaved sampler shares are different groups of samples.
      {"has_batchnorm", !engine_.model().buffers().empty()},
      {"forward_gflop_per_sample", 2 * macs / 1e9},
      // Training = forward + backward (data and weight gradients): ~3x the forward FLOPs.
      {"train_gflops", 3 * 2 * macs * sps / 1e9},
      {"peak_memory_bytes", peaks_},
      // In use plus cached: what the allocator took from the system (max_memory_reserved).
      {"peak_held_bytes", held_},
      // What a training forward left in use: the activations kept for backward (the largest).
      {"forward_kept_bytes", kept_},
      // DDP: one entry per rank, "rank R cpu:R" (DP: one per device of this process).
      {"peak_memory_devices", device_names_},
      {"interrupted", t.stop_signal != 0},
      {"config", config_json(c_)},
  };
  if (t.evaluated) {
    m["test_accuracy"] = t.test_accuracy;
    if (shows_top5()) m["test_top5_accuracy"] = t.test_top5;
    m["test_loss"] = t.test_loss;
  }
  if (t.best_epoch > 0) {  // over every epoch evaluated, resumed ones included
    m["best_test_accuracy"] = t.best_accuracy;
    m["best_epoch"] = t.best_epoch;
  }
  if (t.stop_signal) m["stop_signal"] = t.stop_signal;
  return m;
}

void RunReport::finish(const RunTotals& t, const nlohmann::json& m) const {
  if (!lead_) return;
  if (!c_.trace_file.empty()) say(write_merged_trace(c_.trace_file, world_));
  if (!c_.save_model.empty() && !t.stop_signal) {
    save_model_weights(c_.save_model, engine_);
    say(fmt::format("model saved to {}", c_.save_model));
  }
  if (!c_.metrics_json.empty()) write_json_file(c_.metrics_json, m);

  if (t.stop_signal) {
    say(c_.checkpoint_dir.empty()
            ? fmt::format("interrupted: stopped after step {} (no --checkpoint DIR: nothing saved)",
                          t.steps)
            : fmt::format("interrupted: stopped after step {}; checkpoint {} written, continue "
                          "with --resume",
                          t.steps, checkpoint_path(c_.checkpoint_dir)));
    return;
  }
  if (epochs_.empty()) return;  // resumed at the end of the run: nothing trained, nothing to show
  // DP's phases run on every device's thread and the communication thread; DDP's are rank 0's.
  const std::string scope = world_ > 1 ? "rank 0" : "summed over devices and threads";
  say("\n" + epoch_table(epochs_, scope));
  auto per_device = [&](const std::vector<int64_t>& bytes) {
    std::string line;
    for (size_t i = 0; i < bytes.size(); ++i)
      line += fmt::format("  {} {:.1f} MB", device_names_[i], bytes[i] / 1e6);
    return line;
  };
  const char* each = world_ > 1 ? "rank" : "device";
  say("time per step by phase (" + scope + "):" + phase_line(m["phase_ms_per_step"]));
  say(fmt::format("peak memory per {}:{}", each, per_device(peaks_)));
  say(fmt::format("held per {} (in use + cached):{}", each, per_device(held_)));
  say(fmt::format("kept by a forward for backward per {}:{}", each, per_device(kept_)));
  if (t.evaluated)
    say(fmt::format("test accuracy {:.4f}{}  test loss {:.4f}  ({} steps, {:.0f} samples/s, "
                    "{:.1f} GFLOP/s)",
                    t.test_accuracy, top5_note(t.test_top5), t.test_loss, t.steps,
                    m["samples_per_sec"].get<double>(), m["train_gflops"].get<double>()));
}

}  // namespace replica
