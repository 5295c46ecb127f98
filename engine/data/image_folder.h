// Image folders, as torchvision's ImageFolder and PyTorch's ImageNet example read them:
//
//   DIR/train/<class>/<image>     the training split
//   DIR/val/<class>/<image>       the test split (the same class names, or some of them)
//
// A class is a sub-directory; classes sorted by name are labels 0, 1, ...; images are the files
// below it (sub-directories included) named .jpg, .jpeg or .png in any case, in ImageFolder's
// order (sorted(os.walk): directories by path, each one's files by name).
// Each read decodes the file (image_decode.h) and transforms it (image_transform.h): training
// samples with random crops and flips when augmenting, test samples centre-cropped.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "engine/data/dataset.h"

namespace replica {

struct ImageFolderOptions {
  Shape sample_shape = {3, 224, 224};  // C (1 or 3) x H x W after the transform
  bool augment = true;                 // training split: RandomResizedCrop + flip
  uint64_t seed = 0;                   // the augmentation's draws: (seed, index, epoch)
};

// Whether `dir` is laid out as an image folder (it has a train/ directory).
bool is_image_folder(const std::string& dir);
// Where a split's class directories are: DIR/train, or DIR/val for the test split.
std::filesystem::path image_split_dir(const std::string& dir, bool train);

// The split `train` (DIR/train) or the test split (DIR/val, never augmented), its files listed
// once, here. Labels are the training split's class numbers in both. A UsageError names what is
// missing: the split's directory, any class directory, a class without images, a test class
// the training split lacks. Files are decoded when read: a corrupt one is an Error naming it
// then.
std::unique_ptr<Dataset> open_image_folder(const std::string& dir, bool train,
                                           const ImageFolderOptions& options);

}  // namespace replica
