// IDX files for the IDX and MNIST-directory suites: bytes in a fixed pattern (neighbours differ,
// so a shifted or swapped read shows), and a small MNIST-format split written with the engine's
// own IDX writer, raw or gzip.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cli_helpers.h"
#include "engine/data/idx.h"

namespace test {

inline std::vector<uint8_t> pattern(size_t n, int mul = 7) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * mul + i / 13) & 0xff);
  return v;
}

// A small MNIST-format split in d: n images of rows x cols (pattern's bytes), labels i % classes.
inline void write_split(const TempDir& d, const std::string& split, int64_t n, int64_t rows,
                        int64_t cols, bool gzip, int classes = 10) {
  const std::string sfx = gzip ? ".gz" : "";
  replica::write_idx(d.file(split + "-images-idx3-ubyte" + sfx), {n, rows, cols},
                     pattern(size_t(n * rows * cols)), gzip);
  std::vector<uint8_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = static_cast<uint8_t>(i % classes);
  replica::write_idx(d.file(split + "-labels-idx1-ubyte" + sfx), {n}, labels, gzip);
}

}  // namespace test
