#include "parallel/comm/buckets.h"

namespace replica {

std::vector<Bucket> make_buckets(const std::vector<Param*>& params, size_t first_cap_bytes,
                                 size_t cap_bytes) {
  std::vector<Bucket> buckets;
  Bucket current;
  size_t bytes = 0;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    const Param* p = params[i];
    const int64_t n = shape_numel(p->shape);
    const size_t cap = buckets.empty() ? first_cap_bytes : cap_bytes;
    if (!current.params.empty() && bytes + n * sizeof(float) > cap) {
      buckets.push_back(current);
      current = Bucket{};
      bytes = 0;
    }
    // Reverse order: each parameter sits just before the previous one in the flat buffer.
    current.offset = p->offset;
    current.numel += n;
    current.params.push_back(i);
    bytes += n * sizeof(float);
  }
  if (!current.params.empty()) buckets.push_back(current);
  return buckets;
}

}  // namespace replica
