#include "samples/train_presets.h"

#include <cstring>

#include <fmt/format.h>

#include "engine/error.h"

namespace replica {

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = {
      {"seed",
       "resnet101 (1-channel 7x7 conv1, 10 classes), --mode ddp, Adam lr 0.001, "
       "--batch-per-device 256, 10 epochs, loss every 10 steps, --save-model "
       "resnet101.safetensors"},
      {"cnn-sgd", "cnn, SGD lr 0.001 momentum 0.9"},
      {"resnet18-synthetic",
       "resnet18 on 10000 random 3x224x224 images, 9 classes, --mode ddp, "
       "--batch-per-device 2, SGD lr 0.001 momentum 0.9"},
      {"imagenet",
       "PyTorch's ImageNet example: resnet18 on the image folder --data DIR (give it), --mode "
       "ddp, global batch 256 (main.py's -b 256 is per node), SGD lr 0.1 momentum 0.9 weight "
       "decay 1e-4, --lr-schedule step:30, 90 epochs, --checkpoint checkpoint, --save-best "
       "model_best.safetensors"},
  };
  return list;
}

void apply_preset(const std::string& name, TrainConfig& c) {
  OptimizerOptions& opt = c.engine.optimizer;
  if (name == "seed") {
    c.engine.model = "resnet101";  // conv1 takes the data's single channel: 7x7, stride 2
    c.mode = "ddp";
    opt.name = "adam";
    opt.lr = 1e-3f;
    c.batch_per_device = 256;
    c.epochs = 10;
    c.log_every = 10;
    c.save_model = "resnet101.safetensors";
  } else if (name == "cnn-sgd") {
    c.engine.model = "cnn";
    opt.name = "sgd";
    opt.lr = 1e-3f;
    opt.momentum = 0.9f;
  } else if (name == "resnet18-synthetic") {
    c.engine.model = "resnet18";
    c.mode = "ddp";
    c.synthetic = true;
    c.synthetic_size = 10000;
    c.engine.input_shape = {3, 224, 224};
    c.engine.num_classes = 9;
    c.batch_per_device = 2;
    opt.name = "sgd";
    opt.lr = 1e-3f;
    opt.momentum = 0.9f;
  } else if (name == "imagenet") {
    c.engine.model = "resnet18";
    c.mode = "ddp";
    c.data_dir.clear();  // an image folder of the user's: --data must say where
    c.batch_size = 256;
    opt.name = "sgd";
    opt.lr = 0.1f;
    opt.momentum = 0.9f;
    opt.weight_decay = 1e-4f;
    c.lr_schedule = "step:30";
    c.epochs = 90;
    c.log_every = 10;
    c.checkpoint_dir = "checkpoint";
    c.save_best = "model_best.safetensors";
  } else {
    std::string known;
    for (const auto& p : presets()) known += (known.empty() ? "" : ", ") + p.name;
    throw UsageError(fmt::format("unknown --preset '{}' (known: {})", name, known));
  }
}

std::string find_preset_flag(int argc, char** argv) {
  std::string found;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) break;
    if (std::strcmp(argv[i], "--preset") == 0) {
      REPLICA_USAGE_CHECK(i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0,
                          "--preset needs a name (see --help)");
      found = argv[++i];
    } else if (std::strncmp(argv[i], "--preset=", 9) == 0) {
      found = argv[i] + 9;
    }
  }
  return found;
}

}  // namespace replica
