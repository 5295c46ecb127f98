// Gradient buckets: parameters grouped in REVERSE registration order (the order backward
// produces their gradients), each bucket a contiguous range of the flat gradient buffer.
// The first bucket is small so communication starts early; the rest are capped (PyTorch DDP's
// 1 MB / 25 MB defaults).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "layers/module.h"

namespace replica {

struct Bucket {
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
  std::vector<int> params;  // indices into the model's params(), in reverse order
};

std::vector<Bucket> make_buckets(const std::vector<Param*>& params, size_t first_cap_bytes,
                                 size_t cap_bytes);

}  // namespace replica
