// The CUDA kernels' index division (engine/cuda/index_math.h), checked on the host: the same
// header and arithmetic the GPU runs, against the C++ operators, for every divisor a shape can
// give up to a few thousand and for the extremes (powers of two either side, 2^31 - 1), with
// dividends at the multiples' edges and up to the largest the kernels may pass (2^31 - 1).
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/cuda/index_math.h"

using replica::cuda::FastDivmod;
using replica::cuda::kFastIndexLimit;
using replica::cuda::split;
using replica::cuda::WideDivmod;

namespace {

// Dividends worth trying for d: around 0, around a few multiples, around the limit, and random.
std::vector<uint32_t> dividends(uint32_t d, std::mt19937& rng) {
  const uint64_t top = uint64_t(kFastIndexLimit) - 1;
  std::vector<uint64_t> v = {0, 1, 2, top, top - 1, top - d + 1, top / d * d, top / d * d - 1};
  for (uint64_t k : {uint64_t(1), uint64_t(2), uint64_t(3), uint64_t(1000), top / d / 2})
    for (int64_t e = -1; e <= 1; ++e) v.push_back(k * d + uint64_t(e));
  std::uniform_int_distribution<uint32_t> any(0, uint32_t(top));
  for (int i = 0; i < 64; ++i) v.push_back(any(rng));
  std::vector<uint32_t> out;
  for (uint64_t n : v)
    if (n <= top) out.push_back(uint32_t(n));
  return out;
}

int check_divisor(uint32_t d, std::mt19937& rng) {
  const FastDivmod fast(d);
  const WideDivmod wide(d);
  int wrong = 0;
  for (uint32_t n : dividends(d, rng)) {
    uint32_t r = 0;
    const uint32_t q = split(fast, n, &r);
    uint64_t wr = 0;
    const uint64_t wq = split(wide, uint64_t(n), &wr);
    if (q != n / d || r != n % d || wq != n / d || wr != n % d) {
      if (++wrong <= 5) FAIL_CHECK("n = " << n << ", d = " << d << ": " << q << " r " << r);
    }
  }
  return wrong;
}

}  // namespace

TEST_CASE("index math: FastDivmod gives n / d and n % d below 2^31") {
  std::mt19937 rng(7);
  int wrong = 0;
  for (uint32_t d = 1; d <= 4096; ++d) wrong += check_divisor(d, rng);
  // Extents of real shapes (7x7, 56x56, 112x112 planes; channel counts) and the extremes.
  for (uint32_t d : {49u, 3136u, 12544u, 50176u, 65535u, 65536u, 65537u, 1u << 20, (1u << 20) + 1,
                     (1u << 30) - 1, 1u << 30, (1u << 30) + 1, 0x7fffffffu})
    wrong += check_divisor(d, rng);
  std::uniform_int_distribution<uint32_t> any_d(1, 0x7fffffffu);
  for (int i = 0; i < 2000; ++i) wrong += check_divisor(any_d(rng), rng);
  CHECK(wrong == 0);
}

TEST_CASE("index math: a flat index split into (plane, channel, position) as the kernels do") {
  // [N, C, HW] = [3, 5, 7]: i = (n * C + c) * HW + p for every element, recovered exactly.
  const FastDivmod by_hw(7), by_c(5);
  for (uint32_t n = 0; n < 3; ++n)
    for (uint32_t c = 0; c < 5; ++c)
      for (uint32_t p = 0; p < 7; ++p) {
        const uint32_t i = (n * 5 + c) * 7 + p;
        uint32_t pos = 0, chan = 0;
        const uint32_t plane = split(by_hw, i, &pos);
        const uint32_t img = split(by_c, plane, &chan);
        CHECK(img == n);
        CHECK(chan == c);
        CHECK(pos == p);
      }
}
