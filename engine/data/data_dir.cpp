#include "engine/data/data_dir.h"

#include <filesystem>

#include <fmt/format.h>

#include "engine/error.h"

namespace replica {

DataSplits open_data_dir(const std::string& dir, bool with_test,
                         const ImageFolderOptions& image) {
  DataSplits d;
  d.image_folder = is_image_folder(dir);
  if (d.image_folder) {  // val's classes are mapped onto train's by name
    d.train = open_image_folder(dir, true, image);
    if (with_test) d.test = open_image_folder(dir, false, image);
    return d;
  }
  check_mnist_dir(dir, with_test);
  d.train = open_mnist(dir, true);
  if (!with_test) return d;
  d.test = open_mnist(dir, false);
  REPLICA_USAGE_CHECK(d.test->sample_shape() == d.train->sample_shape(),
                      "{}: train images are {}, test images {}", dir,
                      shape_str(d.train->sample_shape()), shape_str(d.test->sample_shape()));
  REPLICA_USAGE_CHECK(d.test->num_classes() <= d.train->num_classes(),
                      "{}: the test labels go up to {}, the training labels to {}: a test class "
                      "the model never trains on",
                      dir, d.test->num_classes() - 1, d.train->num_classes() - 1);
  return d;
}

bool data_dir_reads(const std::string& dir, const std::string& file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path f = fs::canonical(file, ec);
  if (ec || !fs::is_regular_file(f, ec)) return false;
  for (const std::string& idx : mnist_files(dir))
    if (fs::equivalent(idx, f, ec)) return true;
  for (bool train : {true, false}) {
    const fs::path split = fs::canonical(image_split_dir(dir, train), ec);
    if (ec) continue;
    const fs::path rel = f.lexically_relative(split);
    if (!rel.empty() && *rel.begin() != "..") return true;
  }
  return false;
}

}  // namespace replica
