// Max pooling's rule for a window's winner, and the CPU's kernel for 2x2 windows that tile the
// plane (stride 2, no padding: the CNN's pool), 16 windows at a time in AVX-512 vectors.
//
// A row of windows is two input rows. Their even and odd columns, split apart by two shuffles,
// are each window's four elements, one window to a lane, so the rule below runs as three
// compare-and-selects a vector. The element-wise path took a window's elements one by one from
// stride-2 positions, keeping a value and an index for each: 3.2-4.0x the time forward and
// 2.7-2.9x backward on the CNN's 20x20 planes (bench/results/2026-11-29-cpu-max-pool-2x2.md).
// In builds for AVX2, the same vectors (pairs of 8 lanes, the ends through the stack) measured
// slower than the element-wise path, so those builds keep it.
#pragma once
#include <cstdint>

namespace replica::cpu {

// The rule of a window's winner, in one place for floats and vectors of them: a larger value
// wins, a NaN wins over any number, and among equals (or NaNs) the first in row-major order
// stays. Bitwise, not short-circuit: `||` and `&&` are branches too.
template <class T>
inline auto takes_over(T v, T best_v) {
  return (v > best_v) | ((v != v) & (best_v == best_v));
}

// Whether this build has the kernel (built for AVX-512 CPUs).
bool max_pool_2x2_built();

// The maxima of the q windows whose rows are top and bottom (input rows 2oy and 2oy + 1), to
// out. Values only: which of equal elements won changes no bit of the output.
void max_pool_2x2_row(const float* top, const float* bottom, int64_t q, float* out);

// The gradient of those windows into the first 2q elements of dtop and dbottom: each window's
// winner (found again by the rule) gets +0 + grad (-0 becomes +0, as adding into a zeroed plane
// gives), the rest 0. Elements past 2q are not written.
void max_pool_2x2_row_grad(const float* top, const float* bottom, const float* grad, int64_t q,
                           float* dtop, float* dbottom);

}  // namespace replica::cpu
