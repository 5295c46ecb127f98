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
#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

struct BnDims {
  int64_t n, c, hw;
  __host__ __device__ int64_t m() const { return n * hw; }  // values per channel
};

BnDims bn_dims(const Tensor& x, const char* op) {
  REPLICA_CHECK(x.ndim() >= 2 && x.ndim() <= 4,
                "{}: x {} must be [N, C], [N, C, L] or [N, C, H, W]", op, shape_str(x.shape()));
  int64_t hw = 1;
  for (int i = 2; i < x.ndim(); ++i) hw *= x.dim(i);
  return {x.dim(0), x.dim(1), hw};
}

// Slices per channel for the partial sums: about 8192 values each, at most 64, so that a
// channel's work spreads over several blocks when there are few channels (C = 64 at 112x112).
// Fixed by the shape alone: the sums' order, and so their bits, do not depend on the GPU.
int slices_for(const BnDims& d) {
  const int64_t s = (d.m() + 8191) / 8192;
  return int(s < 1 ? 1 : (s > 64 ? 64 : s));
}

// The gradient reaching the BatchNorm: dy, or with a fused ReLU dy where its output is > 0.
__device__ __forceinline__ float masked_grad(const float* dy, const float* relu_y, int64_t i) {
  return relu_y && !(relu_y[i] > 0.f) ? 0.f : dy[i];
}

// Block (c, s) of slices S: the sums over slice s of channel c's values, taken in n, then
// position order. Forward (dy null): x - K and (x - K)^2, K the channel's first value (a shift
// that keeps the one-pass variance exact in spirit, as the CPU's two passes are). Backward: g
// and g * xhat, with g the masked gradient and xhat = (x - mean) * invstd. Each thread walks its
// values with a running (image, position) pair: no division per value.
__global__ void bn_partials_kernel(const float* x, const float* dy, const float* relu_y,
                                   const float* mean, const float* invstd, BnDims d, int S,
                                   double* part_a, double* part_b) {
  __shared__ double sh[cuda::kThreads];
  const int64_t c = blockIdx.x / S, s = blockIdx.x % S;
  const int64_t per = (d.m() + S - 1) / S, j0 = s * per;
  const int64_t j1 = j0 + per < d.m() ? j0 + per : d.m();
  const double pivot = dy ? double(mean[c]) : double(x[c * d.hw]);
  const double is = dy ? double(invstd[c]) : 1.0;
  int64_t j = j0 + threadIdx.x, n = j / d.hw, p = j - n * d.hw;
  double a = 0, b = 0;
  for (; j < j1; j += blockDim.x) {
    const int64_t i = (n * d.c + c) * d.hw + p;
    if (!dy) {
      const double v = x[i] - pivot;
      a += v;
      b += v * v;
    } else {
      const float g = masked_grad(dy, relu_y, i);
      a += g;
      b += g * (x[i] - pivot) * is;
    }
    p += blockDim.x;  // the next element of this thread: blockDim.x further in (n, p) order
    if (p >= d.hw) {  // by division: for [N, C] input (hw = 1) a loop would step 256 times
      n += p / d.hw;
      p %= d.hw;
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

// The elementwise passes take a block per chunk of kChunk positions of one (image, channel)
// plane: the channel and its constants once per block, no division per element.
constexpr int64_t kChunk = 4 * cuda::kThreads;

struct PlaneChunk {
  int64_t c, base, p0, p1;  // channel; the plane's first index; positions [p0, p1)
  __device__ PlaneChunk(const BnDims& d) {
    const int64_t per = (d.hw + kChunk - 1) / kChunk, plane = blockIdx.x / per;
    c = plane % d.c;
    base = plane * d.hw;
    p0 = (blockIdx.x - plane * per) * kChunk;
    p1 = p0 + kChunk < d.hw ? p0 + kChunk : d.hw;
  }
};

unsigned chunk_blocks(const BnDims& d) {
  const int64_t blocks = d.n * d.c * ((d.hw + kChunk - 1) / kChunk);
  REPLICA_CHECK(blocks <= INT32_MAX, "batch norm: {} x {} x {} is too large", d.n, d.c, d.hw);
  return unsigned(blocks);
}

// y = x * scale[c] + shift[c], then max(., 0) with a fused ReLU (relu_forward's rule).
__global__ void bn_output_kernel(const float* x, float* y, const float* scale, const float* shift,
                                 BnDims d, bool relu) {
  const PlaneChunk at(d);
  const float sc = scale[at.c], sh = shift[at.c];
  for (int64_t p = at.p0 + threadIdx.x; p < at.p1; p += blockDim.x) {
    const float v = x[at.base + p] * sc + sh;
    y[at.base + p] = relu ? (v > 0.f ? v : 0.f) : v;
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
__global__ void bn_dx_kernel(const float* x, const float* dy, const float* relu_y,
                             const float* mean, const float* invstd, const double* sums,
                             BnDims d, float* dx) {
  const PlaneChunk at(d);
  const double m = double(d.m()), mu = mean[at.c], is = invstd[at.c];
  const double s_g = sums[3 * at.c], s_g_xhat = sums[3 * at.c + 1], k = sums[3 * at.c + 2];
  for (int64_t p = at.p0 + threadIdx.x; p < at.p1; p += blockDim.x) {
    const int64_t i = at.base + p;
    const double xhat = (x[i] - mu) * is;
    dx[i] = float(k * (m * double(masked_grad(dy, relu_y, i)) - s_g - xhat * s_g_xhat));
  }
}

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
  const unsigned chunks = chunk_blocks(d);  // checked before any launch updates running stats
  const int S = slices_for(d);
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
  bn_partials_kernel<<<unsigned(d.c * S), cuda::kThreads, 0, stream>>>(
      x.f32(), nullptr, nullptr, nullptr, nullptr, d, S, w.part_a, w.part_b);
  REPLICA_LAUNCH_CHECK();
  const TrainOut out{ptr_or_null(running_mean), ptr_or_null(running_var),
                     ptr_or_null(save_mean), ptr_or_null(save_invstd)};
  bn_train_stats_kernel<<<channel_blocks(d.c), cuda::kThreads, 0, stream>>>(
      x.f32(), w.part_a, w.part_b, S, d, ptr_or_null(gamma), ptr_or_null(beta), momentum, eps, out,
      w.scale, w.shift);
  REPLICA_LAUNCH_CHECK();
  bn_output_kernel<<<chunks, cuda::kThreads, 0, stream>>>(x.f32(), y.f32(), w.scale, w.shift, d,
                                                          relu);
  REPLICA_LAUNCH_CHECK();
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
  bn_output_kernel<<<chunk_blocks(d), cuda::kThreads, 0, stream>>>(x.f32(), y.f32(), w.scale,
                                                                     w.shift, d, relu);
  REPLICA_LAUNCH_CHECK();
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
  const unsigned chunks = chunk_blocks(d);  // checked before any launch adds into dgamma, dbeta
  const int S = slices_for(d);
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
  bn_partials_kernel<<<unsigned(d.c * S), cuda::kThreads, 0, stream>>>(
      x.f32(), dy.f32(), ptr_or_null(relu_y), save_mean.f32(), save_invstd.f32(), d, S,
      w.part_a, w.part_b);
  REPLICA_LAUNCH_CHECK();
  bn_grad_sums_kernel<<<channel_blocks(d.c), cuda::kThreads, 0, stream>>>(
      w.part_a, w.part_b, S, d, ptr_or_null(gamma), save_invstd.f32(), ptr_or_null(dgamma),
      ptr_or_null(dbeta), w.sums);
  REPLICA_LAUNCH_CHECK();
  if (!dx.defined()) return;
  bn_dx_kernel<<<chunks, cuda::kThreads, 0, stream>>>(
      x.f32(), dy.f32(), ptr_or_null(relu_y), save_mean.f32(), save_invstd.f32(), w.sums, d,
      dx.f32());
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
