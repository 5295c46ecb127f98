// The CPU's direct convolution: stride-1 layers with few output channels (the CNN's 5x5 layers,
// 20 channels in and out) computed straight from the input planes, with no im2col columns.
//
// im2col + GEMM makes such a layer a thin product: M = k = 20 rows, against OpenBLAS's tiles of
// 32 and more, and the columns it multiplies are r*r = 25 copies of the input, written and read
// again once a sample (a quarter of the CNN's step went to im2col and col2im). Here each output
// row of the padded plane is computed "wide", across the whole padded width: output pixel
// t = oy*wp + ox reads input pixel t + i*wp + j through tap (i, j), so every tap is one shifted,
// contiguous run of the input plane, and a block of 5 output channels by 4 vectors of pixels
// stays in registers while the taps stream past. The columns ox >= q of the wide rows are
// computed and dropped: (wp - q)/wp of the work, 17% on the CNN's 24x24 planes.
//
// Backward is the same kernel twice: the input gradient is the valid correlation of dy, padded
// by r-1, with the weights flipped and transposed; the weight gradient is one dot product per
// weight and sample between dy's wide rows and the tap's shifted input run, per fixed chunk of
// samples and summed in order, so the bits do not depend on the thread count.
#pragma once
#include "engine/context.h"
#include "engine/conv_geometry.h"

namespace replica::cpu {

// Whether the direct path takes this layer: stride 1, a kernel larger than 1x1, at most 32
// output channels (GEMM tiles go to waste), at least 4 input channels and 100 output pixels a
// sample (where it was measured faster).
bool direct_conv_pays(const ConvGeometry& g);

// y = conv(x, w) + b (b may be null); y overwritten.
void direct_conv_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                         float* y, const ConvGeometry& g);

// dw += the weight gradient; dx (may be null) overwritten with the input gradient. The bias
// gradient is the caller's, as on the other paths.
void direct_conv_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, const ConvGeometry& g);

}  // namespace replica::cpu
