// Datasets: where samples come from, and the order they are visited in.
//   open_mnist      MNIST-format IDX directories (MNIST, Fashion-MNIST), gzip or raw
//   (image_folder.h: JPEG and PNG files in a directory per class, ImageNet's layout)
//   make_synthetic  random images and labels computed from (seed, index): nothing is stored
//   epoch_order     the per-epoch permutation, identical on every machine and device count
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace replica {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Shape sample_shape() const = 0;  // e.g. {1, 28, 28}
  virtual int num_classes() const = 0;
  // Writes n samples (normalised floats, sample_shape each, contiguous) and their labels.
  // Every index must be in [0, size()) (replica::Error otherwise). Thread-safe (const). A set
  // that augments() draws each sample's random crop and flip from (its seed, index, epoch): the
  // same sample for the same epoch, another the next epoch; other sets ignore `epoch`.
  void read(const int64_t* indices, int64_t n, float* images, int32_t* labels,
            int64_t epoch = 0) const;
  virtual bool augments() const { return false; }
  // One line, e.g. "fashion-mnist train: 60000 x 1x28x28, 10 classes".
  virtual std::string describe() const = 0;

 protected:
  virtual void read_samples(const int64_t* indices, int64_t n, int64_t epoch, float* images,
                            int32_t* labels) const = 0;
};

// An MNIST-format directory holding {train,t10k}-{images-idx3,labels-idx1}-ubyte, each with or
// without .gz (gzip is detected by content). `train` picks train-* or t10k-*.
// Pixels become x/255 and then (x - mean)/std: the recipe's ToTensor() + Normalize(0.5, 1.0) is
// the default. num_classes() is 10, or max label + 1 if a label is larger (EMNIST-style sets).
// Errors (UsageError): the directory is missing, not a directory or empty; the split's files
// missing (both are listed); (Error) a bad file, image/label count mismatch, images not 3-D or
// labels not 1-D.
std::unique_ptr<Dataset> open_mnist(const std::string& dir, bool train, float mean = 0.5f,
                                    float std = 1.0f);

// Before reading either split: a UsageError naming every file `dir` lacks among the training
// split's and, `with_test`, the test split's, so a half-copied directory is named in one go.
void check_mnist_dir(const std::string& dir, bool with_test);

// The IDX files open_mnist reads in `dir` (of both splits, raw or .gz as it finds them): those
// present, by path.
std::vector<std::string> mnist_files(const std::string& dir);

// `size` random samples of `sample_shape`: every element standard normal (like torch.randn),
// labels uniform in [0, num_classes). A pure function of (seed, index, element): reading the
// same index twice, from any thread, in any batch, gives the same bits. Nothing is stored.
std::unique_ptr<Dataset> make_synthetic(int64_t size, const Shape& sample_shape, int num_classes,
                                        uint64_t seed);

// The order of one epoch: a permutation of 0..n-1 that is a pure function of (n, seed, epoch),
// identical on every platform and for every device count (Fisher-Yates driven by splitmix64;
// no std::shuffle or std:: distributions, which are implementation-defined).
// shuffle == false gives 0..n-1.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle);

// splitmix64 (Steele, Lea, Flood 2014): the generator behind epoch_order and make_synthetic.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), bound >= 1, without modulo bias (Lemire's multiply-and-reject).
  uint64_t below(uint64_t bound);
  double uniform01() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

// A seed made of two (a seed and a sample index, an epoch...): streams of nearby inputs share
// nothing.
uint64_t mix_seeds(uint64_t a, uint64_t b);

}  // namespace replica
