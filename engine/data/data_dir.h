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

// Whether the existing file `file` is one that a run with --data `dir` reads: an IDX file of
// the MNIST format in dir itself, or anything under an image folder's train/ or val/ (both
// layouts are asked about, since an output is checked before the data is opened). Other files
// beside the data (a run's metrics in `--data .`) are not the data's.
bool data_dir_reads(const std::string& dir, const std::string& file);

}  // namespace replica
