// Convolutions whose input plane is smaller than their kernel, written as one matrix over whole
// planes. On a plane of h*w pixels, output pixel t and input pixel u meet through at most one
// kernel tap, so the convolution is a dense map from a sample's c*h*w inputs to its k*p*q
// outputs: M[(kk, t), (cc, u)] = w[kk][cc][tap(t, u)], or 0 where no tap joins them. A sample in
// NCHW is already a row of that product, so the whole batch is one GEMM, Y[n, k*pq] = X M^T,
// with no columns to build.
//
// It pays where h*w < r*r: im2col's GEMM multiplies r*r taps per output pixel, most of them
// padding on such planes; M multiplies only the h*w pixels there are. A ResNet at 28x28 input
// (the seed recipe) runs its third stage on 2x2 planes (4 pixels against 9 taps: 2.25x fewer
// multiply-adds) and its fourth on 1x1 (9x fewer).
#pragma once
#include <cstdint>

#include "engine/context.h"
#include "engine/cpu/im2col.h"

namespace replica::cpu {

// Whether the plane matrix costs fewer multiply-adds than im2col for this layer, counting the
// matrix's own building (once a forward, once a backward with the weight gradient's folding),
// and M fits in kMaxPlaneMatrixFloats.
bool use_plane_matrix(const ConvGeometry& g);

// y = conv(x, w) + b (b may be null); y overwritten.
void plane_matrix_forward(DeviceContext& ctx, const float* x, const float* w, const float* b,
                          float* y, const ConvGeometry& g);

// dw += the weight gradient; dx (may be null) overwritten with the input gradient. The bias
// gradient is the caller's, as on the other paths.
void plane_matrix_backward(DeviceContext& ctx, const float* x, const float* w, const float* dy,
                           float* dx, float* dw, const ConvGeometry& g);

}  // namespace replica::cpu
