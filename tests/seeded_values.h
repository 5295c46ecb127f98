// Seeded random inputs for the suites: a seed gives the same values on every run, so a failure
// reproduces, and two backends fed the same seed see the same numbers.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace test {

// n values uniform in [lo, hi).
inline std::vector<float> random_values(int64_t n, uint32_t seed, float lo = -1.f,
                                        float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// n values from the standard normal distribution.
inline std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace test
