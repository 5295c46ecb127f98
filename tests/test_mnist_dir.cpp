// MNIST-format directories (open_mnist, check_mnist_dir): a generated directory read back, gzip
// and raw, normalised as ToTensor + Normalize; a missing, empty or partial directory and bad
// files named in one line; and the installed Fashion-MNIST, when there, read whole.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli_helpers.h"
#include "engine/data/dataset.h"
#include "engine/data/idx.h"
#include "engine/error.h"
#include "idx_files.h"

namespace fs = std::filesystem;
using namespace replica;
using namespace test;  // the suites' files, bytes and errors (cli_helpers.h, idx_files.h)

namespace {

const char* kFashion = "/usr/share/datasets/fashion-mnist";

}  // namespace

TEST_CASE("mnist: a generated directory, gzip and raw") {
  for (bool gz : {true, false}) {
    TempDir d;
    write_split(d, "train", 30, 4, 5, gz);
    write_split(d, "t10k", 12, 4, 5, gz);
    auto train = open_mnist(d.path.string(), true);
    auto test = open_mnist(d.path.string(), false, 0.0f, 1.0f);
    CHECK(train->size() == 30);
    CHECK(test->size() == 12);
    CHECK(train->sample_shape() == Shape{1, 4, 5});
    CHECK(train->num_classes() == 10);
    CHECK(contains(train->describe(), " train: 30 x 1x4x5, 10 classes"));
    CHECK(contains(test->describe(), " test: 12 x 1x4x5, 10 classes"));
    std::vector<int64_t> idx = {3, 0, 29};
    std::vector<float> img(3 * 20);
    std::vector<int32_t> lbl(3);
    train->read(idx.data(), 3, img.data(), lbl.data());
    auto pix = pattern(30 * 20);
    for (int i = 0; i < 3; ++i) {
      CHECK(lbl[i] == idx[i] % 10);
      for (int k = 0; k < 20; ++k)
        CHECK(img[i * 20 + k] == doctest::Approx(pix[idx[i] * 20 + k] / 255.0f - 0.5f));
    }
    test->read(idx.data(), 1, img.data(), lbl.data());
    CHECK(img[0] == doctest::Approx(pix[3 * 20] / 255.0f));
    // Out-of-range index: an error, not a read past the end.
    std::vector<int64_t> bad = {30};
    CHECK_THROWS_AS(train->read(bad.data(), 1, img.data(), lbl.data()), Error);
  }
}

TEST_CASE("mnist: directory and file errors") {
  CHECK_THROWS_AS(open_mnist("/nonexistent/replica-data", true), UsageError);
  CHECK(contains(error_of([] { open_mnist("/nonexistent/replica-data", true); }),
                 "/nonexistent/replica-data: no such directory"));
  TempDir empty;
  CHECK_THROWS_AS(open_mnist(empty.path.string(), true), UsageError);
  CHECK(contains(error_of([&] { open_mnist(empty.path.string(), true); }), "directory is empty"));

  TempDir partial;
  write_split(partial, "t10k", 5, 2, 2, true);
  put_bytes(partial.file("README"), {'x'});
  // The train split is missing entirely: both its files are listed, by the directory check of a
  // run that reads both splits and by opening the train split; the test split opens.
  for (bool with_test : {true, false}) {
    std::string e = error_of([&] { check_mnist_dir(partial.path.string(), with_test); });
    CHECK_THROWS_AS(check_mnist_dir(partial.path.string(), with_test), UsageError);
    CHECK(contains(e, fmt::format("missing 2 of the {} MNIST-format files needed: "
                                  "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz]",
                                  with_test ? 4 : 2)));
    CHECK_FALSE(contains(e, "t10k"));
  }
  CHECK(contains(error_of([&] { open_mnist(partial.path.string(), true); }),
                 "missing 2 of the 2 MNIST-format files needed"));
  CHECK(open_mnist(partial.path.string(), false)->size() == 5);
  write_split(partial, "train", 7, 2, 2, false);
  CHECK(open_mnist(partial.path.string(), false)->size() == 5);
  CHECK(open_mnist(partial.path.string(), true)->size() == 7);
  // Only one file is missing: only it is listed, and only where it is needed.
  fs::remove(partial.file("t10k-labels-idx1-ubyte.gz"));
  std::string e = error_of([&] { check_mnist_dir(partial.path.string(), true); });
  CHECK(contains(e, "missing 1 of the 4 MNIST-format files needed: t10k-labels-idx1-ubyte[.gz]"));
  CHECK_FALSE(contains(e, "images"));
  check_mnist_dir(partial.path.string(), false);  // a run without evaluation: all it needs
  CHECK(open_mnist(partial.path.string(), true)->size() == 7);

  // A file passed where the directory should be.
  CHECK(contains(error_of([&] { open_mnist(partial.file("README"), true); }), "not a directory"));

  // Count mismatch.
  TempDir mism;
  write_split(mism, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_idx(mism.file("train-images-idx3-ubyte"), {6, 2, 2}, pattern(24), false);
  write_idx(mism.file("train-labels-idx1-ubyte.gz"), {5}, pattern(5, 1), true);
  e = error_of([&] { open_mnist(mism.path.string(), true); });
  CHECK(contains(e, "5 labels but"));
  CHECK(contains(e, "has 6 images"));

  // Swapped files (labels where images belong).
  TempDir swapped;
  write_split(swapped, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_idx(swapped.file("train-images-idx3-ubyte"), {6}, pattern(6), false);
  write_idx(swapped.file("train-labels-idx1-ubyte"), {6, 2, 2}, pattern(24), false);
  CHECK(contains(error_of([&] { open_mnist(swapped.path.string(), true); }),
                 "train-images-idx3-ubyte holds labels and " +
                     swapped.file("train-labels-idx1-ubyte") +
                     " holds images: the two files are swapped"));
  // Labels where images belong, but no images among the labels: the shape is named.
  write_idx(swapped.file("train-labels-idx1-ubyte"), {6}, pattern(6), false);
  CHECK(contains(error_of([&] { open_mnist(swapped.path.string(), true); }),
                 "expected images [n, rows, cols]"));

  // A truncated file inside a dataset directory names that file.
  TempDir trunc;
  write_split(trunc, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_split(trunc, "train", 20, 3, 3, false);
  auto img = file_bytes(trunc.file("train-images-idx3-ubyte"));
  put_bytes(trunc.file("train-images-idx3-ubyte"), {img.begin(), img.begin() + 50});
  CHECK(contains(error_of([&] { open_mnist(trunc.path.string(), true); }),
                 "train-images-idx3-ubyte: truncated"));

  // Labels beyond 9 widen num_classes instead of reading out of range later.
  TempDir wide;
  write_split(wide, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_split(wide, "train", 40, 2, 2, false, 26);
  CHECK(open_mnist(wide.path.string(), true)->num_classes() == 26);
  // One corrupt label (255 among 0..9) is refused with its sample, where it made 256 classes;
  // a split too small to hold every class is not judged (5 samples up to 25).
  std::vector<uint8_t> labels(300);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = uint8_t(i % 10);
  labels[123] = 255;
  write_idx(wide.file("train-images-idx3-ubyte"), {300, 2, 2}, pattern(1200), false);
  write_idx(wide.file("train-labels-idx1-ubyte"), {300}, labels, false);
  CHECK(error_of([&] { open_mnist(wide.path.string(), true); }) ==
        wide.file("train-labels-idx1-ubyte") +
            ": label 255 (sample 123) makes 256 classes, and 245 of them have no sample among "
            "the 300 (the other labels run 0..9): a corrupt labels file?");
  write_idx(wide.file("train-labels-idx1-ubyte"), {300}, std::vector<uint8_t>(300, 200), false);
  CHECK(contains(error_of([&] { open_mnist(wide.path.string(), true); }),
                 ": label 200 (sample 0) makes 201 classes, and 200 of them have no sample among "
                 "the 300 (no other label): a corrupt labels file?"));
  write_idx(wide.file("train-images-idx3-ubyte"), {5, 2, 2}, pattern(20), false);
  write_idx(wide.file("train-labels-idx1-ubyte"), {5}, {0, 3, 20, 7, 25}, false);
  CHECK(open_mnist(wide.path.string(), true)->num_classes() == 26);

  // A bad normalisation.
  TempDir ok;
  write_split(ok, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_split(ok, "train", 3, 2, 2, false);
  CHECK_THROWS_AS(open_mnist(ok.path.string(), true, 0.5f, 0.0f), UsageError);
}

TEST_CASE("mnist: the installed Fashion-MNIST") {
  if (!fs::exists(kFashion)) {
    MESSAGE("skipped: " << kFashion << " not installed");
    return;
  }
  auto train = open_mnist(kFashion, true);
  auto test = open_mnist(kFashion, false);
  CHECK(train->size() == 60000);
  CHECK(test->size() == 10000);
  CHECK(train->sample_shape() == Shape{1, 28, 28});
  CHECK(train->num_classes() == 10);
  CHECK(train->describe() == "fashion-mnist train: 60000 x 1x28x28, 10 classes");
  // Labels all in range, every class present, balanced (6000 / 1000 each).
  for (auto* ds : {train.get(), test.get()}) {
    const int64_t n = ds->size();
    std::vector<int64_t> idx(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = i;
    std::vector<float> img(static_cast<size_t>(n) * 784);
    std::vector<int32_t> lbl(static_cast<size_t>(n));
    ds->read(idx.data(), n, img.data(), lbl.data());
    std::vector<int64_t> count(10, 0);
    for (int32_t l : lbl) {
      REQUIRE(l >= 0);
      REQUIRE(l < 10);
      ++count[size_t(l)];
    }
    for (int c = 0; c < 10; ++c) CHECK(count[size_t(c)] == n / 10);
    float lo = 1e9f, hi = -1e9f;
    double sum = 0;
    for (float v : img) lo = std::min(lo, v), hi = std::max(hi, v), sum += v;
    CHECK(lo == doctest::Approx(-0.5f));  // ToTensor + Normalize(0.5, 1.0): [-0.5, 0.5]
    CHECK(hi == doctest::Approx(0.5f));
    CHECK(sum / double(img.size()) == doctest::Approx(0.286 - 0.5).epsilon(0.02));
  }
  // The gzip files read directly.
  IdxArray labels = read_idx(std::string(kFashion) + "/t10k-labels-idx1-ubyte.gz");
  CHECK(labels.dims == std::vector<int64_t>{10000});
}
