// replica-train's presets: the recipes users copy from the PyTorch tutorials, as flag defaults.
// A preset fills a TrainConfig before the command line is parsed, so every flag given on the
// command line overrides it.
//   seed                the source article: ResNet-101 (1-channel 7x7 first conv, 10 classes)
//                       on MNIST-format data, DDP, Adam 1e-3, 256 per device, 10 epochs, loss
//                       every 10 steps, rank 0 saves the model
//   cnn-sgd             the small CNN with SGD lr 1e-3, momentum 0.9 (DataParallel tutorial)
//   resnet18-synthetic  ResNet-18 on 10,000 random 3x224x224 images, 9 classes, 2 per device,
//                       DDP (the RandomClsDS experiment)
#pragma once
#include <string>
#include <vector>

#include "parallel/loop/trainer.h"

namespace replica {

struct Preset {
  std::string name;
  std::string summary;  // one line: what it sets
};

const std::vector<Preset>& presets();

// Applies the named preset to `config` (UsageError naming the presets if unknown).
void apply_preset(const std::string& name, TrainConfig& config);

// The value of --preset NAME / --preset=NAME in argv, or "" (the last one wins, as for flags).
std::string find_preset_flag(int argc, char** argv);

}  // namespace replica
