// replica-train: trains a model with DP (one process, a thread per device) or on one device.
//   replica-train                              the CNN on Fashion-MNIST, default device
//   replica-train --model resnet18 --epochs 3  ResNet-18 (1-channel 28x28 variant)
//   replica-train --synthetic --model resnet50 --devices cuda:0 --max-steps 50
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "tools/program.h"

#include "engine/device.h"
#include "engine/error.h"
#include "parallel/trainer.h"

using namespace replica;

namespace {

constexpr const char* kDefaultData = "/usr/share/datasets/fashion-mnist";

Shape parse_shape(const std::string& text) {
  Shape s;
  size_t start = 0;
  while (start <= text.size()) {
    size_t x = text.find('x', start);
    std::string part = text.substr(start, x == std::string::npos ? std::string::npos : x - start);
    REPLICA_USAGE_CHECK(!part.empty() && part.find_first_not_of("0123456789") == std::string::npos &&
                            part.size() < 7 && std::stoll(part) > 0,
                        "--input-shape '{}': expected CxHxW, e.g. 3x224x224", text);
    s.push_back(std::stoll(part));
    if (x == std::string::npos) break;
    start = x + 1;
  }
  REPLICA_USAGE_CHECK(s.size() == 3, "--input-shape '{}': expected CxHxW, e.g. 3x224x224", text);
  return s;
}

int run(int argc, char** argv) {
  TrainConfig c;
  std::string input_shape, optimizer = "adam";
  float lr = 1e-3f, momentum = 0.f, weight_decay = 0.f;
  bool nesterov = false, list_devices = false, no_eval = false, no_shuffle = false;
  int threads = 0;
  c.data_dir = kDefaultData;

  CLI::App app{"replica-train: data-parallel training (DP: one process, a thread per device)"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.add_option("--model", c.engine.model, "cnn | resnet18 | resnet34 | resnet50 | resnet101")
      ->capture_default_str();
  app.add_option("--data", c.data_dir, "MNIST-format directory (IDX files, gzip or raw)")
      ->capture_default_str();
  app.add_flag("--synthetic", c.synthetic, "random images and labels instead of --data");
  app.add_option("--synthetic-size", c.synthetic_size, "samples in the synthetic set")
      ->capture_default_str();
  app.add_option("--input-shape", input_shape,
                 "CxHxW for --synthetic (default 1x28x28 for cnn, 3x224x224 for ResNets)");
  app.add_option("--num-classes", c.engine.num_classes, "classes for --synthetic")
      ->capture_default_str();
  app.add_option("--epochs", c.epochs, "epochs to train")->capture_default_str();
  app.add_option("--max-steps", c.max_steps, "stop after N optimizer steps in total (0: no limit)")
      ->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "global batch size")->capture_default_str();
  app.add_option("--optimizer", optimizer, "sgd | adam")->capture_default_str();
  app.add_option("--lr", lr, "learning rate")->capture_default_str();
  app.add_option("--lr-schedule", c.lr_schedule,
                 "constant | cosine (decays to 0 over the run's steps)")
      ->capture_default_str();
  app.add_option("--momentum", momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", weight_decay, "L2 weight decay")->capture_default_str();
  app.add_flag("--nesterov", nesterov, "Nesterov momentum (SGD)");
  app.add_option("--devices", c.devices,
                 "cpu, cpu*N (virtual devices), cuda, cuda:0,1, cuda:0*N (logical devices on one "
                 "GPU); default: all GPUs, else one CPU device per core");
  app.add_option("--mode", c.mode,
                 "dp (one process, a thread per device) | ddp (a process per device, under "
                 "replica-launch) | single (reference)")
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
  app.add_option("--reduce", c.reduce, "DP gradient reduction: root | tree")->capture_default_str();
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "gradient bucket size cap")
      ->capture_default_str();
  app.add_option("--threads-per-device", threads,
                 "CPU threads per device (default: cores / devices)");
  app.add_option("--seed", c.engine.seed, "seed for initialisation and data order")
      ->capture_default_str();
  app.add_flag("--deterministic", c.engine.deterministic,
               "bit-reproducible runs (CPU always is; CUDA picks deterministic algorithms)");
  app.add_option("--checkpoint", c.checkpoint_dir, "directory for checkpoints (every epoch, end)");
  app.add_flag("--resume", c.resume, "continue from the checkpoint in --checkpoint");
  app.add_option("--trace", c.trace_file, "write a Chrome trace (JSON) of every phase");
  app.add_option("--metrics-json", c.metrics_json, "write run metrics as JSON");
  app.add_option("--log-every", c.log_every, "progress line every N steps")->capture_default_str();
  app.add_flag("--quiet", c.quiet, "no progress output");
  app.add_flag("--no-eval", no_eval, "skip the test-set evaluation");
  app.add_flag("--no-shuffle", no_shuffle, "keep the dataset order");
  app.add_flag("--drop-last", c.drop_last, "drop the last partial batch of each epoch");
  app.add_flag("--list-devices", list_devices, "print the devices found and exit");

  if (auto code = parse_cli(app, "replica-train", argc, argv)) return *code;
  if (list_devices) {
    for (const auto& line : describe_devices()) std::printf("%s\n", line.c_str());
    return 0;
  }
  REPLICA_USAGE_CHECK(threads == 0 || threads >= 1, "--threads-per-device must be at least 1");
  REPLICA_USAGE_CHECK(app.count("--threads-per-device") == 0 || threads >= 1,
                      "--threads-per-device must be at least 1, got {}", threads);
  c.engine.threads_per_device = threads;
  c.engine.optimizer.name = optimizer;
  c.engine.optimizer.lr = lr;
  c.engine.optimizer.momentum = momentum;
  c.engine.optimizer.weight_decay = weight_decay;
  c.engine.optimizer.nesterov = nesterov;
  c.evaluate = !no_eval;
  c.shuffle = !no_shuffle;
  if (!input_shape.empty()) {
    REPLICA_USAGE_CHECK(c.synthetic, "--input-shape applies to --synthetic data");
    c.engine.input_shape = parse_shape(input_shape);
  } else if (c.synthetic && c.engine.model != "cnn") {
    c.engine.input_shape = {3, 224, 224};
  }
  if (!c.synthetic) {
    namespace fs = std::filesystem;
    REPLICA_USAGE_CHECK(fs::is_directory(c.data_dir),
                        "data directory '{}' does not exist{}", c.data_dir,
                        c.data_dir == kDefaultData
                            ? " (run tools/setup.sh, which installs dataset-fashion-mnist)"
                            : "");
  }
  validate(c);  // flags and the device string, before any data is read
  run_training(c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-train", [&] { return run(argc, argv); });
}
