// CPU batch normalisation on small planes (up to 4 positions: a ResNet's 2x2 and 1x1 stages at
// 28x28 input) with 8 channels at a time, one to each lane of a vector, in builds for AVX-512.
//
// engine/cpu/norm.cpp visits each channel's row of hw elements sample by sample and sums each
// channel in double in that fixed order, so results do not depend on the thread count. On rows
// of 4 elements and fewer, a row's loop, its constants and its sums' loads and stores cost more
// than its elements: about 2 cycles an element, and ResNet-101 at 28x28 spent 5% of its step in
// batch norm on 2x2 planes. Here a sample's rows of 8 channels (at most 32 floats) are two
// vectors; a permute picks one position of every channel into the lanes of a vector, where each
// lane runs its own channel's arithmetic in the element-wise loops' order, and the outputs are
// put back into rows by the inverse permute. So every output has the element-wise loops' bits
// (test_norm_lanes_cpu; REPLICA_NORM_LANES=0 runs those loops), given that neither fuses a
// multiply and an add (engine/CMakeLists.txt compiles both files so), except which NaN's payload
// an output carries where two NaNs meet: the compiler may order a sum's operands either way.
#pragma once
#include <cstdint>

namespace replica::cpu {

// [N, C, positions]: a tensor's samples, channels, and the positions of a channel's plane.
struct NchwDims {
  int64_t n, c, hw;
};

// Whether these passes take the tensor (planes of 1 to 4 positions, in a build for AVX-512).
bool norm_lanes_take(const NchwDims& d);

// For the channels [c0, c1) of x: sum[c] = the sum of the channel's elements.
void channel_sum(const float* x, const NchwDims& d, int64_t c0, int64_t c1, double* sum);

// sq[c] = the sum of (x - mean[c])^2 over the channel.
void channel_sum_sq_dev(const float* x, const NchwDims& d, int64_t c0, int64_t c1,
                        const double* mean, double* sq);

// y = x * scale[c] + shift[c] in float (scale and shift hold floats), plus residual (may be
// null), then max(that, 0) with relu.
void channel_scale_shift(const float* x, const float* residual, float* y, const NchwDims& d,
                         int64_t c0, int64_t c1, const double* scale, const double* shift,
                         bool relu);

// sum_dy[c] = the sum of g and sum_dy_xhat[c] that of g * (x - mean[c]) * invstd[c], where g is
// dy, or with relu_y (non-null) dy where relu_y is not <= 0 (NaN too) and +0 elsewhere
// (relu_backward's rule).
void channel_grad_sums(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                       int64_t c0, int64_t c1, const float* mean, const float* invstd,
                       double* sum_dy, double* sum_dy_xhat);

// dx = gamma[c] * invstd[c] / m * (m * g - sum_dy[c] - xhat * sum_dy_xhat[c]), with
// xhat = (x - mean[c]) * invstd[c], m = n * hw and g as above.
void channel_input_grad(const float* x, const float* dy, const float* relu_y, const NchwDims& d,
                        int64_t c0, int64_t c1, const float* mean, const float* invstd,
                        const float* gamma, const double* sum_dy, const double* sum_dy_xhat,
                        float* dx);

}  // namespace replica::cpu
