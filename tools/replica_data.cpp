// replica-data: what the model sees. Writes samples of a --data directory (MNIST-format or an
// image folder) as the training reads them, transformed and normalised, to a safetensors file:
// "images" F32 [N, C, H, W] and "labels" I32 [N], to look at or to hold against another
// pipeline's (tools/compare_transforms.py: torchvision's on the same image folder).
//   replica-data --data ~/imagenet --split test --count 16 --out val16.safetensors
//   replica-data --data ~/imagenet --epoch 3 --out crops.safetensors   # epoch 3's random crops
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/program.h"
#include "engine/checkpoint.h"
#include "engine/data/data_dir.h"
#include "engine/error.h"
#include "engine/output_files.h"

using namespace replica;

int main(int argc, char** argv) {
  std::string data, split = "train", input_shape, out;
  int64_t count = 8, first = 0, epoch = 1, seed = 0;
  bool no_augment = false;
  CLI::App app{"replica-data: samples of a --data directory as the model sees them, to a "
               "safetensors file"};
  app.add_option("--data", data, "MNIST-format directory or image folder")->required();
  app.add_option("--split", split, "train | test (an image folder's val/)")->capture_default_str();
  app.add_option("--first", first, "the first sample (the split's order)")->capture_default_str();
  app.add_option("--count", count, "samples to write")->capture_default_str();
  app.add_option("--epoch", epoch,
                 "the epoch whose random crops and flips to draw, numbered as replica-train's "
                 "progress numbers them (from 1)")
      ->capture_default_str();
  app.add_option("--seed", seed, "replica-train's --seed (the draws depend on it)")
      ->capture_default_str();
  app.add_option("--input-shape", input_shape, "image folders: CxHxW of the crops (3x224x224)");
  app.add_flag("--no-augment", no_augment, "image folders: the centre crop for training too");
  app.add_option("--out", out, "the safetensors file to write")->required();
  return run_program("replica-data", [&] {
    if (auto code = parse_cli(app, argc, argv)) return *code;
    REPLICA_USAGE_CHECK(split == "train" || split == "test", "unknown --split '{}' (train, test)",
                        split);
    REPLICA_USAGE_CHECK(count >= 1, "--count must be at least 1, got {}", count);
    REPLICA_USAGE_CHECK(first >= 0 && seed >= 0, "--first and --seed must be >= 0");
    REPLICA_USAGE_CHECK(epoch >= 1, "--epoch counts from 1, got {}", epoch);
    check_output_file("--out", out);
    auto reads_data = [&](const std::string& f) { return data_dir_reads(data, f); };
    check_outputs_apart({{"--out", out}}, {}, {{"--data", data, reads_data}});
    ImageFolderOptions o;
    if (!input_shape.empty()) o.sample_shape = parse_input_shape(input_shape);
    o.augment = !no_augment;
    o.seed = uint64_t(seed);
    DataSplits d = open_data_dir(data, split == "test", o);
    REPLICA_USAGE_CHECK(d.image_folder || (input_shape.empty() && !no_augment),
                        "--input-shape and --no-augment apply to image folders");
    const Dataset& set = split == "test" ? *d.test : *d.train;
    REPLICA_USAGE_CHECK(first < set.size(), "--first {}: the {} split has {} samples", first,
                        split, set.size());
    const int64_t n = std::min(count, set.size() - first);
    const double gb = double(n) * double(shape_numel(set.sample_shape())) * 4 / 1e9;
    REPLICA_USAGE_CHECK(gb <= 4, "--count {}: {} samples of {} are {:.1f} GB, more than the 4 GB "
                        "one file may hold here (write fewer)",
                        count, n, shape_str(set.sample_shape()), gb);
    Shape shape = set.sample_shape();
    shape.insert(shape.begin(), n);
    Checkpoint c;
    Tensor images = Tensor::empty(host_allocator(), shape);
    Tensor labels = Tensor::empty(host_allocator(), {n}, DType::I32);
    std::vector<int64_t> indices(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) indices[size_t(i)] = first + i;
    set.read(indices.data(), n, images.f32(), labels.i32(), epoch - 1);  // the loader's index
    c.tensors = {{"images", images}, {"labels", labels}};
    c.metadata = {{"format", "replica-samples-v1"}, {"data", set.describe()},
                  {"split", split}, {"first", std::to_string(first)},
                  {"epoch", std::to_string(epoch)}, {"seed", std::to_string(seed)}};
    save_checkpoint(out, c);
    std::printf("%lld samples of %s (from %lld, epoch %lld) written to %s\n", (long long)n,
                set.describe().c_str(), (long long)first, (long long)epoch, out.c_str());
    return 0;
  });
}
