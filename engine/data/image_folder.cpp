#include "engine/data/image_folder.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "engine/data/image_decode.h"
#include "engine/data/image_transform.h"
#include "engine/error.h"

namespace replica {

namespace fs = std::filesystem;

namespace {

bool is_image_name(const fs::path& p) {
  std::string ext = p.extension().string();
  for (char& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// The class directories of a split, sorted by name (ImageFolder's find_classes).
std::vector<std::string> class_names(const fs::path& split) {
  std::error_code ec;
  REPLICA_USAGE_CHECK(fs::is_directory(split, ec), "{}: no such directory (an image folder has "
                      "train/ and val/, a directory per class in each)", split.string());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(split, ec)) {
    std::error_code kind;
    if (e.is_directory(kind)) names.push_back(e.path().filename().string());
  }
  REPLICA_USAGE_CHECK(!ec, "{}: cannot list: {}", split.string(), ec.message());
  REPLICA_USAGE_CHECK(!names.empty(), "{}: no class directories in it (an image folder has a "
                      "directory per class, its images inside)", split.string());
  std::sort(names.begin(), names.end());
  return names;
}

// The images of one class in ImageFolder's order: `sorted(os.walk(dir))` visits directories
// in the order of their path strings (a directory's own files before its sub-directories'),
// each one's files sorted by name.
std::vector<std::string> class_images(const fs::path& dir) {
  std::vector<std::pair<std::string, std::string>> found;  // (directory, file name)
  std::error_code ec;
  const auto opts = fs::directory_options::follow_directory_symlink;
  for (auto it = fs::recursive_directory_iterator(dir, opts, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code kind;  // a dangling link is skipped, not an error of the walk
    const fs::file_status status = it->status(kind);
    if (kind || fs::is_directory(status) || !is_image_name(it->path())) continue;
    // A pipe would block the loader's open() for good, a device read without end.
    REPLICA_USAGE_CHECK(fs::is_regular_file(status), "{}: not a regular file (a pipe, socket or "
                        "device), so not an image", it->path().string());
    found.emplace_back(it->path().parent_path().string(), it->path().filename().string());
  }
  REPLICA_USAGE_CHECK(!ec, "{}: cannot list: {}", dir.string(), ec.message());
  REPLICA_USAGE_CHECK(!found.empty(), "{}: no images in it (.jpg, .jpeg or .png files)",
                      dir.string());
  std::sort(found.begin(), found.end());
  std::vector<std::string> files;
  for (const auto& [d, f] : found) files.push_back((fs::path(d) / f).string());
  return files;
}

class ImageFolderDataset final : public Dataset {
 public:
  ImageFolderDataset(std::string name, std::vector<std::string> files,
                     std::vector<int32_t> labels, int classes, ImageTransform transform,
                     uint64_t seed)
      : name_(std::move(name)), files_(std::move(files)), labels_(std::move(labels)),
        classes_(classes), transform_(transform), seed_(seed) {}

  int64_t size() const override { return int64_t(files_.size()); }
  Shape sample_shape() const override {
    return {transform_.channels, transform_.out_h, transform_.out_w};
  }
  int num_classes() const override { return classes_; }
  bool augments() const override { return transform_.augment; }
  std::string describe() const override {
    return fmt::format("{}: {} x {}x{}x{}, {} classes, {}", name_, files_.size(),
                       transform_.channels, transform_.out_h, transform_.out_w, classes_,
                       transform_.augment ? "random crops and flips" : "centre crops");
  }

 protected:
  // Decoding is most of the cost (a few ms an ImageNet JPEG): one task per sample, as the
  // synthetic set makes its large samples.
  void read_samples(const int64_t* indices, int64_t n, int64_t epoch, float* images,
                    int32_t* labels) const override {
    const int64_t per = transform_.channels * int64_t(transform_.out_h) * transform_.out_w;
    const uint64_t epoch_seed = mix_seeds(seed_, uint64_t(epoch));
    tbb::parallel_for(int64_t(0), n, [&](int64_t i) {
      const size_t at = size_t(indices[i]);
      const RgbImage image = decode_image(files_[at]);
      transform_image(image, transform_, mix_seeds(epoch_seed, at), images + i * per);
      labels[i] = labels_[at];
    });
  }

 private:
  std::string name_;
  std::vector<std::string> files_;
  std::vector<int32_t> labels_;
  int classes_;
  ImageTransform transform_;
  uint64_t seed_;
};

}  // namespace

fs::path image_split_dir(const std::string& dir, bool train) {
  return fs::path(dir) / (train ? "train" : "val");
}

bool is_image_folder(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(image_split_dir(dir, true), ec);
}

std::unique_ptr<Dataset> open_image_folder(const std::string& dir, bool train,
                                           const ImageFolderOptions& options) {
  const Shape& s = options.sample_shape;
  REPLICA_USAGE_CHECK(s.size() == 3 && (s[0] == 1 || s[0] == 3) && s[1] >= 1 && s[2] >= 1 &&
                          s[1] <= 4096 && s[2] <= 4096,
                      "an image folder's samples are 1 or 3 channels of at most 4096x4096 "
                      "pixels, not {}", shape_str(s));
  const std::vector<std::string> classes = class_names(image_split_dir(dir, true));
  std::map<std::string, int32_t> label_of;
  for (size_t i = 0; i < classes.size(); ++i) label_of[classes[i]] = int32_t(i);
  const fs::path split = image_split_dir(dir, train);
  std::vector<std::string> files;
  std::vector<int32_t> labels;
  for (const std::string& c : train ? classes : class_names(split)) {
    std::vector<std::string> images = class_images(split / c);  // an empty class named first
    auto it = label_of.find(c);
    REPLICA_USAGE_CHECK(it != label_of.end(), "{}: class '{}' is not among the {} classes of {}",
                        split.string(), c, classes.size(), image_split_dir(dir, true).string());
    for (std::string& f : images) {
      files.push_back(std::move(f));
      labels.push_back(it->second);
    }
  }
  ImageTransform t;
  t.channels = int(s[0]);
  t.out_h = int(s[1]);
  t.out_w = int(s[2]);
  t.augment = train && options.augment;
  fs::path base = fs::path(dir).lexically_normal();
  if (!base.has_filename()) base = base.parent_path();
  const std::string name = base.filename().string() + (train ? " train" : " val");
  return std::make_unique<ImageFolderDataset>(name, std::move(files), std::move(labels),
                                              int(classes.size()), t, options.seed);
}

}  // namespace replica
