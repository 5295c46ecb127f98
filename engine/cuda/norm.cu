// CUDA backend: batch normalisation, own kernels with the CPU backend's per-channel formulas
// (engine/cpu/norm.cpp) and every per-channel sum in double, in an order fixed by the shape (so
// a run reproduces to the bit; the order is the GPU's own: slices, then a tree, and the
// variance one pass over values shifted by the channel's first, so not the CPU's bits). A ReLU
// that follows the BatchNorm (ResNet's) is fused: applied in the output pass, and in backward
// the gradient is masked where it is read. That saves the ReLU's own passes over the
// activation: on an H100 ResNet-50's 49 ReLUs (33 of them after a BatchNorm) took 7 ms of its
// 43 ms TF32 step at batch 64. cuDNN's batch norm fuses an activation only for NHWC
// half-precision tensors.
//
// Training forward: partial sums of x and x^2 per (channel, slice of the channel's N*HW
// values), one block each; a kernel per channel adds a channel's slices in order and derives
// the statistics, running averages and a scale and shift; a last pass writes y. Backward: the
// same for the sums of dy and dy * xhat, then dx. Inputs may be [N, C], [N, C, L] or
// [N, C, H, W]: the statistics are over every axis but C.
//
// Speed: these passes only move memory, so they are written to keep it moving. On an H200 the
// first version ran at about a quarter of the memory's bandwidth (ResNet-50 TF32, batch 64:
// 129 us per forward, 176 per backward, 16 of the step's 37 ms): one load in flight per thread,
// a 64-bit division per value where planes are small (7x7), and output blocks of one plane
// that left 80% of their threads idle at 7x7. Now every thread has four loads in flight before
// it adds, indices are split with FastDivmod (engine/cuda/index_math.h), and the output and dx
// passes are flat, a float4 per thread where a plane is a whole number of float4s.
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/index_math.h"

namespace replica {

namespace {

using cuda::FastDivmod;
using cuda::WideDivmod;

struct BnDims {
  int64_t n, c, hw;
  __host__ __device__ int64_t m() const { return n * hw; }  // values per channel
  int64_t numel() const { return n * c * hw; }
};

BnDims bn_dims(const Tensor& x, const char* op) {
  REPLICA_CHECK(x.ndim() >= 2 && x.ndim() <= 4,
                "{}: x {} must be [N, C], [N, C, L] or [N, C, H, W]", op, shape_str(x.shape()));
  int64_t hw = 1;
  for (int i = 2; i < x.ndim(); ++i) hw *= x.dim(i);
  return {x.dim(0), x.dim(1), hw};
}

// Slices per channel for the partial sums: about 4096 values each (four rounds of four loads
// per thread), at most 128, so that a channel's work spreads over several blocks when there
// are few channels (C = 64 at 112x112). Fixed by the shape alone: the sums' order, and so
// their bits, do not depend on the GPU.
int slices_for(const BnDims& d) {
  const int64_t s = (d.m() + 4095) / 4096;
  return int(s < 1 ? 1 : (s > 128 ? 128 : s));
}

constexpr int kUnroll = 4;  // loads each thread issues before it adds

// Where the flat passes find an element's channel: i = (n * C + c) * HW + p.
template <class Div>
struct BnIndex {
  using Index = typename Div::Index;
  Div by_hw, by_c;
  Index numel;
  __device__ __forceinline__ Index channel(Index i) const {
    const Index plane = by_hw.div(i);
    return plane - by_c.div(plane) * by_c.divisor();
  }
};

// The gradient reaching the BatchNorm: dy, or with a fused ReLU dy where its output is > 0.
// Both loads are issued unconditionally, so neither waits on the other.
__device__ __forceinline__ float masked_grad(float dy, float relu_y, bool masked) {
  return masked && !(relu_y > 0.f) ? 0.f : dy;
}

// Block (c, s) of slices S: the sums over slice s of channel c's values, taken in n, then
// position order. Forward: x - K and (x - K)^2, K the channel's first value (a shift that keeps
// the one-pass variance exact in spirit, as the CPU's two passes are). Backward: g and
// g * xhat, with g the masked gradient and xhat = (x - mean) * invstd. Each thread reads
// kUnroll values a block's width apart, then adds them in that order.
template <class Div, bool kBackward>
__global__ void bn_partials_kernel(const float* __restrict__ x, const float* __restrict__ dy,
                                   const float* __restrict__ relu_y, const float* mean,
                                   const float* invstd, BnDims d, Div by_hw, int S,
                                   double* part_a, double* part_b) {
  using Index = typename Div::Index;
  __shared__ double sh[cuda::kThreads];
  const int64_t c = blockIdx.x / S, s = blockIdx.x % S;
  const int64_t per = (d.m() + S - 1) / S, first = s * per;
  const Index j0 = Index(first), j1 = Index(first + per < d.m() ? first + per : d.m());
  const double pivot = kBackward ? double(mean[c]) : double(x[c * d.hw]);
  const double is = kBackward ? double(invstd[c]) : 1.0;
  const Index C = Index(d.c), hw = Index(d.hw), step = Index(blockDim.x);
  double a = 0, b = 0;
  for (Index j = j0 + threadIdx.x; j < j1; j += kUnroll * step) {
    float xv[kUnroll], gv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index ju = j + u * step;
      if (ju < j1) {
        Index p;
        const Index n = cuda::split(by_hw, ju, &p);
        const Index i = (n * C + Index(c)) * hw + p;
        xv[u] = x[i];
        if constexpr (kBackward) gv[u] = masked_grad(dy[i], relu_y ? relu_y[i] : 1.f, relu_y);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * step >= j1) break;
      if constexpr (kBackward) {
        a += gv[u];
        b += gv[u] * (xv[u] - pivot) * is;
      } else {
        const double v = xv[u] - pivot;
        a += v;
        b += v * v;
      }
    }
  }
  a = cuda::block_sum(a, sh);
  b = cuda::block_sum(b, sh);
  if (threadIdx.x == 0) {
    part_a[blockIdx.x] = a;
    part_b[blockIdx.x] = b;
  }
}

// Channel c's slices added in order.
__device__ __forceinline__ void channel_sums(const double* part_a, const double* part_b, int S,
                                             int64_t c, double* a, double* b) {
  *a = 0;
  *b = 0;
  for (int s = 0; s < S; ++s) {
    *a += part_a[c * S + s];
    *b += part_b[c * S + s];
  }
}

struct TrainOut {
  float *running_mean, *running_var, *save_mean, *save_invstd;  // null: not wanted (in pairs)
};

// Per channel: mean, biased variance, 1/sqrt(var + eps); the running averages (unbiased
// variance) and saved statistics where wanted; scale = gamma * invstd, shift = beta - mean *
// scale for the output pass (gamma, beta null: 1, 0).
__global__ void bn_train_stats_kernel(const float* x, const double* part_a, const double* part_b,
                                      int S, BnDims d, const float* gamma, const float* beta,
                                      float momentum, float eps, TrainOut out, float* scale,
                                      float* shift) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= d.c) return;
  double sum, sq;
  channel_sums(part_a, part_b, S, c, &sum, &sq);
  const double m = double(d.m()), shifted = sum / m, mu = x[c * d.hw] + shifted;
  const double var = fmax(sq / m - shifted * shifted, 0.0);
  const double invstd = 1.0 / sqrt(var + eps);
  if (out.save_mean) {
    out.save_mean[c] = float(mu);
    out.save_invstd[c] = float(invstd);
  }
  if (out.running_mean) {
    out.running_mean[c] = float((1.0 - momentum) * out.running_mean[c] + momentum * mu);
    const double unbiased = var * m / (m - 1);
    out.running_var[c] = float((1.0 - momentum) * out.running_var[c] + momentum * unbiased);
  }
  const double g = gamma ? gamma[c] : 1.0, b = beta ? beta[c] : 0.0;
  scale[c] = float(g * invstd);
  shift[c] = float(b - mu * g * invstd);
}

// Evaluation: scale and shift from the running statistics.
__global__ void bn_eval_coeffs_kernel(const float* running_mean, const float* running_var,
                                      const float* gamma, const float* beta, float eps, int64_t C,
                                      float* scale, float* shift) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const double invstd = 1.0 / sqrt(double(running_var[c]) + eps);
  const float g = gamma ? gamma[c] : 1.f, b = beta ? beta[c] : 0.f;
  scale[c] = float(g * invstd);
  shift[c] = float(b - running_mean[c] * g * invstd);
}

// The flat passes: a grid-stride loop over groups of kVec elements, which share a channel
// (kVec is 4 only where HW is a multiple of 4).
#define REPLICA_BN_GROUPS(g, at)                                                          \
  for (Index g = Index(blockIdx.x) * blockDim.x + threadIdx.x; g < (at).numel / kVec;    \
       g += Index(gridDim.x) * blockDim.x)

// y = x * scale[c] + shift[c], then max(., 0) with a fused ReLU (relu_forward's rule).
template <class Div, int kVec>
__global__ void bn_output_kernel(const float* x, float* y, const float* scale, const float* shift,
                                 BnIndex<Div> at, bool relu) {
  using Index = typename Div::Index;
  REPLICA_BN_GROUPS(g, at) {
    const Index c = at.channel(g * kVec);
    const float sc = scale[c], sh = shift[c];
    cuda::Pack<kVec> v;
    v.load(x, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float o = v.v[k] * sc + sh;
      v.v[k] = relu ? (o > 0.f ? o : 0.f) : o;
    }
    v.store(y, g);
  }
}

// Backward per channel: dgamma += sum(g * xhat), dbeta += sum(g) (where wanted); for the dx
// pass the two sums and k = gamma * invstd / m.
__global__ void bn_grad_sums_kernel(const double* part_a, const double* part_b, int S, BnDims d,
                                    const float* gamma, const float* invstd, float* dgamma,
                                    float* dbeta, double* sums) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= d.c) return;
  double s_g, s_g_xhat;
  channel_sums(part_a, part_b, S, c, &s_g, &s_g_xhat);
  if (dgamma) dgamma[c] += float(s_g_xhat);
  if (dbeta) dbeta[c] += float(s_g);
  sums[3 * c] = s_g;
  sums[3 * c + 1] = s_g_xhat;
  sums[3 * c + 2] = (gamma ? gamma[c] : 1.0) * double(invstd[c]) / double(d.m());
}

// dx = k * (m * g - sum(g) - xhat * sum(g * xhat)), in double as the CPU's.
template <class Div, int kVec>
__global__ void bn_dx_kernel(const float* x, const float* dy, const float* relu_y,
                             const float* mean,
                             const float* invstd, const double* sums, BnIndex<Div> at, double m,
                             float* dx) {
  using Index = typename Div::Index;
  REPLICA_BN_GROUPS(g, at) {
    const Index c = at.channel(g * kVec);
    const double mu = mean[c], is = invstd[c];
    const double s_g = sums[3 * c], s_g_xhat = sums[3 * c + 1], k = sums[3 * c + 2];
    cuda::Pack<kVec> xv, gv, rv;
    xv.load(x, g);
    gv.load(dy, g);
    if (relu_y) rv.load(relu_y, g);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const double xhat = (xv.v[e] - mu) * is;
      const float grad = masked_grad(gv.v[e], relu_y ? rv.v[e] : 1.f, relu_y);
      gv.v[e] = float(k * (m * double(grad) - s_g - xhat * s_g_xhat));
    }
    gv.store(dx, g);
  }
}

#undef REPLICA_BN_GROUPS

void expect_param(const DeviceContext& ctx, const Tensor& t, int64_t C, const char* op,
                  const char* what) {
  cuda::expect_device(ctx, t, op, what);
  cuda::expect_numel(t, C, op, what);
}

// An optional tensor's data (undefined: null, "not wanted").
float* ptr_or_null(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

unsigned channel_blocks(int64_t C) { return unsigned((C + cuda::kThreads - 1) / cuda::kThreads); }

// The scratch of one call: 2*C*S partial sums and 3*C per-channel values (doubles), then a
// scale and a shift per channel (floats).
struct BnScratch {
  double *part_a, *part_b, *sums;
  float *scale, *shift;
  BnScratch(float* base, int64_t C, int S) {
    part_a = reinterpret_cast<double*>(base);
    part_b = part_a + C * S;
    sums = part_b + C * S;
    scale = reinterpret_cast<float*>(sums + 3 * C);
    shift = scale + C;
  }
  static int64_t floats(int64_t C, int S) { return 4 * C * S + 6 * C + 2 * C; }
};

// Checked before any launch, so a refused shape changes no running statistic or gradient.
int checked_slices(const BnDims& d, const char* op) {
  const int S = slices_for(d);
  REPLICA_CHECK(d.c * S <= INT32_MAX, "{}: {} channels are too many for one launch", op, d.c);
  return S;
}

// The partial sums of slices S (forward: dy null).
template <bool kBackward>
void launch_partials(const BnDims& d, int S, const float* x, const float* dy, const float* relu_y,
                     const float* mean, const float* invstd, const BnScratch& w,
                     cudaStream_t stream) {
  const unsigned blocks = unsigned(d.c * S);
  if (cuda::fast_index(d.numel())) {
    bn_partials_kernel<FastDivmod, kBackward><<<blocks, cuda::kThreads, 0, stream>>>(
        x, dy, relu_y, mean, invstd, d, FastDivmod(d.hw), S, w.part_a, w.part_b);
  } else {
    bn_partials_kernel<WideDivmod, kBackward><<<blocks, cuda::kThreads, 0, stream>>>(
        x, dy, relu_y, mean, invstd, d, WideDivmod(d.hw), S, w.part_a, w.part_b);
  }
  REPLICA_LAUNCH_CHECK();
}

// Calls launch(index, width) for a flat pass over d's elements: the FastDivmod index where
// every index is below 2^31 (else WideDivmod), and width 4 (float4 loads and stores) where
// HW is a multiple of 4 and every pointer the pass touches is 16-byte aligned (else 1).
template <class F>
void with_flat_index(const BnDims& d, std::initializer_list<const void*> pointers, F&& launch) {
  const bool vec4 = d.hw % 4 == 0 && cuda::aligned16(pointers);
  const auto run = [&](auto at) {
    if (vec4)
      launch(at, std::integral_constant<int, 4>());
    else
      launch(at, std::integral_constant<int, 1>());
  };
  if (cuda::fast_index(d.numel()))
    run(BnIndex<FastDivmod>{FastDivmod(d.hw), FastDivmod(d.c), uint32_t(d.numel())});
  else
    run(BnIndex<WideDivmod>{WideDivmod(d.hw), WideDivmod(d.c), uint64_t(d.numel())});
}

// y = x * scale + shift per channel (then the fused ReLU).
void launch_output(const BnDims& d, const float* x, float* y, const float* scale,
                   const float* shift, bool relu, cudaStream_t stream) {
  with_flat_index(d, {x, y}, [&](auto at, auto width) {
    using Div = std::decay_t<decltype(at.by_hw)>;
    constexpr int kVec = decltype(width)::value;
    bn_output_kernel<Div, kVec><<<cuda::grid_for(d.numel() / kVec), cuda::kThreads, 0, stream>>>(
        x, y, scale, shift, at, relu);
  });
  REPLICA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::batchnorm_forward_train(DeviceContext& ctx, const Tensor& x,
                                          const Tensor& gamma, const Tensor& beta,
                                          Tensor& running_mean, Tensor& running_var,
                                          float momentum, float eps, Tensor& y,
                                          Tensor& save_mean, Tensor& save_invstd, bool relu) {
  const char* op = "batchnorm_forward_train";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  const BnDims d = bn_dims(x, op);
  const bool have_running = running_mean.defined() || running_var.defined();
  if (have_running) {
    expect_param(ctx, running_mean, d.c, op, "running_mean");
    expect_param(ctx, running_var, d.c, op, "running_var");
  }
  const bool have_save = save_mean.defined() || save_invstd.defined();
  if (have_save) {
    expect_param(ctx, save_mean, d.c, op, "save_mean");
    expect_param(ctx, save_invstd, d.c, op, "save_invstd");
  }
  if (gamma.defined()) expect_param(ctx, gamma, d.c, op, "gamma");
  if (beta.defined()) expect_param(ctx, beta, d.c, op, "beta");
  if (x.numel() == 0) return;
  REPLICA_CHECK(d.m() > 1,
                "{}: expected more than 1 value per channel when training, got input {}", op,
                shape_str(x.shape()));
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int S = checked_slices(d, op);
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
  launch_partials<false>(d, S, x.f32(), nullptr, nullptr, nullptr, nullptr, w, stream);
  const TrainOut out{ptr_or_null(running_mean), ptr_or_null(running_var),
                     ptr_or_null(save_mean), ptr_or_null(save_invstd)};
  bn_train_stats_kernel<<<channel_blocks(d.c), cuda::kThreads, 0, stream>>>(
      x.f32(), w.part_a, w.part_b, S, d, ptr_or_null(gamma), ptr_or_null(beta), momentum, eps, out,
      w.scale, w.shift);
  REPLICA_LAUNCH_CHECK();
  launch_output(d, x.f32(), y.f32(), w.scale, w.shift, relu, stream);
}

void CudaBackend::batchnorm_forward_eval(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                         const Tensor& beta, const Tensor& running_mean,
                                         const Tensor& running_var, float eps, Tensor& y,
                                         bool relu) {
  const char* op = "batchnorm_forward_eval";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  const BnDims d = bn_dims(x, op);
  expect_param(ctx, running_mean, d.c, op, "running_mean");
  expect_param(ctx, running_var, d.c, op, "running_var");
  if (gamma.defined()) expect_param(ctx, gamma, d.c, op, "gamma");
  if (beta.defined()) expect_param(ctx, beta, d.c, op, "beta");
  if (x.numel() == 0) return;
  const cudaStream_t stream = cuda_state(ctx).stream;
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, 1)), d.c, 1);
  bn_eval_coeffs_kernel<<<channel_blocks(d.c), cuda::kThreads, 0, stream>>>(
      running_mean.f32(), running_var.f32(), ptr_or_null(gamma), ptr_or_null(beta), eps, d.c,
      w.scale, w.shift);
  REPLICA_LAUNCH_CHECK();
  launch_output(d, x.f32(), y.f32(), w.scale, w.shift, relu, stream);
}

void CudaBackend::batchnorm_backward(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                     const Tensor& save_mean, const Tensor& save_invstd,
                                     const Tensor& dy, const Tensor& relu_y, Tensor& dx,
                                     Tensor& dgamma, Tensor& dbeta) {
  const char* op = "batchnorm_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, dy, op, "dy");
  cuda::expect_shape(dy, x.shape(), op, "dy");
  const BnDims d = bn_dims(x, op);
  expect_param(ctx, save_mean, d.c, op, "save_mean");
  expect_param(ctx, save_invstd, d.c, op, "save_invstd");
  if (gamma.defined()) expect_param(ctx, gamma, d.c, op, "gamma");
  if (relu_y.defined()) {
    cuda::expect_device(ctx, relu_y, op, "relu_y");
    cuda::expect_shape(relu_y, x.shape(), op, "relu_y");
  }
  if (dx.defined()) {
    cuda::expect_device(ctx, dx, op, "dx");
    cuda::expect_shape(dx, x.shape(), op, "dx");
  }
  if (dgamma.defined()) expect_param(ctx, dgamma, d.c, op, "dgamma");
  if (dbeta.defined()) expect_param(ctx, dbeta, d.c, op, "dbeta");
  if (x.numel() == 0) return;
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int S = checked_slices(d, op);
  const float* mask = ptr_or_null(relu_y);
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
  launch_partials<true>(d, S, x.f32(), dy.f32(), mask, save_mean.f32(), save_invstd.f32(), w,
                        stream);
  bn_grad_sums_kernel<<<channel_blocks(d.c), cuda::kThreads, 0, stream>>>(
      w.part_a, w.part_b, S, d, ptr_or_null(gamma), save_invstd.f32(), ptr_or_null(dgamma),
      ptr_or_null(dbeta), w.sums);
  REPLICA_LAUNCH_CHECK();
  if (!dx.defined()) return;
  const float *xp = x.f32(), *dyp = dy.f32(), *mean = save_mean.f32(), *is = save_invstd.f32();
  float* dxp = dx.f32();
  with_flat_index(d, {xp, dyp, mask, dxp}, [&](auto at, auto width) {
    using Div = std::decay_t<decltype(at.by_hw)>;
    constexpr int kVec = decltype(width)::value;
    bn_dx_kernel<Div, kVec><<<cuda::grid_for(d.numel() / kVec), cuda::kThreads, 0, stream>>>(
        xp, dyp, mask, mean, is, w.sums, at, double(d.m()), dxp);
  });
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
