// Batch normalisation's per-channel sums on AVX-512 CPUs, 8 channels at a time, one to each lane
// of a vector of doubles.
//
// engine/cpu/norm.cpp sums each channel in double in one fixed order, sample by sample and pixel
// by pixel, so that results do not depend on the thread count. Element by element that is a
// chain of a conversion and an add per element, plus a loop's overhead per row of hw elements:
// about 2 cycles an element, whatever the plane's size, and a ResNet at 28x28 spends 9% of its
// step there (most of it on 2x2 planes, where a row is 4 elements). Here each lane runs its own
// channel's chain in that same order, so the sums have the element-wise loops' bits; a gather
// reads one (sample, pixel) of 8 channels, hw floats apart.
#pragma once
#include <cstdint>

namespace replica::cpu {

// [N, C, positions]: a tensor's samples, channels, and the positions of a channel's plane.
struct NchwDims {
  int64_t n, c, hw;
};

// Whether this build has the lanes (built for AVX-512 CPUs; `hw` at most 2^28, so that 8 planes'
// offsets fit the gathers' 32-bit indices).
bool channel_sums_built();
bool channel_sums_take(const NchwDims& d);

// Over the channels [c0, c1) of x: sum[c] = the sum of the channel's elements.
void channel_sum(const float* x, const NchwDims& d, int64_t c0, int64_t c1, double* sum);

// sq[c] = the sum of (x - mean[c])^2 over the channel.
void channel_sum_sq_dev(const float* x, const NchwDims& d, int64_t c0, int64_t c1,
                        const double* mean, double* sq);

// sum_dy[c] = the sum of g and sum_dy_xhat[c] that of g * (x - mean[c]) * invstd[c], where g is
// dy, or with relu_y (non-null) dy where relu_y > 0 and +0 elsewhere (relu_backward's rule).
void channel_grad_sums(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                       int64_t c0, int64_t c1, const float* mean, const float* invstd,
                       double* sum_dy, double* sum_dy_xhat);

}  // namespace replica::cpu
