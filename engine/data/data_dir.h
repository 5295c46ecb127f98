// What --data names: an image folder (image_folder.h: DIR/train/<class>/..., DIR/val/<class>/...)
// or an MNIST-format directory (dataset.h: the four IDX files), told apart by DIR/train.
#pragma once
#include <memory>
#include <string>

#include "engine/data/dataset.h"
#include "engine/data/image_folder.h"

namespace replica {

struct DataSplits {
  std::unique_ptr<Dataset> train, test;  // test: null unless asked for
  bool image_folder = false;
};

// Opens the training split and, `with_test`, the test split, before any training: what either
// lacks is a UsageError (an MNIST-format directory's missing files all named at once). An
// image folder's samples are `image`'s; MNIST's are its images as stored. A test split whose
// samples differ in shape, or with labels the training split lacks, is a UsageError (its loss
// would be NaN hours in).
DataSplits open_data_dir(const std::string& dir, bool with_test, const ImageFolderOptions& image);

}  // namespace replica
