// Validating and describing a TrainConfig, and the devices it resolves to
// (parallel/loop/trainer.h).
#include <algorithm>
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/data/data_dir.h"
#include "engine/error.h"
#include "engine/output_files.h"
#include "layers/model.h"
#include "layers/optimizer.h"
#include "parallel/comm/local_group.h"
#include "parallel/comm/process_group.h"
#include "parallel/engines/captured_step.h"
#include "parallel/loop/checkpointing.h"
#include "parallel/loop/trainer.h"
#include "parallel/rendezvous/rendezvous.h"

namespace replica {

nlohmann::json config_json(const TrainConfig& c) {
  const OptimizerOptions& o = c.engine.optimizer;
  // Floats as typed (0.001, not 0.0010000000474974513).
  auto decimal = [](float v) { return std::stod(fmt::format("{}", v)); };
  return {{"model", c.engine.model},
          {"input_shape", fmt::format("{}", fmt::join(c.engine.input_shape, "x"))},
          {"num_classes", c.engine.num_classes},
          {"mode", c.mode},
          {"devices", c.devices.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.devices)},
          {"threads_per_device", c.engine.threads_per_device},
          {"data", c.synthetic ? nlohmann::json(nullptr) : nlohmann::json(c.data_dir)},
          {"synthetic", c.synthetic},
          {"synthetic_size", c.synthetic_size},
          {"data_placement", c.data_placement},
          {"augment", c.augment},
          {"epochs", c.epochs},
          {"max_steps", c.max_steps},
          // The global batch, once known (with --batch-per-device, after devices are counted).
          {"batch_size",
           c.batch_per_device > 0 ? nlohmann::json(nullptr) : nlohmann::json(c.batch_size)},
          {"batch_per_device", c.batch_per_device},
          {"optimizer", o.name},
          {"lr", decimal(o.lr)},
          {"lr_schedule", c.lr_schedule},
          {"momentum", decimal(o.momentum)},
          {"weight_decay", decimal(o.weight_decay)},
          {"nesterov", o.nesterov},
          {"seed", c.engine.seed},
          {"deterministic", c.engine.deterministic},
          {"precision", c.precision},
          {"cudnn_benchmark", c.engine.cudnn_benchmark},
          {"cuda_graphs", c.engine.cuda_graphs},
          {"memory_format", c.memory_format},
          {"reduce", c.reduce},
          {"bucket_cap_mb", c.bucket_cap_mb},
          {"backend", c.backend},
          {"accumulate", c.accumulate},
          {"log_every", c.log_every},
          {"checkpoint", c.checkpoint_dir},
          {"save_model", c.save_model},
          {"save_best", c.save_best}};
}

const std::vector<ModeFlag>& mode_flags() {
  static const std::vector<ModeFlag> flags = {
      {"--backend", {"ddp"}}, {"--init-method", {"ddp"}},     {"--timeout", {"ddp"}},
      {"--accumulate", {"ddp"}}, {"--reduce", {"dp"}}, {"--bucket-cap-mb", {"dp", "ddp"}}};
  return flags;
}

namespace {

// The job's sizes and its data.
void check_job(const TrainConfig& c) {
  check_model_name(c.engine.model);  // here, before any rank or device is started
  REPLICA_USAGE_CHECK(c.batch_size >= 1, "--batch-size must be at least 1, got {}", c.batch_size);
  REPLICA_USAGE_CHECK(c.batch_per_device >= 0, "--batch-per-device must be at least 1, got {}",
                      c.batch_per_device);
  REPLICA_USAGE_CHECK(c.epochs >= 1, "--epochs must be at least 1, got {}", c.epochs);
  REPLICA_USAGE_CHECK(c.max_steps >= 0, "--max-steps must be >= 0, got {}", c.max_steps);
  REPLICA_USAGE_CHECK(c.log_every >= 1, "--log-every must be at least 1");
  static_cast<void>(LrSchedule(c.lr_schedule));  // validates the text
  REPLICA_USAGE_CHECK(c.synthetic || !c.data_dir.empty(), "give --data DIR or --synthetic");
  REPLICA_USAGE_CHECK(c.synthetic_size >= 1, "--synthetic-size must be at least 1");
  parse_data_placement(c.data_placement);  // validates the name
}

// What the run writes: each place must be writable now, and no two the same.
void check_outputs(const TrainConfig& c) {
  REPLICA_USAGE_CHECK(!c.resume || !c.checkpoint_dir.empty(), "--resume needs --checkpoint DIR");
  // What the run writes at its end must be writable now, not after hours of training.
  check_output_dir("--checkpoint", c.checkpoint_dir);
  check_weights_file("--save-model", c.save_model);
  check_weights_file("--save-best", c.save_best);
  REPLICA_USAGE_CHECK(c.save_best.empty() || c.evaluate,
                      "--save-best keeps the model of the epoch with the best test accuracy: it "
                      "needs the evaluation that --no-eval turns off");
  check_output_file("--metrics-json", c.metrics_json);
  check_output_file("--trace", c.trace_file);
  // Each is written whole over what was there: none may be another, the checkpoint, or a file
  // of the dataset.
  check_outputs_apart(
      {{"--save-best", c.save_best}, {"--save-model", c.save_model},
       {"--metrics-json", c.metrics_json}, {"--trace", c.trace_file}},
      {{fmt::format("--checkpoint '{}'", c.checkpoint_dir),
        c.checkpoint_dir.empty() ? "" : checkpoint_path(c.checkpoint_dir)}},
      {{"--data", c.synthetic ? "" : c.data_dir,
        [&](const std::string& f) { return data_dir_reads(c.data_dir, f); }}});
}

// The strategy, its communication and its optimizer.
void check_strategy(const TrainConfig& c) {
  REPLICA_USAGE_CHECK(c.engine.threads_per_device >= 0, "--threads-per-device must be >= 1");
  if (c.engine.threads_per_device > 0)
    check_cpu_threads("--threads-per-device", c.engine.threads_per_device);
  REPLICA_USAGE_CHECK(c.mode == "single" || c.mode == "dp" || c.mode == "ddp",
                      "unknown --mode '{}' (dp, ddp, single)", c.mode);
  // Started as one of N ranks (replica-launch and torchrun set RANK and WORLD_SIZE for each
  // process they start) without --mode ddp, every rank would train the whole job alone and
  // write the same outputs. Slurm's and Open MPI's variables are left alone: a batch script's
  // own environment has them.
  const char* world = std::getenv("WORLD_SIZE");
  if (c.mode != "ddp" && std::getenv("RANK") != nullptr && world != nullptr && std::atoi(world) > 1)
    throw UsageError(fmt::format(
        "started as one of {} ranks (RANK and WORLD_SIZE are set, as replica-launch sets them) "
        "but --mode is {}: each rank would train the whole job alone; give --mode ddp",
        world, c.mode));
  REPLICA_USAGE_CHECK(c.backend == "auto" || c.backend == "gloo" || c.backend == "nccl",
                      "unknown --backend '{}' (auto, gloo, nccl)", c.backend);
  timeout_from_seconds(c.timeout_s, "--timeout");
  REPLICA_USAGE_CHECK(c.accumulate >= 1, "--accumulate must be at least 1, got {}", c.accumulate);
  REPLICA_USAGE_CHECK(c.accumulate == 1 || c.mode == "ddp", "--accumulate applies to --mode ddp");
  // SGD's flags under Adam would be silently ignored: said instead.
  REPLICA_USAGE_CHECK(c.engine.optimizer.name != "adam" ||
                          (c.engine.optimizer.momentum == 0 && !c.engine.optimizer.nesterov),
                      "--momentum and --nesterov are SGD's; this run uses --optimizer {}",
                      c.engine.optimizer.name);
  check_optimizer_options(c.engine.optimizer);
  parse_reduce_strategy(c.reduce);  // validates the name
  REPLICA_USAGE_CHECK(c.bucket_cap_mb > 0 && c.bucket_cap_mb <= 4096,
                      "--bucket-cap-mb must be in (0, 4096], got {}", c.bucket_cap_mb);
}

}  // namespace

void validate(const TrainConfig& c) {
  check_job(c);
  check_outputs(c);
  check_strategy(c);
  const std::vector<Device> devices = resolve_devices(c);
  resolve_channels_last(c.memory_format, resolve_precision(c.precision, devices), devices);
  if (c.engine.cuda_graphs) check_cuda_graphs(devices, c.mode);
  // Before any rank starts: found by the ranks once they meet, the same error could reach the
  // launcher as a peer's lost connection instead.
  if (c.mode == "ddp" && c.backend == "nccl") check_nccl_usable(devices.at(0));
  // auto takes Gloo on CPU devices and where ranks share a GPU (known once they meet).
  if (c.mode == "ddp" && c.backend != "nccl") check_gloo_interface();
  // What the devices or the ranks would refuse later is said here too, so that --print-config
  // refuses what the run refuses.
  check_cudnn_benchmark(c.engine.cudnn_benchmark, c.engine.deterministic, devices);
  // Synthetic data gives the model's input and classes now (a data set's come when it is read):
  // the model is laid out, its weights not yet allocated, so that a shape its layers shrink
  // below a pixel, or too many classes, is refused here.
  if (c.synthetic) {
    REPLICA_USAGE_CHECK(c.engine.num_classes >= 2,
                        "--num-classes must be at least 2 (a classifier's), got {}",
                        c.engine.num_classes);
    make_model(c.engine.model, c.engine.input_shape, c.engine.num_classes);
  }
  if (c.mode != "ddp") return;
  parse_init_method(c.init_method);
  // The ranks: by hand, those this process would start; under a launcher its own numbers
  // (the ranks check them when they meet, and the batch per rank with them).
  if (started_as_rank()) return;
  const int ranks = self_launched_ranks(c);
  if (c.batch_per_device == 0) check_global_batch(c.batch_size, ranks);
  check_accumulate(c.accumulate, c.batch_per_device > 0 ? c.batch_per_device
                                                        : c.batch_size / ranks);
}

bool started_as_rank() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

int self_launched_ranks(const TrainConfig& c) {
  TrainConfig as_dp = c;
  as_dp.mode = "dp";  // the devices DP would use: one rank each
  return std::max(1, int(resolve_devices(as_dp).size()));
}

void check_global_batch(int64_t batch_size, int64_t ranks) {
  REPLICA_USAGE_CHECK(batch_size % ranks == 0,
                      "--batch-size {} is the global batch: it must divide by the {} ranks",
                      batch_size, ranks);
}

void check_accumulate(int64_t accumulate, int64_t per_rank) {
  REPLICA_USAGE_CHECK(accumulate <= per_rank,
                      "--accumulate {}: each rank's batch of {} samples splits into at most {} "
                      "micro-batches",
                      accumulate, per_rank, per_rank);
}

std::vector<Device> resolve_devices(const TrainConfig& c, std::string* spec_out) {
  std::string spec = c.devices;
  if (spec.empty()) {
    if (cuda_device_count() > 0) spec = "cuda";
    else spec = (c.mode == "dp" && cpu_cores() > 1) ? fmt::format("cpu*{}", cpu_cores()) : "cpu";
  }
  if (spec_out) *spec_out = spec;
  auto devices = parse_devices(spec, c.mode != "single");
  if (c.mode == "ddp") {
    // One device per process: the LOCAL_RANK-th of the list (torchrun's convention).
    const Rendezvous env = rendezvous_env_ranks();
    if (c.devices.empty() && cuda_device_count() > 0)
      return {Device{DeviceType::CUDA, env.local_rank % cuda_device_count(), 0}};
    if (c.devices.empty()) return {Device{DeviceType::CPU, env.local_rank, 0}};
    return {devices[env.local_rank % devices.size()]};
  }
  if (c.mode == "dp" && devices.size() > 1 && c.engine.threads_per_device > 0) {
    REPLICA_USAGE_CHECK(devices[0].is_cuda() ||
                            int(devices.size()) * c.engine.threads_per_device <= 4 * cpu_cores(),
                        "{} devices x {} threads is far more than the {} cores here",
                        devices.size(), c.engine.threads_per_device, cpu_cores());
  }
  return devices;
}

}  // namespace replica
