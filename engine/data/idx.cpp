#include "engine/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "engine/error.h"
#include "engine/file_io.h"

namespace replica {
namespace {

constexpr uint64_t kMaxDataBytes = uint64_t(1) << 36;  // 64 GiB: anything larger is a bad header
constexpr int kMaxDims = 4;
constexpr size_t kMaxHeaderBytes = 4 + 4 * 255;

struct Inflated {
  std::vector<uint8_t> data;
  bool truncated = false;  // the compressed input ended before the gzip stream did
};

// Decompresses at most `limit` bytes of a gzip file (all members). Output grows with what is
// actually decompressed, so a lying header cannot make us allocate more than the data holds.
Inflated gunzip(const std::string& path, const std::vector<uint8_t>& in, size_t limit) {
  Inflated r;
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 16) != Z_OK) throw Error(fmt::format("{}: zlib init failed", path));
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, inflateEnd);
  zs.next_in = const_cast<Bytef*>(in.data());
  zs.avail_in = static_cast<uInt>(std::min<size_t>(in.size(), UINT32_MAX));
  size_t in_left = in.size() - zs.avail_in;  // for inputs over 4 GiB
  size_t produced = 0;
  while (produced < limit) {
    if (r.data.size() == produced)
      r.data.resize(std::min(limit, std::max<size_t>(produced * 2, 1 << 16)));
    zs.next_out = r.data.data() + produced;
    zs.avail_out = static_cast<uInt>(std::min<size_t>(r.data.size() - produced, UINT32_MAX));
    uInt out_before = zs.avail_out;
    int ret = inflate(&zs, Z_NO_FLUSH);
    produced += out_before - zs.avail_out;
    if (zs.avail_in == 0 && in_left > 0) {
      uInt more = static_cast<uInt>(std::min<size_t>(in_left, UINT32_MAX));
      zs.avail_in = more;
      in_left -= more;
    }
    if (ret == Z_STREAM_END) {
      if (zs.avail_in == 0) break;  // end of the last member
      if (zs.avail_in >= 2 && zs.next_in[0] == 0x1f && zs.next_in[1] == 0x8b) {
        inflateReset(&zs);  // concatenated gzip member
        continue;
      }
      throw Error(fmt::format("{}: {} bytes of garbage after the gzip data", path,
                              size_t(zs.avail_in) + in_left));
    }
    if (ret == Z_OK || ret == Z_BUF_ERROR) {
      if (zs.avail_in == 0 && zs.avail_out > 0) {  // wants more input, there is none
        r.truncated = true;
        break;
      }
      continue;
    }
    throw Error(fmt::format("{}: corrupt gzip data ({})", path,
                            zs.msg ? zs.msg : "zlib error " + std::to_string(ret)));
  }
  r.data.resize(produced);
  return r;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

std::string describe_dims(const std::vector<int64_t>& d) {
  if (d.size() == 3) return fmt::format("{} images of {}x{}", d[0], d[1], d[2]);
  if (d.size() == 1) return fmt::format("{} labels", d[0]);
  return fmt::format("shape {}", fmt::join(d, "x"));
}

struct Header {
  std::vector<int64_t> dims;
  size_t header_bytes = 0;
  uint64_t data_bytes = 0;
};

// `b` holds the first bytes of the (decompressed) file; `n` of them are valid.
Header parse_header(const std::string& path, const uint8_t* b, size_t n, const char* what) {
  if (n < 4)
    throw Error(fmt::format("{}: truncated: {} {} bytes, an IDX header needs at least 4", path,
                            what, n));
  uint32_t magic = be32(b);
  if (b[0] != 0 || b[1] != 0)
    throw Error(fmt::format("{}: not an IDX file (magic 0x{:08x}; expected 0x00000803 for "
                            "images or 0x00000801 for labels)",
                            path, magic));
  if (b[2] != 0x08)
    throw Error(fmt::format("{}: unsupported IDX element type 0x{:02x} (magic 0x{:08x}); only "
                            "unsigned bytes (0x08) are supported",
                            path, b[2], magic));
  int ndims = b[3];
  if (ndims < 1 || ndims > kMaxDims)
    throw Error(fmt::format("{}: unsupported IDX rank {} (magic 0x{:08x}); expected 1 to {} "
                            "dimensions",
                            path, ndims, magic, kMaxDims));
  Header h;
  h.header_bytes = 4 + 4 * size_t(ndims);
  if (n < h.header_bytes)
    throw Error(fmt::format("{}: truncated: {} {} bytes, the IDX header of {} dimensions needs {}",
                            path, what, n, ndims, h.header_bytes));
  uint64_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    uint64_t d = be32(b + 4 + 4 * i);
    h.dims.push_back(static_cast<int64_t>(d));
    if (d != 0 && total > kMaxDataBytes / d)
      total = kMaxDataBytes + 1;
    else
      total *= d;
  }
  if (total > kMaxDataBytes)
    throw Error(fmt::format("{}: corrupt header: dimensions {} describe more than {} GiB of data",
                            path, fmt::join(h.dims, "x"), kMaxDataBytes >> 30));
  h.data_bytes = total;
  return h;
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  return parse_idx(read_file_bytes(path, "an IDX file"), path);
}

IdxArray parse_idx(std::vector<uint8_t> file, const std::string& path) {
  if (file.empty()) throw Error(fmt::format("{}: empty file, expected an IDX file", path));
  IdxArray out;
  if (file.size() >= 2 && file[0] == 0x1f && file[1] == 0x8b) {
    Inflated head = gunzip(path, file, kMaxHeaderBytes);
    if (head.truncated && head.data.size() < 4)
      throw Error(fmt::format("{}: truncated gzip data: the stream ends after {} bytes, before "
                              "the IDX header",
                              path, head.data.size()));
    Header h = parse_header(path, head.data.data(), head.data.size(), "decompresses to");
    size_t want = h.header_bytes + h.data_bytes;
    Inflated all = gunzip(path, file, want + 1);
    file.clear();
    file.shrink_to_fit();
    if (all.data.size() > want)
      throw Error(fmt::format("{}: the gzip data holds more bytes than the header describes ({}, "
                              "{} bytes): corrupt or not an IDX file",
                              path, describe_dims(h.dims), h.data_bytes));
    if (all.data.size() < want || all.truncated) {
      size_t have = all.data.size() - std::min(all.data.size(), h.header_bytes);
      if (all.truncated && have == h.data_bytes)
        throw Error(fmt::format("{}: truncated: the gzip stream holds all {} bytes of data but "
                                "is cut off before its trailer (incomplete download?)",
                                path, h.data_bytes));
      if (all.truncated)
        throw Error(fmt::format("{}: truncated: header says {} ({} bytes) but the gzip stream is "
                                "cut off after {} bytes (incomplete download?)",
                                path, describe_dims(h.dims), h.data_bytes, have));
      throw Error(fmt::format("{}: truncated: header says {} ({} bytes) but the file has {} bytes "
                              "(decompressed)",
                              path, describe_dims(h.dims), h.data_bytes, have));
    }
    out.dims = h.dims;
    all.data.erase(all.data.begin(), all.data.begin() + h.header_bytes);
    out.data = std::move(all.data);
  } else {
    Header h = parse_header(path, file.data(), file.size(), "file has");
    size_t have = file.size() - h.header_bytes;
    if (have < h.data_bytes)
      throw Error(fmt::format("{}: truncated: header says {} ({} bytes) but the file has {} bytes",
                              path, describe_dims(h.dims), h.data_bytes, have));
    if (have > h.data_bytes)
      throw Error(fmt::format("{}: {} unexpected bytes after the {} the header describes: corrupt "
                              "or not an IDX file",
                              path, have - h.data_bytes, describe_dims(h.dims)));
    out.dims = h.dims;
    file.erase(file.begin(), file.begin() + h.header_bytes);
    out.data = std::move(file);
  }
  return out;
}

void write_idx(const std::string& path, const std::vector<int64_t>& dims,
               const std::vector<uint8_t>& data, bool gzip) {
  REPLICA_CHECK(!dims.empty() && dims.size() <= size_t(kMaxDims), "IDX rank {} unsupported",
                dims.size());
  std::vector<uint8_t> bytes = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  uint64_t total = 1;
  for (int64_t d : dims) {
    REPLICA_CHECK(d >= 0 && d <= int64_t(UINT32_MAX), "IDX dimension {} out of range", d);
    total *= uint64_t(d);
    for (int s = 24; s >= 0; s -= 8) bytes.push_back(static_cast<uint8_t>(uint64_t(d) >> s));
  }
  REPLICA_CHECK(total == data.size(), "IDX data has {} bytes, dimensions say {}", data.size(),
                total);
  bytes.insert(bytes.end(), data.begin(), data.end());
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    if (!f) throw Error(fmt::format("{}: cannot create: {}", path, std::strerror(errno)));
    size_t off = 0;
    bool ok = true;
    while (ok && off < bytes.size()) {
      unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes.size() - off, 1 << 30));
      ok = gzwrite(f, bytes.data() + off, chunk) == int(chunk);
      off += chunk;
    }
    if (gzclose(f) != Z_OK || !ok) throw Error(fmt::format("{}: write failed", path));
  } else {
    std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "wb"));
    if (!f) throw Error(fmt::format("{}: cannot create: {}", path, std::strerror(errno)));
    if (std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size() ||
        std::fflush(f.get()) != 0)
      throw Error(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
  }
}

}  // namespace replica
