// libFuzzer target for the IDX reader (engine/data/idx.h), built and run by tools/fuzz.sh.
// Every input is parsed as a file (gzip when it starts with 1f 8b, raw otherwise). A raw input is
// also gzip-compressed here and parsed again, so the gzip path sees the fuzzed headers and data
// too: both must agree, and the compressed stream cut short must be rejected. Bad input may
// only throw replica::Error.
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "engine/data/idx.h"
#include "engine/error.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_idx: %s\n", what);
  std::abort();
}

std::vector<uint8_t> gzip(const uint8_t* data, size_t size) {
  z_stream zs{};
  if (deflateInit2(&zs, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) fail("deflate");
  std::vector<uint8_t> out(deflateBound(&zs, size) + 64);
  zs.next_in = const_cast<Bytef*>(data);
  zs.avail_in = static_cast<uInt>(size);
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) fail("deflate did not finish");
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// The parsed array, or false when the input was rejected with replica::Error.
bool parse(std::vector<uint8_t> bytes, replica::IdxArray* out) {
  try {
    *out = replica::parse_idx(std::move(bytes), "fuzz.idx");
    return true;
  } catch (const replica::Error&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::IdxArray raw;
  bool raw_ok = parse(std::vector<uint8_t>(data, data + size), &raw);
  if (raw_ok) {
    size_t n = 1;
    for (int64_t d : raw.dims) n *= static_cast<size_t>(d);
    if (raw.dims.empty() || n != raw.data.size()) fail("accepted array: dims and data disagree");
  }
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) return 0;  // already gzip

  std::vector<uint8_t> gz = gzip(data, size);
  replica::IdxArray unzipped;
  bool gz_ok = parse(gz, &unzipped);
  if (gz_ok != raw_ok) fail("the raw file and its gzip disagree on whether it is valid");
  if (gz_ok && (unzipped.dims != raw.dims || unzipped.data != raw.data))
    fail("the raw file and its gzip read differently");
  if (raw_ok) {
    gz.resize(gz.size() - 1);  // the last byte of the gzip trailer
    replica::IdxArray cut;
    if (parse(gz, &cut)) fail("a truncated gzip stream was accepted");
  }
  return 0;
}
