// Index arithmetic for the CUDA kernels: splitting a flat index by a shape's extent (a plane's
// H*W, a row's W, a channel count C) known only at run time. A GPU has no integer divider: a
// 64-bit `/` or `%` compiles to a loop of about a hundred instructions, and the pooling and
// BatchNorm kernels that did three or four per element ran 4-10x slower than their memory
// traffic on an H200 (ResNet-50's max-pool backward: 1.06 ms, about 10x its bytes' time).
//
// FastDivmod divides by a fixed d with a multiply-high, an add and a shift: the round-up
// method of Granlund and Montgomery ("Division by invariant integers using multiplication",
// 1994). With s = ceil(log2 d) and mul = floor(2^32 * (2^s - d) / d) + 1, n / d equals
// (umulhi(n, mul) + n) >> s for every n < 2^31 (the sum then fits 32 bits). Kernels take the
// divider as a template parameter: FastDivmod where the host has checked every index stays
// below 2^31, WideDivmod (an ordinary 64-bit division) otherwise, so no shape is refused.
//
// Plain C++ outside nvcc, so the CPU test suite checks the arithmetic (tests/test_index_math).
// REPLICA_CUDA_WIDE_INDEX=1 in the environment makes every kernel take the WideDivmod path,
// which real shapes reach only past 2^31 values: the GPU parity tests run it on small ones.
#pragma once
#include <cstdint>

#include "engine/error.h"
#include "engine/env_switch.h"
#include "engine/host_device.h"

namespace replica {
namespace cuda {

// Indices below this bound may use FastDivmod.
constexpr int64_t kFastIndexLimit = int64_t(1) << 31;

// Whether a kernel whose divided numbers all stay below `largest` may use FastDivmod (host).
inline bool fast_index(int64_t largest) {
  return largest < kFastIndexLimit && !switches::kCudaWideIndex.on();
}

struct FastDivmod {
  using Index = uint32_t;
  uint32_t d = 1, mul = 1, shift = 0;

  FastDivmod() = default;
  // 1 <= divisor < 2^31 (every extent divided by here is an index bound); else an Error.
  explicit FastDivmod(int64_t divisor) : d(uint32_t(divisor)) {
    REPLICA_CHECK(divisor >= 1 && divisor < kFastIndexLimit,
                  "FastDivmod: divisor {} is outside [1, 2^31)", divisor);
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  REPLICA_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = uint32_t((uint64_t(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
  REPLICA_HOST_DEVICE uint32_t divisor() const { return d; }
};

struct WideDivmod {
  using Index = uint64_t;
  uint64_t d = 1;

  WideDivmod() = default;
  explicit WideDivmod(int64_t divisor) : d(uint64_t(divisor)) {}
  REPLICA_HOST_DEVICE uint64_t div(uint64_t n) const { return n / d; }
  REPLICA_HOST_DEVICE uint64_t divisor() const { return d; }
};

// n = q * d + r with 0 <= r < d, for either divider.
template <class Div>
REPLICA_HOST_DEVICE typename Div::Index split(const Div& by, typename Div::Index n,
                                              typename Div::Index* r) {
  const typename Div::Index q = by.div(n);
  *r = n - q * by.divisor();
  return q;
}

}  // namespace cuda
}  // namespace replica
