// The CPU's plane matrix (engine/conv_geometry.h): a convolution on planes smaller than its
// kernel as one GEMM over the batch, M built from the weights through a table of taps, its
// gradient folded back onto them in pixel order. The GEMMs are cpu::parallel_sgemm's, whose
// blocks are fixed by the shape, so the bits are the same for any thread count.
#pragma once
#include "engine/context.h"
#include "engine/conv_geometry.h"

namespace replica::cpu {

// y = conv(x, w) + b (b may be null); y overwritten.
void plane_matrix_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                          float* y, const ConvGeometry& g);

// dw += the weight gradient; dx (may be null) overwritten with the input gradient. The bias
// gradient is the caller's, as on the other paths.
void plane_matrix_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                           float* dx, float* dw, const ConvGeometry& g);

}  // namespace replica::cpu
