// IDX files (the MNIST / Fashion-MNIST format), gzip-compressed or raw.
//   magic: 0x00 0x00 <type> <ndims>, then ndims big-endian u32 dimensions, then the data.
// Only unsigned-byte data (type 0x08) is supported: 0x00000803 = images [n, rows, cols],
// 0x00000801 = labels [n]. Gzip is detected by its 1f 8b magic, not by the file name.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica {

struct IdxArray {
  std::vector<int64_t> dims;   // e.g. {60000, 28, 28}
  std::vector<uint8_t> data;   // product(dims) bytes, row-major
};

// Reads and validates a whole IDX file. Throws UsageError for a missing/unreadable file and
// replica::Error (one line, naming the file) for an empty file, a bad magic or element type,
// an implausible header, truncated data, trailing bytes, or corrupt/truncated gzip data.
// Never allocates more than the file actually holds (dimensions are checked first).
IdxArray read_idx(const std::string& path);

// read_idx() of a file already in memory (gzip or raw); `name` is what the messages call it.
IdxArray parse_idx(std::vector<uint8_t> bytes, const std::string& name);

// Writes an unsigned-byte IDX file (gzip-compressed when `gzip`), for tests and tools.
void write_idx(const std::string& path, const std::vector<int64_t>& dims,
               const std::vector<uint8_t>& data, bool gzip);

}  // namespace replica
