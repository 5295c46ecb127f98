// The IDX reader: good files (gzip and raw, concatenated gzip members, a file already in memory)
// and every kind of bad file a user may have on disk: missing, empty, a directory, bad magic,
// absurd sizes, cut at every kind of point, trailing garbage, corrupt gzip. (MNIST-format
// directories built on it: test_mnist_dir.cpp.)
#include <doctest/doctest.h>
#include <zlib.h>

#include <string>
#include <vector>

#include "cli_helpers.h"
#include "engine/data/idx.h"
#include "engine/error.h"
#include "idx_files.h"

using namespace replica;
using namespace test;  // the suites' files, bytes and errors (cli_helpers.h, idx_files.h)

namespace {

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
  CHECK_THROWS_AS(read_idx(d.file("nope")), UsageError);
  CHECK(contains(error_of([&] { read_idx(d.file("nope")); }), "nope: no such file"));
  put_bytes(d.file("empty"), {});
  CHECK(contains(error_of([&] { read_idx(d.file("empty")); }), "empty: empty file"));
  CHECK_THROWS_AS(read_idx(d.path.string()), UsageError);
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
