// Training as programs ask for it: they fill a TrainConfig and call run_training(), which runs a
// TrainLoop (train_loop.h: data, epochs, evaluation, checkpoints, resume) over the engine the
// config names, and reports through a RunReport (run_report.h: progress, tables, trace, metrics).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/engines/train_engine.h"

namespace replica {

struct TrainConfig {
  EngineOptions engine;            // model, input shape, classes, optimizer, seed, threads
  std::string mode = "dp";         // dp | ddp (under replica-launch) | single (reference)
  std::string backend = "auto";    // DDP: gloo | nccl | auto (nccl when each rank has its GPU)
  std::string init_method = "env://";  // DDP rendezvous: env:// | tcp://host:port | file://DIR
  double timeout_s = 300;          // DDP: rendezvous and collective timeout
  int accumulate = 1;              // DDP: micro-batches per rank and step (no_sync for K-1)
  std::string precision = "auto";  // auto | fp32 | tf32 | bf16 (engine/context.h: resolve_precision)
  std::string memory_format = "auto";  // auto | nchw | channels_last (resolve_channels_last)
  std::string reduce = "root";     // DP gradient reduction: root | tree
  double bucket_cap_mb = 25;       // gradient bucket cap (the first bucket is 1 MB)
  std::string devices;             // device string; empty = resolve_devices() default
  std::string data_dir;            // MNIST-format directory, or an image folder (train/, val/)
  bool augment = true;             // image folders: random crops and flips for training
  bool synthetic = false;          // random images of engine.input_shape instead of data_dir
  int64_t synthetic_size = 10000;  // samples in the synthetic training set
  // Where the training set lives: auto | host | device (engine/data/resident_dataset.h).
  std::string data_placement = "auto";
  int64_t epochs = 1;
  std::string lr_schedule = "constant";  // constant | cosine (decays over the planned steps)
  int64_t max_steps = 0;           // stop after this many optimizer steps in total (0 = none)
  int64_t batch_size = 32;         // the GLOBAL batch (32: 0.875 after one CNN epoch vs 0.862 at 64)
  int64_t batch_per_device = 0;    // > 0: the global batch is this x devices (DP) or ranks (DDP)
  bool shuffle = true;
  bool drop_last = false;
  int log_every = 10;              // progress line (and loss readback) every N steps
  bool quiet = false;
  bool evaluate = true;            // test loss/accuracy after every epoch
  std::string checkpoint_dir;      // save at every epoch end and at the end of the run
  bool resume = false;             // continue from checkpoint_dir/checkpoint.safetensors
  std::string trace_file;          // Chrome trace JSON
  std::string metrics_json;        // metrics written here at the end
  std::string save_model;          // rank 0 writes the trained weights here (state_dict names)
  std::string save_best;           // ... and here after each epoch whose test accuracy is best
  bool stop_on_signal = true;      // SIGINT/SIGTERM: stop after the step, checkpoint, return
};

// Runs training; returns the metrics (also written to config.metrics_json if set).
// Errors are thrown (replica::UsageError for bad input).
nlohmann::json run_training(const TrainConfig& config);

// The engine `c` asks for on `devices` (resolve_devices()): single, DP, or this process's DDP
// rank (joining the rendezvous). Sets c.batch_size from --batch-per-device once the number of
// devices or ranks is known.
std::unique_ptr<TrainEngine> make_engine(TrainConfig& c, const std::vector<Device>& devices);

// The config as JSON (what --print-config shows and the metrics JSON records under "config").
nlohmann::json config_json(const TrainConfig& config);

// Checks a config before any work starts (UsageError on the first problem).
void validate(const TrainConfig& config);

// replica-train's flags that only some --mode values read: typed for another mode, a flag would
// be silently ignored, so replica-train refuses it and replica-dp-vs-ddp passes it to its run.
struct ModeFlag {
  std::string flag;                // "--backend"
  std::vector<std::string> modes;  // {"ddp"}
};
const std::vector<ModeFlag>& mode_flags();

// The devices a run uses: config.devices, or all GPUs if any, else one virtual CPU device per
// core (DP) / one CPU device (single).
std::vector<Device> resolve_devices(const TrainConfig& config, std::string* spec = nullptr);

// Whether a launcher started this process as one of its ranks: replica-launch or torchrun
// (RANK), mpirun (OMPI_COMM_WORLD_RANK) or srun (SLURM_PROCID).
bool started_as_rank();
// --mode ddp started by hand: the ranks replica-train starts itself, one per device that DP
// would use (1: it trains alone).
int self_launched_ranks(const TrainConfig& config);
// The global --batch-size is split evenly over the ranks.
void check_global_batch(int64_t batch_size, int64_t ranks);
// A rank's batch of `per_rank` samples splits into --accumulate micro-batches as torch.chunk
// splits it: into at most per_rank, so a larger --accumulate would run fewer than it says (and
// the metrics would record the flag's).
void check_accumulate(int64_t accumulate, int64_t per_rank);

}  // namespace replica
