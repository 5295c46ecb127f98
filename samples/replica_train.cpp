// replica-train: trains a model with DP (one process, a thread per device), DDP (a process per
// device) or on one device, and reports accuracy, throughput and where the time went.
//   replica-train                              the CNN on Fashion-MNIST, DP on every device
//   replica-train --mode ddp                   the same with DDP: starts one rank per device
//   replica-train --preset seed --epochs 1     the source article's ResNet-101 recipe
//   replica-train --synthetic --model resnet50 --devices cuda:0 --max-steps 50
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/ranges.h>

#include "cli/gpu_flags.h"
#include "cli/program.h"

#include "engine/data/image_folder.h"
#include "engine/device.h"
#include "engine/error.h"
#include "parallel/rendezvous/launcher.h"
#include "parallel/rendezvous/store.h"
#include "parallel/loop/trainer.h"
#include "samples/train_presets.h"

using namespace replica;

namespace {

constexpr const char* kDefaultData = "/usr/share/datasets/fashion-mnist";

// `--mode ddp` started by hand, without a launcher's RANK/WORLD_SIZE: start one rank per device
// (what `replica-launch --nproc-per-node N -- replica-train ...` does) and wait for them.
// Returns the ranks' exit code, or nothing when this process should train as the only rank.
std::optional<int> launch_ddp_ranks(const TrainConfig& c, int argc, char** argv) {
  if (started_as_rank()) return std::nullopt;  // a launcher (or mpirun/srun) started us
  const int n = self_launched_ranks(c);
  if (n <= 1) return std::nullopt;
  LaunchOptions o;
  o.name = "replica-train";
  o.nproc_per_node = n;
  const char* port = std::getenv("MASTER_PORT");
  o.master_port = port ? std::atoi(port) : pick_free_port();
  REPLICA_USAGE_CHECK(o.master_port >= 1 && o.master_port <= 65535,
                      "MASTER_PORT '{}' is not a port number", port ? port : "");
  if (const char* addr = std::getenv("MASTER_ADDR")) o.master_addr = addr;
  o.command.push_back(current_executable());
  std::string args;
  for (int i = 1; i < argc; ++i) {
    o.command.push_back(argv[i]);
    args += std::string(" ") + argv[i];
  }
  // The equivalent command as it can be typed where this one was: replica-launch from the
  // directory this program was started from (build/bin/...), or from PATH as this one was.
  const std::string self = argv[0];
  const size_t slash = self.rfind('/');
  const std::string launcher =
      (slash == std::string::npos ? "" : self.substr(0, slash + 1)) + "replica-launch";
  if (!c.quiet)
    std::printf("replica-train: --mode ddp: starting %d ranks, as "
                "`%s --nproc-per-node %d --master-port %d -- %s%s`\n",
                n, launcher.c_str(), n, o.master_port, self.c_str(), args.c_str());
  std::fflush(stdout);
  return launch_ranks(o);
}

// What the command line holds beside TrainConfig's own fields: flags read into another form
// (--input-shape, --seed, --threads-per-device, the --no-* switches) and the informational ones.
struct TypedFlags {
  std::string preset, preset_value, input_shape;
  bool list_devices = false, no_eval = false, no_shuffle = false, print_config = false;
  bool no_augment = false;
  int threads = 0;
  int64_t seed = 0;  // signed: "-1" must be an error, not 2^64 - 1
};

void declare_model_and_data(CLI::App& app, TrainConfig& c, TypedFlags& t) {
  std::string preset_help = "flag defaults of a recipe (flags given with it override it):";
  for (const auto& p : presets()) preset_help += "\n  " + p.name + ": " + p.summary;
  app.add_option("--preset", t.preset_value, preset_help);
  app.add_option("--model", c.engine.model,
                 "cnn | resnet18 | resnet34 | resnet50 | resnet101 | resnet152")
      ->capture_default_str();
  app.add_option("--data", c.data_dir,
                 "MNIST-format directory (IDX files, gzip or raw), or an image folder: train/ "
                 "and val/ with a directory of JPEG or PNG images per class (ImageNet's layout)")
      ->capture_default_str();
  app.add_flag("--synthetic", c.synthetic, "random images and labels instead of --data");
  app.add_option("--synthetic-size", c.synthetic_size, "samples in the synthetic set")
      ->capture_default_str();
  app.add_option("--input-shape", t.input_shape,
                 "CxHxW for --synthetic (default 1x28x28 for cnn, 3x224x224 for ResNets), or an "
                 "image folder's crops (default 3x224x224)");
  app.add_flag("--no-augment", t.no_augment,
               "image folders: train on centre crops too (no random crops and flips)");
  app.add_option("--num-classes", c.engine.num_classes, "classes for --synthetic")
      ->capture_default_str();
  app.add_option("--data-placement", c.data_placement,
                 "where the training set lives: device (read once onto every GPU, each step "
                 "gathers its batch there), host (a loader thread prepares each batch), auto "
                 "(device on GPUs when it takes at most a quarter of their memory, else host)")
      ->capture_default_str();
  app.add_flag("--no-shuffle", t.no_shuffle, "keep the dataset order");
  app.add_flag("--drop-last", c.drop_last, "drop the last partial batch of each epoch");
  group_options(app, "Model and data");
}

void declare_training(CLI::App& app, TrainConfig& c, TypedFlags& t) {
  OptimizerOptions& opt = c.engine.optimizer;
  app.add_option("--epochs", c.epochs, "epochs to train")->capture_default_str();
  app.add_option("--max-steps", c.max_steps, "stop after N optimizer steps in total (0: no limit)")
      ->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "global batch size (all devices together)")
      ->capture_default_str();
  app.add_option("--batch-per-device", c.batch_per_device,
                 "batch per device (DP) or per rank (DDP); the global batch is this x devices")
      ->capture_default_str();
  app.add_option("--optimizer", opt.name, "sgd | adam")->capture_default_str();
  app.add_option("--lr", opt.lr, "learning rate")->capture_default_str();
  app.add_option("--lr-schedule", c.lr_schedule,
                 "constant | cosine (decays to 0 over the run's steps) | step:N[:GAMMA] (times "
                 "GAMMA, default 0.1, every N epochs: PyTorch's StepLR)")
      ->capture_default_str();
  app.add_option("--momentum", opt.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", opt.weight_decay, "L2 weight decay")->capture_default_str();
  app.add_flag("--nesterov", opt.nesterov, "Nesterov momentum (SGD)");
  app.add_option("--seed", t.seed, "seed for initialisation and data order (>= 0)")
      ->capture_default_str();
  add_math_flags(app, "", c.precision, c.engine.cudnn_benchmark, c.memory_format);
  add_cuda_graphs_flag(app, "", c.engine.cuda_graphs);
  app.add_flag("--deterministic", c.engine.deterministic,
               "bit-reproducible runs (CPU always is; CUDA picks deterministic algorithms; not "
               "with --cudnn-benchmark)");
  group_options(app, "Training");
}

void declare_parallelism(CLI::App& app, TrainConfig& c, TypedFlags& t) {
  app.add_option("--devices", c.devices,
                 "cpu, cpu*N (virtual devices), cuda, cuda:0,1, cuda:0*N (logical devices on one "
                 "GPU); default: all GPUs, else one CPU device per core");
  app.add_option("--mode", c.mode,
                 "dp (one process, a thread per device) | ddp (a process per device; started "
                 "here, or by replica-launch) | single (reference)")
      ->capture_default_str();
  app.add_option("--threads-per-device", t.threads,
                 "CPU threads per device (default: cores / devices)");
  app.add_option("--reduce", c.reduce, "DP gradient reduction: root | tree")->capture_default_str();
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "gradient bucket size cap")
      ->capture_default_str();
  app.add_option("--backend", c.backend, "DDP collectives: auto | gloo | nccl")
      ->capture_default_str();
  app.add_option("--init-method", c.init_method, "DDP rendezvous: env:// | tcp://H:P | file://DIR")
      ->capture_default_str();
  app.add_option("--timeout", c.timeout_s, "DDP rendezvous/collective timeout, seconds")
      ->capture_default_str();
  app.add_option("--accumulate", c.accumulate,
                 "DDP: split each rank's batch into K micro-batches, all-reduce once (no_sync)")
      ->capture_default_str();
  group_options(app, "Parallelism");
}

void declare_outputs(CLI::App& app, TrainConfig& c, TypedFlags& t) {
  app.add_option("--checkpoint", c.checkpoint_dir,
                 "directory for the checkpoint (written every epoch, at the end and on Ctrl-C)");
  app.add_flag("--resume", c.resume, "continue from the checkpoint in --checkpoint");
  app.add_option("--save-model", c.save_model,
                 "write the trained weights (state_dict names, safetensors) at the end")
      ->capture_default_str();
  app.add_option("--save-best", c.save_best,
                 "write the weights after each epoch whose test accuracy beats every earlier "
                 "one (PyTorch's model_best; --resume remembers the best)");
  app.add_option("--trace", c.trace_file, "write a Chrome trace (JSON) of every phase");
  app.add_option("--metrics-json", c.metrics_json, "write run metrics as JSON");
  app.add_option("--log-every", c.log_every, "progress line every N steps")->capture_default_str();
  app.add_flag("--quiet", c.quiet, "no progress output");
  app.add_flag("--no-eval", t.no_eval, "skip the test-set evaluation");
  app.add_flag("--list-devices", t.list_devices, "print the devices found and exit");
  app.add_flag("--print-config", t.print_config,
               "print the settings this command line (and --preset) resolves to, as JSON, and "
               "exit");
  group_options(app, "Checkpoints and output");
}

// What the flags mean together: a typed flag overrides its preset's value, and the checks that
// span flags, before any data is read or rank started.
void resolve_flags(const CLI::App& app, TrainConfig& c, const TypedFlags& t) {
  REPLICA_USAGE_CHECK(app.count("--threads-per-device") == 0 || t.threads >= 1,
                      "--threads-per-device must be at least 1, got {}", t.threads);
  REPLICA_USAGE_CHECK(app.count("--batch-size") == 0 || app.count("--batch-per-device") == 0,
                      "give --batch-size (global) or --batch-per-device, not both");
  if (app.count("--batch-size")) c.batch_per_device = 0;  // overrides a preset's per-device batch
  // A preset's SGD momentum does not follow an --optimizer given over it (typed flags still do).
  if (app.count("--optimizer") && c.engine.optimizer.name != "sgd" && !app.count("--momentum") &&
      !app.count("--nesterov")) {
    c.engine.optimizer.momentum = 0.f;
    c.engine.optimizer.nesterov = false;
  }
  REPLICA_USAGE_CHECK(app.count("--batch-per-device") == 0 || c.batch_per_device >= 1,
                      "--batch-per-device must be at least 1, got {}", c.batch_per_device);
  if (app.count("--data")) c.synthetic = false;  // overrides a synthetic preset
  REPLICA_USAGE_CHECK(!(app.count("--data") && app.count("--synthetic")),
                      "give --data DIR or --synthetic, not both");
  REPLICA_USAGE_CHECK(t.seed >= 0, "--seed must be >= 0, got {}", t.seed);
  c.engine.seed = uint64_t(t.seed);
  c.engine.threads_per_device = t.threads;
  c.evaluate = !t.no_eval;
  c.shuffle = !t.no_shuffle;
  // The directory first: a flag that needs an image folder cannot hide that it is missing.
  if (!c.synthetic) {
    namespace fs = std::filesystem;
    REPLICA_USAGE_CHECK(!c.data_dir.empty(),
                        "give --data DIR{}", t.preset == "imagenet"
                                                 ? ": --preset imagenet reads an image folder "
                                                   "(DIR/train/<class>/, DIR/val/<class>/)"
                                                 : "");
    REPLICA_USAGE_CHECK(!fs::exists(c.data_dir) || fs::is_directory(c.data_dir),
                        "--data '{}' is a file: give the directory that holds the MNIST-format "
                        "files (train-images-idx3-ubyte[.gz], ...) or an image folder's train/ "
                        "and val/", c.data_dir);
    REPLICA_USAGE_CHECK(fs::is_directory(c.data_dir),
                        "data directory '{}' does not exist{}", c.data_dir,
                        c.data_dir == kDefaultData
                            ? " (run tools/setup.sh, which installs dataset-fashion-mnist)"
                            : "");
  }
  // An image folder's images are cropped to the input shape; MNIST-format images are used
  // as they are.
  const bool image_folder = !c.synthetic && is_image_folder(c.data_dir);
  const std::string not_folder =
      fmt::format("{} has no train/ directory of class directories", c.data_dir);
  if (!t.input_shape.empty()) {
    REPLICA_USAGE_CHECK(c.synthetic || image_folder,
                        "--input-shape applies to --synthetic data and image folders, and {}",
                        not_folder);
    c.engine.input_shape = parse_input_shape(t.input_shape);
  } else if ((c.synthetic && c.engine.model != "cnn" && t.preset.empty()) || image_folder) {
    c.engine.input_shape = {3, 224, 224};
  }
  REPLICA_USAGE_CHECK(!t.no_augment || image_folder, "--no-augment applies to image folders{}",
                      c.synthetic ? ", not --synthetic data" : ", and " + not_folder);
  c.augment = !t.no_augment;
  validate(c);  // flags and the device string
  for (const ModeFlag& f : mode_flags())  // typed for another mode: said, not ignored
    REPLICA_USAGE_CHECK(!app.count(f.flag) || std::count(f.modes.begin(), f.modes.end(), c.mode),
                        "{} applies to --mode {}, not {}", f.flag, fmt::join(f.modes, " and "),
                        c.mode);
  for (const char* flag : {"--synthetic-size", "--num-classes"})
    REPLICA_USAGE_CHECK(!app.count(flag) || c.synthetic, "{} applies to --synthetic data", flag);
}

int run(int argc, char** argv) {
  TrainConfig c;
  c.data_dir = kDefaultData;
  TypedFlags t;
  t.preset = find_preset_flag(argc, argv);
  if (!t.preset.empty()) apply_preset(t.preset, c);
  t.seed = int64_t(c.engine.seed);

  CLI::App app{"replica-train: data-parallel training, DP (one process, a thread per device) or "
               "DDP (a process per device)"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  declare_model_and_data(app, c, t);
  declare_training(app, c, t);
  declare_parallelism(app, c, t);
  declare_outputs(app, c, t);
  app.footer(
      "Ctrl-C (or SIGTERM, SIGHUP) stops after the step in progress, writes the checkpoint (with "
      "--checkpoint) and exits 128 + the signal (130 for Ctrl-C); a second Ctrl-C ends at once, "
      "as the first does before training starts.");

  if (auto code = parse_cli(app, argc, argv)) return *code;
  if (t.list_devices) {
    // It prints what this machine has and exits: any other flag would be ignored.
    for (const CLI::Option* o : app.get_options())
      REPLICA_USAGE_CHECK(o->get_name() == "--list-devices" || o->count() == 0,
                          "--list-devices prints the devices found and exits: it takes no other "
                          "flag (got {})",
                          o->get_name());
    for (const auto& line : describe_devices()) std::printf("%s\n", line.c_str());
    return 0;
  }
  resolve_flags(app, c, t);
  if (t.print_config) {
    std::printf("%s\n", config_json(c).dump(2).c_str());
    return 0;
  }
  if (!t.preset.empty() && !c.quiet && std::getenv("RANK") == nullptr)
    std::printf("replica-train: --preset %s (flags given with it override it)\n",
                t.preset.c_str());
  if (c.mode == "ddp")
    if (auto code = launch_ddp_ranks(c, argc, argv)) return *code;
  const nlohmann::json m = run_training(c);
  return m.contains("stop_signal") ? 128 + m["stop_signal"].get<int>() : 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-train", [&] { return run(argc, argv); });
}
