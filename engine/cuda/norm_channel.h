// BatchNorm's per-channel arithmetic on CUDA devices, shared by its two ways through a tensor:
// - sliced (norm.cu): sums over slices of each channel, a kernel that adds a channel's slices
//   and derives its coefficients, then a pass over the elements: three kernels each way;
// - one block per channel (norm_block.cu), where a channel's values fit one slice (planes of
//   at most 4096 values a channel, channel_slices): the block adds them up, derives the
//   coefficients and writes the output or dx itself, one kernel each way. ResNet-101 on 28x28
//   inputs (the seed recipe) has 83 of its 104 BatchNorms so, at 4x4 and 2x2 positions, where
//   each pass moves a few MB and the GPU waits on launches as much as on memory.
// The formulas live here once, so for the same sums both ways give the same bits.
// Included by the CUDA backend's .cu files only.
#pragma once
#include <cmath>

#include "engine/cuda/channel_pass.h"

namespace replica {
namespace cuda {

struct TrainOut {
  float *running_mean, *running_var, *save_mean, *save_invstd;  // null: not wanted (in pairs)
};

// A training BatchNorm's output coefficients for channel c: y = x * scale + shift.
struct BnCoeffs {
  float scale, shift;
};

// Channel c's statistics from its sums over m values, sum(x - K) and sum((x - K)^2), K = first
// (the channel's first value): mean, biased variance, 1/sqrt(var + eps); where `write` (one
// thread per channel), the running averages (unbiased variance) and the saved statistics where
// wanted. gamma, beta null: 1, 0.
__device__ inline BnCoeffs bn_train_coeffs(double first, double sum, double sq, double m,
                                           int64_t c, const float* gamma, const float* beta,
                                           float momentum, float eps, const TrainOut& out,
                                           bool write) {
  const double shifted = sum / m, mu = first + shifted;
  const double var = fmax(sq / m - shifted * shifted, 0.0);
  const double invstd = 1.0 / sqrt(var + eps);
  if (write && out.save_mean) {
    out.save_mean[c] = float(mu);
    out.save_invstd[c] = float(invstd);
  }
  if (write && out.running_mean) {
    out.running_mean[c] = float((1.0 - momentum) * out.running_mean[c] + momentum * mu);
    const double unbiased = var * m / (m - 1);
    out.running_var[c] = float((1.0 - momentum) * out.running_var[c] + momentum * unbiased);
  }
  const double g = gamma ? gamma[c] : 1.0, b = beta ? beta[c] : 0.0;
  return {float(g * invstd), float(b - mu * g * invstd)};
}

// One channel's part of dx = k * (m * g - sum(g) - xhat * sum(g * xhat)), in double as the
// CPU's, with k = gamma * invstd / m: its statistics and gradient sums, and the formula every
// dx pass applies.
struct BnDxChannel {
  double mu, is, s_g, s_g_xhat, k;
  // dx of one element: x, its incoming gradient dy and (masked) the BatchNorm's output.
  __device__ float dx(float x, float dy, float relu_y, bool masked, double m) const {
    const double xhat = (x - mu) * is;
    const float grad = masked_grad(dy, relu_y, masked);
    return float(k * (m * double(grad) - s_g - xhat * s_g_xhat));
  }
};

// Channel c's backward from its sums over m values, sum(g) and sum(g * xhat): where `write`
// (one thread per channel), dgamma += sum(g * xhat) and dbeta += sum(g) where wanted; and the
// channel's dx values.
__device__ inline BnDxChannel bn_grad_channel(double s_g, double s_g_xhat, double m, int64_t c,
                                              const float* gamma, const float* mean,
                                              const float* invstd, float* dgamma, float* dbeta,
                                              bool write) {
  if (write && dgamma) dgamma[c] += float(s_g_xhat);
  if (write && dbeta) dbeta[c] += float(s_g);
  const double k = (gamma ? gamma[c] : 1.0) * double(invstd[c]) / m;
  return {mean[c], invstd[c], s_g, s_g_xhat, k};
}

// A training BatchNorm forward (batchnorm_forward_train's contract) of d (one_block_channels)
// in one kernel: y = x * scale + shift (+ residual, then ReLU where relu), the statistics as
// bn_train_coeffs writes them. x may be y.
template <class T>
void bn_forward_one_block(const ChannelDims& d, const T* x, T* y, const T* residual, bool relu,
                          const float* gamma, const float* beta, float momentum, float eps,
                          const TrainOut& out, cudaStream_t stream);

// A BatchNorm backward (batchnorm_backward's contract) of d (one_block_channels) in one kernel:
// dgamma, dbeta added to where wanted, dx written where dx is not null. relu_y: the fused
// ReLU's output, or null.
template <class T>
void bn_backward_one_block(const ChannelDims& d, const T* x, const T* dy, const T* relu_y,
                           const float* gamma, const float* mean, const float* invstd,
                           float* dgamma, float* dbeta, T* dx, cudaStream_t stream);

}  // namespace cuda
}  // namespace replica
