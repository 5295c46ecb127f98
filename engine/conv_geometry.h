// A 2-D convolution's sizes, as both backends' own convolution paths read them, and the plane
// matrix: a convolution whose input plane is smaller than its kernel, written as one matrix
// over whole planes.
//
// On a plane of h*w pixels, output pixel t and input pixel u meet through at most one kernel
// tap, so the convolution is a dense map from a sample's c*h*w inputs to its k*p*q outputs:
// M[(kk, t), (cc, u)] = w[kk][cc][tap(t, u)], or 0 where no tap joins them. A sample in NCHW is
// already a row of that product, so a batch is one GEMM, Y[n, k*pq] = X M^T, with no columns
// to build; backward is dX = dY M and dM = dY^T X, folded back onto the taps.
//
// It pays where h*w < r*r: im2col's GEMM (and an implicit-GEMM convolution) multiplies r*r taps
// per output pixel, most of them padding on such planes; M multiplies only the h*w pixels there
// are. A ResNet at 28x28 input (the seed recipe) runs its third stage on 2x2 planes (4 pixels
// against 9 taps: 2.25x fewer multiply-adds) and its fourth on 1x1 (9x fewer).
#pragma once
#include <cstdint>

#include "engine/host_device.h"
#include "engine/ops.h"
#include "engine/tensor.h"

namespace replica {

// x [n, c, h, w] convolved with w [k, c, r, r] (square kernels) into [n, k, p, q].
struct ConvGeometry {
  int64_t n, c, h, w, k, r, p, q;
  int stride, pad;
  REPLICA_HOST_DEVICE int64_t crr() const { return c * r * r; }
  REPLICA_HOST_DEVICE int64_t pq() const { return p * q; }
  REPLICA_HOST_DEVICE int64_t hw() const { return h * w; }
  REPLICA_HOST_DEVICE bool pointwise() const { return r == 1 && stride == 1 && pad == 0; }
};

// Checks x's and w's shapes against each other and the kernel against the padded input.
ConvGeometry conv_geometry(const Tensor& x, const Tensor& w, const Conv2dParams& prm);

// M's size cap (64 MB): 512 channels on 2x2 planes (a ResNet at 56x56 input) make 4M floats.
inline constexpr int64_t kMaxPlaneMatrixFloats = int64_t(1) << 24;

// Whether M costs fewer multiply-adds than the taps: per output channel, input channel and
// output pixel, hw a sample plus one write of M a call, against r*r a sample; and M fits the cap.
// Never for an empty product (no samples, channels or pixels): the other paths handle those.
inline bool plane_matrix_pays(const ConvGeometry& g) {
  if (g.n <= 0 || g.c <= 0 || g.k <= 0 || g.hw() <= 0) return false;
  return g.hw() * (g.n + 1) < g.r * g.r * g.n &&
         g.k * g.pq() * g.c * g.hw() <= kMaxPlaneMatrixFloats;
}

// The kernel tap (i*r + j) joining output pixel t to input pixel u, or -1: input row iy meets
// output row oy through kernel row iy - oy*stride + pad only, and columns alike.
REPLICA_HOST_DEVICE int plane_tap(const ConvGeometry& g, int64_t t, int64_t u) {
  const int64_t i = u / g.w - (t / g.q) * g.stride + g.pad;
  const int64_t j = u % g.w - (t % g.q) * g.stride + g.pad;
  return i >= 0 && i < g.r && j >= 0 && j < g.r ? int(i * g.r + j) : -1;
}

// Entry e of M (row-major [k*pq, c*hw]) for the weights w[k, c, r, r]: a GPU thread's work.
REPLICA_HOST_DEVICE float plane_matrix_entry(const float* w, const ConvGeometry& g, int64_t e) {
  const int64_t cols = g.c * g.hw(), row = e / cols, col = e % cols;
  const int tap = plane_tap(g, row % g.pq(), col % g.hw());
  return tap >= 0 ? w[(row / g.pq() * g.c + col / g.hw()) * g.r * g.r + tap] : 0.f;
}

// Weight e's gradient (w's layout [k, c, r, r]) from M's gradient dm: the sum of dm over the
// entries of e's tap, output pixel by output pixel (a fixed order): a GPU thread's work. Each
// output pixel meets through the tap the one input pixel plane_tap maps back to it, or none.
REPLICA_HOST_DEVICE float plane_matrix_weight_grad(const float* dm, const ConvGeometry& g,
                                                   int64_t e) {
  const int64_t rr = g.r * g.r, kk = e / (g.c * rr), cc = e / rr % g.c;
  const int64_t i = e % rr / g.r, j = e % g.r;
  float sum = 0.f;
  for (int64_t t = 0; t < g.pq(); ++t) {
    const int64_t iy = t / g.q * g.stride - g.pad + i, ix = t % g.q * g.stride - g.pad + j;
    if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
    const float* row = dm + (kk * g.pq() + t) * g.c * g.hw() + cc * g.hw();
    sum += row[iy * g.w + ix];
  }
  return sum;
}

}  // namespace replica
