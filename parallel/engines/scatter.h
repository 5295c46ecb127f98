// How DP splits a global batch over devices: torch.chunk semantics, as PyTorch's scatter uses.
// Chunk size ceil(B/N); a batch smaller than the device count uses fewer devices, and so can
// an uneven one (B=9 on 4 devices: 3+3+3, device 3 idles that step).
#pragma once
#include <cstdint>
#include <vector>

namespace replica {

struct Chunk {
  int64_t begin = 0, count = 0;
};

inline std::vector<Chunk> scatter_chunks(int64_t batch, int devices) {
  std::vector<Chunk> chunks(devices);
  if (batch <= 0 || devices <= 0) return chunks;
  const int64_t size = (batch + devices - 1) / devices;
  for (int d = 0; d < devices; ++d) {
    const int64_t begin = std::min<int64_t>(batch, d * size);
    chunks[d] = {begin, std::min<int64_t>(batch, begin + size) - begin};
  }
  return chunks;
}

}  // namespace replica
