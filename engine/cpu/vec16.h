// Vectors of 16 floats, one AVX-512 register, for the CPU kernels written with GCC's vector
// extensions and AVX-512's masks (the direct convolution, 2x2 max pooling, batch norm's lanes).
// Only in builds for AVX-512 CPUs: the first two measured slower than the other paths when built
// for AVX2, the masks are AVX-512's, and there a 64-byte vector passed to or returned from a
// function has no settled ABI (GCC warns). One definition for every kernel, which also keeps a
// unity build's batches from meeting two of them.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace replica::cpu {

constexpr int kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
// Lane masks (a comparison's result: -1 or 0 per lane) and shuffle indices.
typedef int Lanes __attribute__((vector_size(kLanes * sizeof(int))));

// Shuffle indices over two vectors a, b (lanes 0-15 of a, then 16-31 of b): the even and odd
// lanes of their 32, and the first and second halves of their lanes taken in turns (a[0], b[0],
// a[1], b[1], ...), which undoes the even / odd split.
inline const Lanes kEven = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
inline const Lanes kOdd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
inline const Lanes kInterleaveLow = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
inline const Lanes kInterleaveHigh = {8,  24, 9,  25, 10, 26, 11, 27,
                                      12, 28, 13, 29, 14, 30, 15, 31};

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
// The first n <= kLanes floats at p, zeros in the lanes after; nothing past them is read (a
// masked load).
inline Vec load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p);
}
// v's first n <= kLanes lanes to p; nothing past them is written.
inline void store_first(float* p, int64_t n, Vec v) {
  _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v);
}

// Up to 2 * kLanes floats in two vectors: a row of 16 windows' pairs (2x2 max pooling), or 8
// channels' rows of up to 4 positions (batch norm's lanes).
struct VecPair {
  Vec lo, hi;
};
// The first k <= 2 * kLanes floats at p, zeros after; nothing past them is read, and no pointer
// is formed past p's first kLanes where k does not reach them.
inline VecPair load_floats(const float* p, int64_t k) {
  return {load_first(p, k < kLanes ? k : kLanes), k > kLanes ? load_first(p + kLanes, k - kLanes)
                                                             : Vec{}};
}
// v's first k <= 2 * kLanes floats to p; nothing past them is written.
inline void store_floats(float* p, int64_t k, const VecPair& v) {
  store_first(p, k < kLanes ? k : kLanes, v.lo);
  if (k > kLanes) store_first(p + kLanes, k - kLanes, v.hi);
}

// Every lane s: a broadcast. s - 0 is s for every s, so no subtraction is left; 0 + s would
// cost an add, since 0 + -0 is +0.
inline Vec splat(float s) { return s - Vec{}; }

}  // namespace replica::cpu

#endif  // __AVX512F__
