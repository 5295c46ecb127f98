#include "engine/data/dataset.h"

#include <sys/stat.h>
#include <dirent.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include <tbb/parallel_for.h>

#include "engine/data/idx.h"
#include "engine/error.h"

namespace replica {

uint64_t SplitMix64::below(uint64_t bound) {
  // Lemire, "Fast Random Integer Generation in an Interval" (2019).
  unsigned __int128 m = (unsigned __int128)next() * bound;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < bound) {
    uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = (unsigned __int128)next() * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

uint64_t mix_seeds(uint64_t a, uint64_t b) {
  SplitMix64 g(a ^ (b * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull));
  g.next();
  return g.next();
}

void Dataset::read(const int64_t* indices, int64_t n, float* images, int32_t* labels,
                   int64_t epoch) const {
  for (int64_t i = 0; i < n; ++i)
    REPLICA_CHECK(indices[i] >= 0 && indices[i] < size(),
                  "{}: sample index {} out of range [0, {})", describe(), indices[i], size());
  read_samples(indices, n, epoch, images, labels);
}

namespace {

// ---------------------------------------------------------------------------------------------
// MNIST-format directory

class MnistDataset final : public Dataset {
 public:
  MnistDataset(std::string name, IdxArray images, IdxArray labels, float mean, float stddev)
      : name_(std::move(name)),
        n_(images.dims[0]),
        rows_(images.dims[1]),
        cols_(images.dims[2]),
        pixels_(std::move(images.data)),
        labels_(std::move(labels.data)) {
    for (int v = 0; v < 256; ++v) lut_[v] = (float(v) / 255.0f - mean) / stddev;
    int max_label = 0;
    for (uint8_t l : labels_) max_label = std::max<int>(max_label, l);
    classes_ = std::max(10, max_label + 1);
  }
  int64_t size() const override { return n_; }
  Shape sample_shape() const override { return {1, rows_, cols_}; }
  int num_classes() const override { return classes_; }
  void read_samples(const int64_t* indices, int64_t n, int64_t, float* images,
                    int32_t* labels) const override {
    const int64_t per = rows_ * cols_;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* src = pixels_.data() + indices[i] * per;
      float* dst = images + i * per;
      for (int64_t k = 0; k < per; ++k) dst[k] = lut_[src[k]];
      labels[i] = labels_[indices[i]];
    }
  }
  std::string describe() const override {
    return fmt::format("{}: {} x 1x{}x{}, {} classes", name_, n_, rows_, cols_, classes_);
  }

 private:
  std::string name_;
  int64_t n_, rows_, cols_;
  std::vector<uint8_t> pixels_, labels_;
  float lut_[256];
  int classes_ = 10;
};

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// "name" or "name.gz", whichever exists ("" if neither).
std::string find_idx(const std::string& dir, const std::string& name) {
  for (const char* suffix : {".gz", ""}) {
    std::string p = dir + "/" + name + suffix;
    if (is_file(p)) return p;
  }
  return "";
}

std::string base_name(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  auto slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

// ---------------------------------------------------------------------------------------------
// Synthetic

class SyntheticDataset final : public Dataset {
 public:
  static constexpr int64_t kParallelFrom = 4096;  // values per sample (a 1x28x28 image: 784)

  SyntheticDataset(int64_t size, Shape shape, int classes, uint64_t seed)
      : size_(size), shape_(std::move(shape)), classes_(classes), seed_(seed),
        per_(shape_numel(shape_)) {}
  int64_t size() const override { return size_; }
  Shape sample_shape() const override { return shape_; }
  int num_classes() const override { return classes_; }
  // A 3x224x224 sample costs about 2 ms (75k Box-Muller pairs), so one loader thread feeds
  // only ~250-500 samples/s: large samples are made in parallel, one task per sample. Each
  // sample is its own stream, so the values do not depend on the thread count.
  void read_samples(const int64_t* indices, int64_t n, int64_t, float* images,
                    int32_t* labels) const override {
    auto one = [&](int64_t i) { make_sample(indices[i], images + i * per_, labels + i); };
    if (per_ >= kParallelFrom && n > 1) {
      tbb::parallel_for(int64_t(0), n, one);
    } else {
      for (int64_t i = 0; i < n; ++i) one(i);
    }
  }
  // One stream per sample: the label first, then Box-Muller pairs for the pixels.
  void make_sample(int64_t index, float* dst, int32_t* label) const {
    SplitMix64 g(mix_seeds(seed_, static_cast<uint64_t>(index)));
    *label = static_cast<int32_t>(g.below(static_cast<uint64_t>(classes_)));
    for (int64_t k = 0; k < per_; k += 2) {
      double u1 = 1.0 - g.uniform01();  // (0, 1]: log is finite
      double u2 = g.uniform01();
      double r = std::sqrt(-2.0 * std::log(u1));
      double t = 6.283185307179586 * u2;
      dst[k] = static_cast<float>(r * std::cos(t));
      if (k + 1 < per_) dst[k + 1] = static_cast<float>(r * std::sin(t));
    }
  }
  std::string describe() const override {
    return fmt::format("synthetic (seed {}): {} x {}, {} classes", seed_, size_,
                       fmt::join(shape_, "x"), classes_);
  }

 private:
  int64_t size_;
  Shape shape_;
  int classes_;
  uint64_t seed_;
  int64_t per_;
};

constexpr const char* kMnistFiles =
    "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte (each optionally .gz)";

// A UsageError unless `dir` is a directory with something in it, and holds the files of
// `splits` ("train", "t10k"): every missing one is named.
void require_mnist_files(const std::string& dir, const std::vector<std::string>& splits) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw UsageError(fmt::format("{}: no such directory (expected an MNIST-format dataset "
                                 "directory with {})",
                                 dir, kMnistFiles));
  if (!S_ISDIR(st.st_mode))
    throw UsageError(fmt::format("{}: not a directory (expected an MNIST-format dataset directory "
                                 "with {})",
                                 dir, kMnistFiles));
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw UsageError(fmt::format("{}: cannot open directory: {}", dir, std::strerror(errno)));
  // Whether it is empty, and whether it holds directories (most likely an image folder's
  // split, or one without train/: said if files are missing).
  bool empty = true, holds_directories = false;
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    empty = false;
    struct stat entry {};
    holds_directories = holds_directories ||
                        (::stat((dir + "/" + e->d_name).c_str(), &entry) == 0 &&
                         S_ISDIR(entry.st_mode));
  }
  ::closedir(d);
  if (empty)
    throw UsageError(fmt::format("{}: directory is empty (expected {})", dir, kMnistFiles));
  std::vector<std::string> missing;
  for (const std::string& split : splits)
    for (const char* kind : {"-images-idx3-ubyte", "-labels-idx1-ubyte"})
      if (find_idx(dir, split + kind).empty()) {
        // Something that is there but cannot be read as a file (a FIFO, a device) is named so.
        std::string entry = split + kind + "[.gz]";
        for (const char* suffix : {"", ".gz"})
          if (::stat((dir + "/" + split + kind + suffix).c_str(), &st) == 0)
            entry = split + kind + suffix + " (not a regular file)";
        missing.push_back(entry);
      }
  if (!missing.empty())
    throw UsageError(fmt::format(
        "{}: missing {} of the {} MNIST-format files needed: {}{}", dir, missing.size(),
        2 * splits.size(), fmt::join(missing, ", "),
        holds_directories
            ? "; or, for an image folder, give the directory that holds train/<class>/ and "
              "val/<class>/"
            : ""));
}

}  // namespace

void check_mnist_dir(const std::string& dir, bool with_test) {
  require_mnist_files(dir, with_test ? std::vector<std::string>{"train", "t10k"}
                                     : std::vector<std::string>{"train"});
}

std::vector<std::string> mnist_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const char* split : {"train", "t10k"})
    for (const char* kind : {"-images-idx3-ubyte", "-labels-idx1-ubyte"})
      if (std::string p = find_idx(dir, split + std::string(kind)); !p.empty())
        files.push_back(std::move(p));
  return files;
}

namespace {

// The classes are the largest label + 1 (EMNIST's letters run 1..26). One corrupt byte of a
// labels file (255 among 0..9) made a model of 256 outputs and trained it without a word: where
// the split has samples enough for every class and most classes have none, the largest label is
// refused, with the sample that has it.
void check_label_range(const std::string& path, const std::vector<uint8_t>& labels) {
  std::array<int64_t, 256> count{};
  for (uint8_t l : labels) ++count[l];
  int top = 255;
  while (top > 0 && count[size_t(top)] == 0) --top;
  const int64_t classes = top + 1;
  const int64_t present = std::count_if(count.begin(), count.begin() + classes,
                                        [](int64_t c) { return c > 0; });
  if (classes <= 10 || int64_t(labels.size()) < classes || 2 * present > classes) return;
  int next = top - 1;  // the largest of the other labels
  while (next > 0 && count[size_t(next)] == 0) --next;
  const auto at = std::find(labels.begin(), labels.end(), uint8_t(top)) - labels.begin();
  const std::string others =
      present > 1 ? fmt::format("the other labels run 0..{}", next) : "no other label";
  throw Error(fmt::format("{}: label {} (sample {}) makes {} classes, and {} of them have no "
                          "sample among the {} ({}): a corrupt labels file?",
                          path, top, at, classes, classes - present, labels.size(), others));
}

}  // namespace

std::unique_ptr<Dataset> open_mnist(const std::string& dir, bool train, float mean, float stddev) {
  require_mnist_files(dir, {train ? "train" : "t10k"});
  REPLICA_USAGE_CHECK(stddev > 0.0f && std::isfinite(stddev) && std::isfinite(mean),
                      "normalisation mean {} / std {}: std must be positive and both finite",
                      mean, stddev);
  const std::string split = train ? "train" : "t10k";
  const std::string img_path = find_idx(dir, split + "-images-idx3-ubyte");
  const std::string lbl_path = find_idx(dir, split + "-labels-idx1-ubyte");

  IdxArray images = read_idx(img_path);
  IdxArray labels = read_idx(lbl_path);
  if (images.dims.size() == 1 && labels.dims.size() == 3)
    throw Error(fmt::format("{} holds labels and {} holds images: the two files are swapped",
                            img_path, lbl_path));
  if (images.dims.size() != 3)
    throw Error(fmt::format("{}: expected images [n, rows, cols] (3 dimensions), found {} "
                            "dimensions",
                            img_path, images.dims.size()));
  if (labels.dims.size() != 1)
    throw Error(fmt::format("{}: expected labels [n] (1 dimension), found {} dimensions", lbl_path,
                            labels.dims.size()));
  if (images.dims[0] != labels.dims[0])
    throw Error(fmt::format("{}: {} labels but {} has {} images", lbl_path, labels.dims[0],
                            img_path, images.dims[0]));
  if (images.dims[0] == 0) throw Error(fmt::format("{}: holds no images", img_path));
  if (images.dims[1] == 0 || images.dims[2] == 0)
    throw Error(fmt::format("{}: images of {}x{} pixels", img_path, images.dims[1],
                            images.dims[2]));
  check_label_range(lbl_path, labels.data);
  std::string name = base_name(dir) + (train ? " train" : " test");
  return std::make_unique<MnistDataset>(name, std::move(images), std::move(labels), mean, stddev);
}

std::unique_ptr<Dataset> make_synthetic(int64_t size, const Shape& sample_shape, int num_classes,
                                        uint64_t seed) {
  REPLICA_USAGE_CHECK(size >= 1, "synthetic dataset: size must be at least 1 (got {})", size);
  REPLICA_USAGE_CHECK(num_classes >= 1, "synthetic dataset: needs at least 1 class (got {})",
                      num_classes);
  REPLICA_USAGE_CHECK(!sample_shape.empty(), "synthetic dataset: empty sample shape");
  for (int64_t d : sample_shape)
    REPLICA_USAGE_CHECK(d >= 1 && d <= (int64_t(1) << 20),
                        "synthetic dataset: bad sample shape [{}]", fmt::join(sample_shape, ", "));
  REPLICA_USAGE_CHECK(shape_numel(sample_shape) <= (int64_t(1) << 30),
                      "synthetic dataset: sample shape [{}] is too large",
                      fmt::join(sample_shape, ", "));
  return std::make_unique<SyntheticDataset>(size, sample_shape, num_classes, seed);
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  REPLICA_CHECK(n >= 0, "epoch_order: negative size {}", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  if (!shuffle) return order;
  SplitMix64 g(mix_seeds(seed, static_cast<uint64_t>(epoch) ^ 0x6a09e667f3bcc909ull));
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = static_cast<int64_t>(g.below(static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

}  // namespace replica
