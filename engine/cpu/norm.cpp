// CPU batch normalisation. Parallel over ranges of channels; every per-channel sum runs in
// double in one fixed order (sample by sample, then along each sample's row; see row_sums), so
// results are reproducible for any thread count and close to a double reference.
//
// Each range of channels is visited sample by sample: for one sample its channels' rows are one
// contiguous block, read in address order. Visiting channel by channel instead reads rows of
// hw floats scattered C*hw apart, and sums each channel in one dependent chain; in a ResNet's
// later stages (hw = 16, 4, 1 at 28x28 input) that was 1.5-3x slower for the same sums.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/norm_lanes.h"
#include "engine/env_switch.h"
#include "engine/error.h"

namespace replica {

namespace {

using cpu::NchwDims;

// [N, C], [N, C, L] or [N, C, H, W] (the op list's contract): the positions after C as one.
NchwDims nchw(const Tensor& x) {
  REPLICA_CHECK(x.ndim() >= 2 && x.ndim() <= 4, "expected NC, NCL or NCHW input, got {}",
                shape_str(x.shape()));
  const int64_t rows = x.dim(0) * x.dim(1);
  return {x.dim(0), x.dim(1), rows > 0 ? x.numel() / rows : 0};
}

// f(c0, c1) for ranges of channels in parallel, each range holding about kGrain elements; in
// lanes, whole groups of 8 channels (a range ending in a part-filled group wastes lanes). On rows
// of up to kShortRow positions the grain is an eighth of the channels at least (the ranges are
// the grain or up to half of it: 1,024 channels of 2x2 planes make 8 ranges of 128): the passes
// visit a range's rows sample by sample, and a range's rows of one sample lie side by side. At
// kGrain's share, 2 channels of 2x2 planes at batch 256 (32 bytes) or 4 of 4x4 (256 bytes), each
// sample's few rows were a load a channel stride away that the prefetchers did not follow.
// Longer rows timed no faster so (7x7 planes) or slower (56x56: fewer ranges to balance).
constexpr int64_t kShortRow = 16;

template <class F>
void for_channel_ranges(const NchwDims& d, bool lanes, F&& f) {
  const int64_t per_channel = std::max<int64_t>(d.n * d.hw, 1);
  int64_t channels = std::max<int64_t>(cpu::kGrain / per_channel, 1);
  if (d.hw <= kShortRow) channels = std::max(channels, d.c / 8);
  if (!lanes) return cpu::parallel_range(d.c, channels, f);
  const int64_t groups = (d.c + 7) / 8;
  cpu::parallel_range(groups, std::max<int64_t>(channels / 8, 1), [&](int64_t g0, int64_t g1) {
    f(8 * g0, std::min(8 * g1, d.c));
  });
}

// Whether the passes run 8 channels to a vector (engine/cpu/norm_lanes.h): planes of up to 4
// positions in AVX-512 builds, unless REPLICA_NORM_LANES=0.
bool in_lanes(const NchwDims& d) { return cpu::norm_lanes_take(d) && switches::kNormLanes.on(); }

// row(c, begin, end) for every row of channels [c0, c1), sample by sample: [begin, end) are the
// row's element indices in the tensor, so each channel's elements come in the order n, then
// pixel. The callers loop over a row with the channel's constants in locals: stores through a
// float* could otherwise change them, and every element would reload them.
template <class F>
void visit_by_sample(const NchwDims& d, int64_t c0, int64_t c1, F&& row) {
  for (int64_t n = 0; n < d.n; ++n)
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = (n * d.c + c) * d.hw;
      row(c, begin, begin + d.hw);
    }
}

// A row's sums are taken in kLanes running sums when it has at least kLanedRow positions:
// running sum j takes the row's terms j, j + kLanes, ...; the sums are folded in halves (sum j
// += sum j + 8, then + 4, + 2, + 1), then the tail is added in order. One running sum waits on
// each add in turn (about 5 cycles a term, conversion included): on a ResNet's large planes
// (56x56 down to 7x7) the statistics then took 90% of batch norm's time. Shorter rows keep one
// running sum: sums of different channels' rows overlap there, and norm_lanes.h's vectors must
// give the same bits.
constexpr int kLanes = 16;
constexpr int64_t kLanedRow = 2 * kLanes;

void fold_lanes(double (&lanes)[kLanes]) {
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int j = 0; j < half; ++j) lanes[j] += lanes[j + half];
}

// total += the sums of term(at), and total2 += those of term2(at), over a row [b, e), in the
// order above; row_sum for one sum (term2 null). The terms are template arguments, so each row's
// loop is compiled for its terms and vectorises.
template <class Term, class Term2>
void row_sums(int64_t b, int64_t e, Term&& term, Term2&& term2, double& total, double& total2) {
  constexpr bool kTwo = !std::is_same_v<std::decay_t<Term2>, std::nullptr_t>;
  int64_t at = b;
  if (e - b >= kLanedRow) {
    double lanes[kLanes] = {}, lanes2[kLanes] = {};
    for (; at + kLanes <= e; at += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        lanes[j] += term(at + j);
        if constexpr (kTwo) lanes2[j] += term2(at + j);
      }
    fold_lanes(lanes);
    total += lanes[0];
    if constexpr (kTwo) {
      fold_lanes(lanes2);
      total2 += lanes2[0];
    }
  }
  double sum = total, sum2 = total2;
  for (; at < e; ++at) {
    sum += term(at);
    if constexpr (kTwo) sum2 += term2(at);
  }
  total = sum;
  total2 = sum2;
}

template <class Term>
void row_sum(int64_t b, int64_t e, Term&& term, double& total) {
  double none = 0.0;
  row_sums(b, e, term, nullptr, total, none);
}

// Two doubles per channel for a call (sums, or a scale and a shift), from the device's caching
// allocator.
struct ChannelScratch {
  Tensor block;
  double* a;
  double* b;
  ChannelScratch(DeviceContext& ctx, int64_t channels)
      : block(ctx.alloc({4 * channels})),  // 2 * channels doubles
        a(static_cast<double*>(block.raw())),
        b(a + channels) {}
  void zero(int64_t c0, int64_t c1) {
    std::fill(a + c0, a + c1, 0.0);
    std::fill(b + c0, b + c1, 0.0);
  }
};

// y = x * scale[c] + shift[c] over channels [c0, c1), in float (scale and shift hold floats);
// with a residual rp, y + rp as add has it; with relu, relu_forward's rule on that;
// all in the same pass. The cases are template arguments, so no loop tests them per element.
template <bool kResidual, bool kRelu>
void scale_shift_rows(const NchwDims& d, int64_t c0, int64_t c1, const float* xp,
                      const float* rp, float* yp, const double* scale, const double* shift) {
  visit_by_sample(d, c0, c1, [&](int64_t c, int64_t b, int64_t e) {
    const float sc = float(scale[c]), sh = float(shift[c]);
    for (int64_t at = b; at < e; ++at) {
      float v = xp[at] * sc + sh;
      if constexpr (kResidual) v = v + rp[at];
      if constexpr (kRelu) v = relu_value(v);
      yp[at] = v;
    }
  });
}

void scale_shift(const NchwDims& d, int64_t c0, int64_t c1, const float* xp, const float* rp,
                 float* yp, const double* scale, const double* shift, bool relu, bool lanes) {
  if (lanes) return cpu::channel_scale_shift(xp, rp, yp, d, c0, c1, scale, shift, relu);
  const auto rows = rp ? (relu ? scale_shift_rows<true, true> : scale_shift_rows<true, false>)
                       : (relu ? scale_shift_rows<false, true> : scale_shift_rows<false, false>);
  rows(d, c0, c1, xp, rp, yp, scale, shift);
}

// The residual's data, checked against x (undefined: null).
const float* residual_data(const Tensor& residual, const Tensor& x, const char* op) {
  if (!residual.defined()) return nullptr;
  REPLICA_CHECK(residual.shape() == x.shape(), "{}: residual {} should be x's shape {}", op,
                shape_str(residual.shape()), shape_str(x.shape()));
  return residual.f32();
}

}  // namespace

void CpuBackend::batchnorm_forward_train(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                         const Tensor& beta, Tensor& running_mean,
                                         Tensor& running_var, float momentum, float eps,
                                         Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                                         const Tensor& residual, bool relu) {
  const NchwDims d = nchw(x);
  const int64_t m = d.n * d.hw;
  REPLICA_CHECK(m > 1, "BatchNorm in training mode needs more than one value per channel "
                       "(got input {}); use a larger batch", shape_str(x.shape()));
  const float* xp = x.f32();
  const float* rp = residual_data(residual, x, "batchnorm_forward_train");
  float* yp = y.f32();
  ChannelScratch sums(ctx, d.c);
  double* mean = sums.a;
  double* sq = sums.b;
  const bool lanes = in_lanes(d);
  for_channel_ranges(d, lanes, [&](int64_t c0, int64_t c1) {
    sums.zero(c0, c1);
    if (lanes) {
      cpu::channel_sum(xp, d, c0, c1, mean);
    } else {
      visit_by_sample(d, c0, c1, [&](int64_t c, int64_t b, int64_t e) {
        row_sum(b, e, [xp](int64_t at) { return double(xp[at]); }, mean[c]);
      });
    }
    for (int64_t c = c0; c < c1; ++c) mean[c] /= m;
    if (lanes) {
      cpu::channel_sum_sq_dev(xp, d, c0, c1, mean, sq);
    } else {
      visit_by_sample(d, c0, c1, [&](int64_t c, int64_t b, int64_t e) {
        const double mu = mean[c];
        auto sq_dev = [xp, mu](int64_t at) { return (xp[at] - mu) * (xp[at] - mu); };
        row_sum(b, e, sq_dev, sq[c]);
      });
    }
    // Per channel: the statistics, then y = x * scale + shift with scale and shift in float
    // (kept in the accumulators' place: scale in sq[c], shift in mean[c]).
    for (int64_t c = c0; c < c1; ++c) {
      const double mu = mean[c], var = sq[c] / m;
      const double invstd = 1.0 / std::sqrt(var + eps);
      save_mean.f32()[c] = float(mu);
      save_invstd.f32()[c] = float(invstd);
      float& rm = running_mean.f32()[c];
      float& rv = running_var.f32()[c];
      rm = float((1.0 - momentum) * rm + momentum * mu);
      rv = float((1.0 - momentum) * rv + momentum * var * m / (m - 1));
      sq[c] = float(gamma.f32()[c] * invstd);
      mean[c] = float(beta.f32()[c] - mu * gamma.f32()[c] * invstd);
    }
    scale_shift(d, c0, c1, xp, rp, yp, sq, mean, relu, lanes);
  });
}

void CpuBackend::batchnorm_forward_eval(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                        const Tensor& beta, const Tensor& running_mean,
                                        const Tensor& running_var, float eps, Tensor& y,
                                        const Tensor& residual, bool relu) {
  const NchwDims d = nchw(x);
  const float* xp = x.f32();
  const float* rp = residual_data(residual, x, "batchnorm_forward_eval");
  float* yp = y.f32();
  ChannelScratch affine(ctx, d.c);
  double* scale = affine.a;
  double* shift = affine.b;
  const bool lanes = in_lanes(d);
  for_channel_ranges(d, lanes, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const double invstd = 1.0 / std::sqrt(double(running_var.f32()[c]) + eps);
      scale[c] = float(gamma.f32()[c] * invstd);
      shift[c] = float(beta.f32()[c] - running_mean.f32()[c] * gamma.f32()[c] * invstd);
    }
    scale_shift(d, c0, c1, xp, rp, yp, scale, shift, relu, lanes);
  });
}

namespace {

// batchnorm_backward's work; Relu: the gradient is masked by the fused ReLU's output (relu_y).
// A template, so that the loops without the mask carry no test of it.
template <bool Relu>
void batchnorm_backward_impl(DeviceContext& ctx, const NchwDims& d, const float* xp,
                             const float* gp, const float* ryp, const float* meanp,
                             const float* invstdp, const float* gammap, float* dxp,
                             float* dgammap, float* dbetap) {
  const int64_t m = d.n * d.hw;
  // The gradient reaching the BatchNorm: dy, or dy where the fused ReLU's output is not <= 0
  // (NaN too), else +0 (relu_backward's rule). The sums in double in a fixed order kept these
  // loops scalar, and there `out > 0 ? dy : 0` became a branch, mispredicted on half the
  // elements (7x slower): the bits of dy are masked instead.
  auto grad = [gp, ryp](int64_t at) {
    if (!Relu) return gp[at];
    uint32_t bits;
    std::memcpy(&bits, gp + at, sizeof bits);
    bits &= 0u - uint32_t(relu_passes(ryp[at]));
    float g;
    std::memcpy(&g, &bits, sizeof g);
    return g;
  };
  ChannelScratch sums(ctx, d.c);
  double* sum_dy = sums.a;
  double* sum_dy_xhat = sums.b;
  const bool lanes = in_lanes(d);
  for_channel_ranges(d, lanes, [&](int64_t c0, int64_t c1) {
    sums.zero(c0, c1);
    if (lanes) {
      cpu::channel_grad_sums(xp, gp, ryp, d, c0, c1, meanp, invstdp, sum_dy, sum_dy_xhat);
    } else {
      visit_by_sample(d, c0, c1, [&](int64_t c, int64_t b, int64_t e) {
        const double mean = meanp[c], invstd = invstdp[c];
        auto dy_term = [&grad](int64_t at) { return double(grad(at)); };
        auto dy_xhat_term = [&grad, xp, mean, invstd](int64_t at) {
          return grad(at) * (xp[at] - mean) * invstd;
        };
        row_sums(b, e, dy_term, dy_xhat_term, sum_dy[c], sum_dy_xhat[c]);
      });
    }
    for (int64_t c = c0; c < c1; ++c) {
      dgammap[c] += float(sum_dy_xhat[c]);
      dbetap[c] += float(sum_dy[c]);
    }
    if (!dxp) return;
    // dx = gamma*invstd/m * (m*dy - sum(dy) - xhat*sum(dy*xhat))
    if (lanes) {
      return cpu::channel_input_grad(xp, gp, ryp, d, c0, c1, meanp, invstdp, gammap, sum_dy,
                                     sum_dy_xhat, dxp);
    }
    visit_by_sample(d, c0, c1, [&](int64_t c, int64_t b, int64_t e) {
      const double mean = meanp[c], invstd = invstdp[c];
      const double k = gammap[c] * invstd / m;
      const double s_dy = sum_dy[c], s_dy_xhat = sum_dy_xhat[c];
      for (int64_t at = b; at < e; ++at) {
        const double xhat = (xp[at] - mean) * invstd;
        dxp[at] = float(k * (m * double(grad(at)) - s_dy - xhat * s_dy_xhat));
      }
    });
  });
}

}  // namespace

void CpuBackend::batchnorm_backward(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                    const Tensor& save_mean, const Tensor& save_invstd,
                                    const Tensor& dy, const Tensor& relu_y, Tensor& dx,
                                    Tensor& dgamma, Tensor& dbeta) {
  const float* ryp = nullptr;
  if (relu_y.defined()) {
    cpu::expect_same_numel(relu_y, dy, "batchnorm_backward");
    ryp = relu_y.f32();
  }
  const auto impl = ryp ? batchnorm_backward_impl<true> : batchnorm_backward_impl<false>;
  impl(ctx, nchw(x), x.f32(), dy.f32(), ryp, save_mean.f32(), save_invstd.f32(), gamma.f32(),
       dx.defined() ? dx.f32() : nullptr, dgamma.f32(), dbeta.f32());
}

}  // namespace replica
