// Max pooling's rule for a window's winner, and the CPU's kernels for the two pools the models
// have, a row of windows at a time, 16 windows to an AVX-512 vector (one window to a lane):
// - 2x2 windows that tile the plane (stride 2, no padding: the CNN's pool). A row of windows is
//   two input rows; their even and odd columns, split apart by two shuffles, are each window's
//   four elements, so the rule runs as three compare-and-selects a vector. The element-wise path
//   took a window's elements one by one from stride-2 positions, keeping a value and an index
//   for each: 3.2-4.0x the time forward and 2.7-2.9x backward on the CNN's 20x20 planes
//   (bench/results/2026-11-29-cpu-max-pool-2x2.md).
// - 3x3 windows at stride 2 with padding 1 (a ResNet's pool after its stem). Window ox covers
//   columns 2ox-1, 2ox and 2ox+1 of up to three input rows: the even and odd columns of a row
//   are the middle and right elements, and the odd columns moved up one lane the left ones.
//   Columns and rows in the padding take no part, as in the element-wise path.
// In builds for AVX2, the 2x2 vectors (pairs of 8 lanes, the ends through the stack) measured
// slower than the element-wise path, so those builds keep it, for the 3x3 windows too (not
// timed there: AVX2 has no 16-lane masks for a row's ends either).
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

// Whether this build has the kernels (built for AVX-512 CPUs).
bool max_pool_rows_built();

// The maxima of the q windows whose rows are top and bottom (input rows 2oy and 2oy + 1), to
// out. Values only: which of equal elements won changes no bit of the output.
void max_pool_2x2_row(const float* top, const float* bottom, int64_t q, float* out);

// The gradient of those windows into the first 2q elements of dtop and dbottom: each window's
// winner (found again by the rule) gets +0 + grad (-0 becomes +0, as adding into a zeroed plane
// gives), the rest 0. Elements past 2q are not written.
void max_pool_2x2_row_grad(const float* top, const float* bottom, const float* grad, int64_t q,
                           float* dtop, float* dbottom);

// The winners of the q windows (3x3, stride 2, padding 1) of output row oy of an h x w plane:
// best[ox] the value and at[ox] its index in the plane, as the element-wise path gives them
// (-inf and -1 for a window wholly in the padding, which these sizes never make).
void max_pool_3x3_s2_row(const float* plane, int64_t h, int64_t w, int64_t oy, int64_t q,
                         float* best, int32_t* at);

}  // namespace replica::cpu
