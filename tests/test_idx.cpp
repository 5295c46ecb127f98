// IDX reader and the MNIST-format dataset: good files (gzip and raw), the real Fashion-MNIST
// when installed, and every kind of bad file a user may have on disk.
#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include "engine/data/dataset.h"
#include "engine/data/idx.h"
#include "cli_helpers.h"
#include "engine/error.h"

namespace fs = std::filesystem;
using namespace replica;

namespace {

using test::file_bytes;
using test::TempDir;
using test::put_bytes;
using test::error_of;
using test::contains;

std::vector<uint8_t> gzip_bytes(const std::vector<uint8_t>& raw) {
  z_stream zs{};
  REQUIRE(deflateInit2(&zs, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::vector<uint8_t> out(deflateBound(&zs, raw.size()) + 64);
  zs.next_in = const_cast<Bytef*>(raw.data());
  zs.avail_in = static_cast<uInt>(raw.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

template <class F>
bool throws_usage(F&& f) {
  try {
    f();
  } catch (const UsageError&) {
    return true;
  } catch (...) {
  }
  return false;
}

std::vector<uint8_t> pattern(size_t n, int mul = 7) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * mul + i / 13) & 0xff);
  return v;
}

// A small MNIST-format split: n images of rows x cols, labels i % classes.
void write_split(const TempDir& d, const std::string& split, int64_t n, int64_t rows, int64_t cols,
                 bool gzip, int classes = 10) {
  std::string sfx = gzip ? ".gz" : "";
  write_idx(d.file(split + "-images-idx3-ubyte" + sfx), {n, rows, cols},
            pattern(size_t(n * rows * cols)), gzip);
  std::vector<uint8_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = static_cast<uint8_t>(i % classes);
  write_idx(d.file(split + "-labels-idx1-ubyte" + sfx), {n}, labels, gzip);
}

const char* kFashion = "/usr/share/datasets/fashion-mnist";

}  // namespace

TEST_CASE("idx: gzip and raw files round trip") {
  TempDir d;
  auto data = pattern(5 * 4 * 3);
  for (bool gz : {false, true}) {
    std::string p = d.file(gz ? "a.gz" : "a");
    write_idx(p, {5, 4, 3}, data, gz);
    IdxArray a = read_idx(p);
    CHECK(a.dims == std::vector<int64_t>{5, 4, 3});
    CHECK(a.data == data);
  }
  // Gzip is detected by content, not by name.
  write_idx(d.file("plain-name"), {5, 4, 3}, data, true);
  CHECK(read_idx(d.file("plain-name")).data == data);
  write_idx(d.file("raw.gz"), {5, 4, 3}, data, false);
  CHECK(read_idx(d.file("raw.gz")).data == data);
  // Labels; zero-length arrays are legal IDX.
  write_idx(d.file("l"), {7}, pattern(7), false);
  CHECK(read_idx(d.file("l")).dims == std::vector<int64_t>{7});
  write_idx(d.file("z.gz"), {0, 28, 28}, {}, true);
  CHECK(read_idx(d.file("z.gz")).data.empty());
}

TEST_CASE("idx: concatenated gzip members are one stream") {
  TempDir d;
  std::vector<uint8_t> raw = {0, 0, 8, 1, 0, 0, 0, 6, 10, 20, 30, 40, 50, 60};
  auto a = gzip_bytes({raw.begin(), raw.begin() + 9});
  auto b = gzip_bytes({raw.begin() + 9, raw.end()});
  a.insert(a.end(), b.begin(), b.end());
  put_bytes(d.file("multi.gz"), a);
  IdxArray arr = read_idx(d.file("multi.gz"));
  CHECK(arr.data == std::vector<uint8_t>{10, 20, 30, 40, 50, 60});
}

TEST_CASE("idx: parse_idx reads a file already in memory, gzip or raw") {
  std::vector<uint8_t> raw = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6};
  for (const auto& bytes : {raw, gzip_bytes(raw)}) {
    IdxArray a = parse_idx(bytes, "mem");
    CHECK(a.dims == std::vector<int64_t>{2, 1, 3});
    CHECK(a.data == std::vector<uint8_t>{1, 2, 3, 4, 5, 6});
  }
  // Messages name what the caller calls the bytes.
  std::vector<uint8_t> cut(raw.begin(), raw.end() - 1);
  CHECK(contains(error_of([&] { parse_idx(cut, "in-memory images"); }),
                 "in-memory images: truncated"));
  CHECK(contains(error_of([&] { parse_idx({}, "nothing"); }), "nothing: empty file"));
}

TEST_CASE("idx: missing, empty, directory") {
  TempDir d;
  CHECK(throws_usage([&] { read_idx(d.file("nope")); }));
  CHECK(contains(error_of([&] { read_idx(d.file("nope")); }), "nope: no such file"));
  put_bytes(d.file("empty"), {});
  CHECK(contains(error_of([&] { read_idx(d.file("empty")); }), "empty: empty file"));
  CHECK(throws_usage([&] { read_idx(d.path.string()); }));
}

TEST_CASE("idx: bad magic and unsupported types") {
  TempDir d;
  put_bytes(d.file("m1"), {0x12, 0x34, 0x08, 0x03, 0, 0, 0, 0});
  CHECK(contains(error_of([&] { read_idx(d.file("m1")); }), "not an IDX file"));
  put_bytes(d.file("m2"), {0, 0, 0x0D, 0x01, 0, 0, 0, 1, 0, 0, 0, 0});  // float data
  CHECK(contains(error_of([&] { read_idx(d.file("m2")); }), "unsupported IDX element type 0x0d"));
  put_bytes(d.file("m3"), {0, 0, 0x08, 0x00});
  CHECK(contains(error_of([&] { read_idx(d.file("m3")); }), "unsupported IDX rank 0"));
  put_bytes(d.file("m4"), {0, 0, 0x08, 0x09});
  CHECK(contains(error_of([&] { read_idx(d.file("m4")); }), "unsupported IDX rank 9"));
  // A text file someone saved under the right name.
  std::string html = "<html><body>404 Not Found</body></html>";
  put_bytes(d.file("m5"), std::vector<uint8_t>(html.begin(), html.end()));
  CHECK(contains(error_of([&] { read_idx(d.file("m5")); }), "m5: not an IDX file"));
  put_bytes(d.file("m6.gz"), gzip_bytes(std::vector<uint8_t>(html.begin(), html.end())));
  CHECK(contains(error_of([&] { read_idx(d.file("m6.gz")); }), "not an IDX file"));
}

TEST_CASE("idx: absurd header sizes are rejected before allocating") {
  TempDir d;
  // 4 x 0xffffffff: far beyond any real file; must not try to allocate it.
  put_bytes(d.file("huge"), {0, 0, 8, 4, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                             0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1, 2, 3});
  CHECK(contains(error_of([&] { read_idx(d.file("huge")); }), "corrupt header"));
  // Plausible but larger than the file: truncated, in raw and gzip form.
  std::vector<uint8_t> hdr = {0, 0, 8, 3, 0, 0, 0xea, 0x60, 0, 0, 0, 28, 0, 0, 0, 28};
  std::vector<uint8_t> f = hdr;
  f.resize(hdr.size() + 1200, 7);
  put_bytes(d.file("big"), f);
  std::string e = error_of([&] { read_idx(d.file("big")); });
  CHECK(contains(e, "truncated: header says 60000 images of 28x28 (47040000 bytes) but the file "
                    "has 1200 bytes"));
  put_bytes(d.file("big.gz"), gzip_bytes(f));
  e = error_of([&] { read_idx(d.file("big.gz")); });
  CHECK(contains(e, "big.gz: truncated: header says 60000 images of 28x28"));
  CHECK(contains(e, "1200 bytes"));
}

TEST_CASE("idx: truncated files at every kind of cut point") {
  TempDir d;
  auto data = pattern(10 * 6 * 5);
  write_idx(d.file("r"), {10, 6, 5}, data, false);
  write_idx(d.file("g.gz"), {10, 6, 5}, data, true);
  auto raw = file_bytes(d.file("r"));
  auto gz = file_bytes(d.file("g.gz"));
  // Raw: inside the magic, inside the dims, just after the header, mid-data, one byte short.
  for (size_t cut : {size_t(1), size_t(3), size_t(6), size_t(15), size_t(16), size_t(100),
                     raw.size() - 1}) {
    CAPTURE(cut);
    put_bytes(d.file("rc"), {raw.begin(), raw.begin() + long(cut)});
    std::string e = error_of([&] { read_idx(d.file("rc")); });
    CHECK(contains(e, "rc: truncated"));
  }
  // Gzip: every cut point must give an error (never a crash or a short array).
  for (size_t cut = 1; cut < gz.size(); cut += (cut < 40 ? 1 : 7)) {
    CAPTURE(cut);
    put_bytes(d.file("gc.gz"), {gz.begin(), gz.begin() + long(cut)});
    std::string e = error_of([&] { read_idx(d.file("gc.gz")); });
    CHECK(contains(e, "gc.gz: "));
  }
  // Mid-stream cut of the compressed data says it is truncated.
  put_bytes(d.file("gm.gz"), {gz.begin(), gz.begin() + long(gz.size() / 2)});
  CHECK(contains(error_of([&] { read_idx(d.file("gm.gz")); }), "truncated"));
  // Only the 8-byte gzip trailer missing: data complete but the stream is cut off.
  put_bytes(d.file("gt.gz"), {gz.begin(), gz.end() - 8});
  CHECK(contains(error_of([&] { read_idx(d.file("gt.gz")); }),
                 "truncated: the gzip stream holds all 300 bytes of data but is cut off before its "
                 "trailer"));
}

TEST_CASE("idx: trailing bytes and garbage") {
  TempDir d;
  auto data = pattern(4 * 3 * 3);
  write_idx(d.file("r"), {4, 3, 3}, data, false);
  auto raw = file_bytes(d.file("r"));
  raw.push_back(0);
  put_bytes(d.file("rt"), raw);
  CHECK(contains(error_of([&] { read_idx(d.file("rt")); }), "1 unexpected bytes after"));
  // Gzip of the file plus extra decompressed bytes.
  put_bytes(d.file("gt.gz"), gzip_bytes(raw));
  CHECK(contains(error_of([&] { read_idx(d.file("gt.gz")); }), "more bytes than the header"));
  // Garbage appended after a valid gzip stream.
  write_idx(d.file("g.gz"), {4, 3, 3}, data, true);
  auto gz = file_bytes(d.file("g.gz"));
  gz.insert(gz.end(), {'j', 'u', 'n', 'k'});
  put_bytes(d.file("gg.gz"), gz);
  CHECK(contains(error_of([&] { read_idx(d.file("gg.gz")); }),
                 "4 bytes of garbage after the gzip"));
  // Random garbage: an error, never a crash.
  std::vector<uint8_t> junk(4096);
  uint64_t x = 12345;
  for (int trial = 0; trial < 50; ++trial) {
    for (auto& b : junk) b = static_cast<uint8_t>((x = x * 6364136223846793005ull + 1) >> 56);
    if (trial % 2) junk[0] = 0x1f, junk[1] = 0x8b, junk[2] = 8;  // a gzip-looking start
    if (trial % 3 == 0) junk[0] = 0, junk[1] = 0, junk[2] = 8, junk[3] = 3;  // IDX-looking
    put_bytes(d.file("junk"), junk);
    CHECK_FALSE(error_of([&] { read_idx(d.file("junk")); }).empty());
  }
}

TEST_CASE("idx: corrupt gzip data") {
  TempDir d;
  write_idx(d.file("g.gz"), {50, 10, 10}, pattern(5000, 13), true);
  auto gz = file_bytes(d.file("g.gz"));
  int errors = 0;
  for (size_t pos = 12; pos < gz.size(); pos += gz.size() / 17) {
    auto bad = gz;
    bad[pos] ^= 0x5a;
    put_bytes(d.file("c.gz"), bad);
    std::string e = error_of([&] { read_idx(d.file("c.gz")); });
    CAPTURE(pos);
    CHECK_FALSE(e.empty());  // either inflate fails or the CRC check does
    errors += contains(e, "corrupt gzip") ? 1 : 0;
  }
  CHECK(errors > 0);
  // A bad byte in the header's method field.
  auto bad = gz;
  bad[2] = 0x07;
  put_bytes(d.file("h.gz"), bad);
  CHECK(contains(error_of([&] { read_idx(d.file("h.gz")); }), "corrupt gzip"));
}

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
  CHECK(throws_usage([] { open_mnist("/nonexistent/replica-data", true); }));
  CHECK(contains(error_of([] { open_mnist("/nonexistent/replica-data", true); }),
                 "/nonexistent/replica-data: no such directory"));
  TempDir empty;
  CHECK(throws_usage([&] { open_mnist(empty.path.string(), true); }));
  CHECK(contains(error_of([&] { open_mnist(empty.path.string(), true); }), "directory is empty"));

  TempDir partial;
  write_split(partial, "t10k", 5, 2, 2, true);
  put_bytes(partial.file("README"), {'x'});
  // The train split is missing entirely: both its files are listed, by the directory check of a
  // run that reads both splits and by opening the train split; the test split opens.
  for (bool with_test : {true, false}) {
    std::string e = error_of([&] { check_mnist_dir(partial.path.string(), with_test); });
    CHECK(throws_usage([&] { check_mnist_dir(partial.path.string(), with_test); }));
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

  // A bad normalisation.
  TempDir ok;
  write_split(ok, "t10k", 3, 2, 2, false);  // the other split, present and fine
  write_split(ok, "train", 3, 2, 2, false);
  CHECK(throws_usage([&] { open_mnist(ok.path.string(), true, 0.5f, 0.0f); }));
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
