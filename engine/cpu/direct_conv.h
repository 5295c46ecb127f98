// The CPU's direct convolution: stride-1 layers with few output channels (the CNN's second
// layer: 5x5, 20 channels in and out) computed straight from the input planes, with no im2col
// columns.
//
// im2col + GEMM makes such a layer a thin product: M = k = 20 rows, against OpenBLAS's tiles of
// 32 and more, and the columns it multiplies are r*r = 25 copies of the input, written and read
// again once a sample (a quarter of the CNN's step went to im2col and col2im). Here each output
// row of the padded plane is computed "wide", across the whole padded width wi: output pixel
// t = oy*wi + ox reads input pixel t + i*wi + j through tap (i, j), so every tap is one shifted,
// contiguous run of the input plane, and a block of 5 output channels by 64 pixels stays in
// vector registers while the taps stream past. The columns ox >= q of the wide rows, and the
// last block's tail, are computed and dropped: 22% of the work on the CNN's 24x24 planes.
//
// Backward runs over the same wide rows of dy (zero in the dropped columns, and around each
// plane). The input gradient is gathered, as a forward-style correlation of dy with the kernel
// turned round: each input pixel sums what every tap that read it sent back, in registers, with
// no adds to memory. The weight gradient is one dot product per weight between dy's rows and
// the tap's shifted input run, over a pass of up to 4 samples, its lanes added in one fixed
// tree; per fixed chunk of samples and summed in order (engine/cpu/weight_chunks.h), so the
// bits do not depend on the thread count.
//
// The dropped columns add exact zeros only while every value is finite: an Inf in the input or
// the weights meets the zeros there (0 x Inf is NaN), and NaN reaches weight or input gradients
// im2col would have left finite. A run with an Inf has diverged either way (the training loop
// stops on a non-finite loss).
#pragma once
#include "engine/context.h"
#include "engine/conv_geometry.h"

namespace replica::cpu {

// Whether this build takes the direct path at all: built for AVX-512 CPUs (-march=native on
// one), not for AVX2 ones, where it was slower than im2col + GEMM.
bool direct_conv_built();

// Whether the direct path takes this layer, in a build that has it: stride 1, a kernel larger
// than 1x1, at most 32 output channels (GEMM tiles go to waste), at least 4 input channels and
// 100 output pixels a sample (where it was measured faster).
bool direct_conv_pays(const ConvGeometry& g);

// y = conv(x, w) + b (b may be null); y overwritten.
void direct_conv_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                         float* y, const ConvGeometry& g);

// dw += the weight gradient; dx (may be null) overwritten with the input gradient. The bias
// gradient is the caller's, as on the other paths.
void direct_conv_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, const ConvGeometry& g);

}  // namespace replica::cpu
