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
// The sums and the output pass are the shared per-channel passes of channel_pass.h (which says
// how they keep the memory busy); the dx pass is here, flat in the same way, or a row pass
// (channel_pass.h) where channels lie side by side in rows. Where a channel's values fit one
// slice, a block per channel does all three steps in one kernel (norm_block.cu); the formulas
// both ways share are in norm_channel.h. Activations may be
// BF16 (bf16 storage, engine/bf16_storage.h): read widened, computed as for F32, stored
// rounded, so BatchNorm moves half the bytes; statistics and parameters stay F32. Or
// channels_last (engine/tensor.h): the same passes over [N*H*W, C] rows (bn_dims).
#include "engine/cuda/norm_channel.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

using cuda::ChannelDims;
using cuda::ChannelSum;

// x's channels (channel_dims: rows for a channels_last x, whose op's other 4-D tensors share
// its layout, Backend::layouts).
ChannelDims bn_dims(const Tensor& x, const char* op) {
  REPLICA_CHECK(x.ndim() >= 2 && x.ndim() <= 4,
                "{}: x {} must be [N, C], [N, C, L] or [N, C, H, W]", op, shape_str(x.shape()));
  return cuda::channel_dims(x);
}

using cuda::TrainOut;

// Per channel: the coefficients of the output pass, and the statistics (bn_train_coeffs).
template <class T>
__global__ void bn_train_stats_kernel(const T* x, const double* part_a, const double* part_b,
                                      int S, ChannelDims d, const float* gamma, const float* beta,
                                      float momentum, float eps, TrainOut out, float* scale,
                                      float* shift) {
  REPLICA_CHANNEL_WARPS(c, d.c) {
    double sum, sq;
    cuda::channel_sums(part_a, part_b, S, c, &sum, &sq);
    if (threadIdx.x % 32 != 0) continue;
    const cuda::BnCoeffs k = cuda::bn_train_coeffs(widen(x[c * d.hw]), sum, sq, double(d.m()), c,
                                                   gamma, beta, momentum, eps, out, true);
    scale[c] = k.scale;
    shift[c] = k.shift;
  }
}

// Evaluation: scale and shift from the running statistics.
__global__ void bn_eval_coeffs_kernel(const float* running_mean, const float* running_var,
                                      const float* gamma, const float* beta, float eps, int64_t C,
                                      float* scale, float* shift) {
  REPLICA_GRID_STRIDE(c, C) {
    const double invstd = 1.0 / sqrt(double(running_var[c]) + eps);
    const float g = gamma ? gamma[c] : 1.f, b = beta ? beta[c] : 0.f;
    scale[c] = float(g * invstd);
    shift[c] = float(b - running_mean[c] * g * invstd);
  }
}

// Backward per channel: dgamma and dbeta (bn_grad_channel); for the dx pass the two sums and
// k, each an array of C (sums, then k): a warp's loads of one of them for channels side by side
// then use every byte of the lines they touch.
__global__ void bn_grad_sums_kernel(const double* part_a, const double* part_b, int S,
                                    ChannelDims d, const float* gamma, const float* mean,
                                    const float* invstd, float* dgamma, float* dbeta,
                                    double* sums) {
  REPLICA_CHANNEL_WARPS(c, d.c) {
    double s_g, s_g_xhat;
    cuda::channel_sums(part_a, part_b, S, c, &s_g, &s_g_xhat);
    if (threadIdx.x % 32 != 0) continue;
    const cuda::BnDxChannel ch = cuda::bn_grad_channel(s_g, s_g_xhat, double(d.m()), c, gamma,
                                                       mean, invstd, dgamma, dbeta, true);
    sums[c] = ch.s_g;
    sums[d.c + c] = ch.s_g_xhat;
    sums[2 * d.c + c] = ch.k;
  }
}

// Channel c's dx values as bn_grad_sums_kernel left them, for the dx passes.
__device__ __forceinline__ cuda::BnDxChannel dx_channel(const float* mean, const float* invstd,
                                                        const double* sums, int64_t C,
                                                        int64_t c) {
  return {mean[c], invstd[c], sums[c], sums[C + c], sums[2 * C + c]};
}

template <class At, int kVec, class T>
__global__ void bn_dx_kernel(const T* x, const T* dy, const T* relu_y, const float* mean,
                             const float* invstd, const double* sums, int64_t C, At at, double m,
                             T* dx) {
  using Index = typename At::Index;
  REPLICA_CHANNEL_GROUPS(g, at) {
    const cuda::BnDxChannel ch = dx_channel(mean, invstd, sums, C, at.channel(g * kVec));
    cuda::Pack<kVec> xv, gv, rv;
    xv.load(x, g);
    gv.load(dy, g);
    if (relu_y) rv.load(relu_y, g);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      gv.v[e] = ch.dx(xv.v[e], gv.v[e], relu_y ? rv.v[e] : 1.f, relu_y, m);
    gv.store(dx, g);
  }
}

// The same dx over rows of channels (hw = 1: NHWC as [N*H*W, C], or [N, C]), a row pass
// (channel_pass.h): each thread reads its channels' five values once, where the flat pass read
// them for every element (ResNet-50 bf16 at batch 256 on an H200: 1.9 TB/s over NHWC
// activations, against 4.0 over the stem's NCHW one, whose groups share a channel).
template <int kPer, class T>
__global__ void bn_dx_rows_kernel(const T* x, const T* dy, const T* relu_y, const float* mean,
                                  const float* invstd, const double* sums, ChannelDims d, int S,
                                  int64_t per, T* dx) {
  const cuda::RowSlice<kPer> rows(d, S, per);
  if (rows.c0 >= d.c) return;
  const double m = double(d.m());
  cuda::BnDxChannel ch[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) ch[e] = dx_channel(mean, invstd, sums, d.c, rows.c0 + e);
  for (int64_t r = rows.first(); r < rows.r1; r += rows.kStep) {
    float xv[cuda::kUnroll][kPer], gv[cuda::kUnroll][kPer], rv[cuda::kUnroll][kPer];
#pragma unroll
    for (int u = 0; u < cuda::kUnroll; ++u) {
      const int64_t ru = r + u * cuda::kRowWarps;
      if (ru >= rows.r1) break;
      const int64_t i = ru * d.c + rows.c0;
      cuda::load_adjacent<kPer>(x, i, xv[u]);
      cuda::load_adjacent<kPer>(dy, i, gv[u]);
      if (relu_y) cuda::load_adjacent<kPer>(relu_y, i, rv[u]);
    }
#pragma unroll
    for (int u = 0; u < cuda::kUnroll; ++u) {
      const int64_t ru = r + u * cuda::kRowWarps;
      if (ru >= rows.r1) break;
      float out[kPer];
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        out[e] = ch[e].dx(xv[u][e], gv[u][e], relu_y ? rv[u][e] : 1.f, relu_y, m);
      cuda::store_adjacent<kPer>(dx, ru * d.c + rows.c0, out);
    }
  }
}

void expect_param(const DeviceContext& ctx, const Tensor& t, int64_t C, const char* op,
                  const char* what) {
  cuda::expect_device(ctx, t, op, what);
  cuda::expect_numel(t, C, op, what);
}

// An optional tensor of x's shape on ctx's device (undefined: not given).
void expect_optional_like(const DeviceContext& ctx, const Tensor& t, const Tensor& x,
                          const char* op, const char* what) {
  if (!t.defined()) return;
  cuda::expect_device(ctx, t, op, what);
  cuda::expect_shape(t, x.shape(), op, what);
}

// The scratch of one call: 2*C*S partial sums and 3*C per-channel values (doubles), then a
// scale and a shift per channel (floats).
struct BnScratch {
  double *part_a, *part_b, *sums;
  float *scale, *shift;
  Tensor held;  // the block, held while the op enqueues its kernels
  BnScratch(Tensor block, int64_t C, int S) : held(std::move(block)) {
    part_a = reinterpret_cast<double*>(held.f32());
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
                                          Tensor& save_mean, Tensor& save_invstd,
                                          const Tensor& residual, bool relu) {
  const char* op = "batchnorm_forward_train";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  expect_optional_like(ctx, residual, x, op, "residual");
  const ChannelDims d = bn_dims(x, op);
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
  const DType dt = cuda::activations_dtype(op, {&x, &y, &residual});
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int S = cuda::channel_slices(d, op);
  const TrainOut out{elements<float>(running_mean), elements<float>(running_var),
                     elements<float>(save_mean), elements<float>(save_invstd)};
  with_storage(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = elements<T>(x);
    if (cuda::one_block_channels(d, S)) {
      op_part(ctx, cuda::kNormOneBlockPart, [&] {
        cuda::bn_forward_one_block<T>(d, xp, elements<T>(y), elements<T>(residual), relu,
                                      elements<float>(gamma), elements<float>(beta), momentum,
                                      eps, out, stream);
      });
      return;
    }
    BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
    cuda::channel_partials<T>(ChannelSum::Moments, d, S, xp, nullptr, nullptr, nullptr, nullptr,
                              w.part_a, w.part_b, stream);
    bn_train_stats_kernel<T><<<cuda::grid_for(d.c * 32), cuda::kThreads, 0, stream>>>(
        xp, w.part_a, w.part_b, S, d, elements<float>(gamma), elements<float>(beta), momentum,
        eps, out, w.scale, w.shift);
    REPLICA_LAUNCH_CHECK();
    cuda::channel_affine<T>(d, xp, elements<T>(y), w.scale, w.shift, elements<T>(residual),
                            relu, stream);
  });
}

void CudaBackend::batchnorm_forward_eval(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                         const Tensor& beta, const Tensor& running_mean,
                                         const Tensor& running_var, float eps, Tensor& y,
                                         const Tensor& residual, bool relu) {
  const char* op = "batchnorm_forward_eval";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  expect_optional_like(ctx, residual, x, op, "residual");
  const ChannelDims d = bn_dims(x, op);
  expect_param(ctx, running_mean, d.c, op, "running_mean");
  expect_param(ctx, running_var, d.c, op, "running_var");
  if (gamma.defined()) expect_param(ctx, gamma, d.c, op, "gamma");
  if (beta.defined()) expect_param(ctx, beta, d.c, op, "beta");
  if (x.numel() == 0) return;
  const DType dt = cuda::activations_dtype(op, {&x, &y, &residual});
  const cudaStream_t stream = cuda_state(ctx).stream;
  BnScratch w(scratch(ctx, BnScratch::floats(d.c, 1)), d.c, 1);
  bn_eval_coeffs_kernel<<<cuda::grid_for(d.c), cuda::kThreads, 0, stream>>>(
      running_mean.f32(), running_var.f32(), elements<float>(gamma), elements<float>(beta), eps,
      d.c, w.scale, w.shift);
  REPLICA_LAUNCH_CHECK();
  with_storage(dt, [&](auto tag) {
    using T = decltype(tag);
    cuda::channel_affine<T>(d, elements<T>(x), elements<T>(y), w.scale, w.shift,
                            elements<T>(residual), relu, stream);
  });
}

void CudaBackend::batchnorm_backward(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                     const Tensor& save_mean, const Tensor& save_invstd,
                                     const Tensor& dy, const Tensor& relu_y, Tensor& dx,
                                     Tensor& dgamma, Tensor& dbeta) {
  const char* op = "batchnorm_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, dy, op, "dy");
  cuda::expect_shape(dy, x.shape(), op, "dy");
  const ChannelDims d = bn_dims(x, op);
  expect_param(ctx, save_mean, d.c, op, "save_mean");
  expect_param(ctx, save_invstd, d.c, op, "save_invstd");
  if (gamma.defined()) expect_param(ctx, gamma, d.c, op, "gamma");
  expect_optional_like(ctx, relu_y, x, op, "relu_y");
  expect_optional_like(ctx, dx, x, op, "dx");
  if (dgamma.defined()) expect_param(ctx, dgamma, d.c, op, "dgamma");
  if (dbeta.defined()) expect_param(ctx, dbeta, d.c, op, "dbeta");
  if (x.numel() == 0) return;
  const DType dt = cuda::activations_dtype(op, {&x, &dy, &relu_y, &dx});
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int S = cuda::channel_slices(d, op);
  const float *mean = save_mean.f32(), *is = save_invstd.f32();
  with_storage(dt, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = elements<T>(x), *dyp = elements<T>(dy), *mask = elements<T>(relu_y);
    T* dxp = elements<T>(dx);
    if (cuda::one_block_channels(d, S)) {
      op_part(ctx, cuda::kNormOneBlockPart, [&] {
        cuda::bn_backward_one_block<T>(d, xp, dyp, mask, elements<float>(gamma), mean, is,
                                       elements<float>(dgamma), elements<float>(dbeta), dxp,
                                       stream);
      });
      return;
    }
    BnScratch w(scratch(ctx, BnScratch::floats(d.c, S)), d.c, S);
    cuda::channel_partials<T>(ChannelSum::GradMoments, d, S, xp, dyp, mask, mean, is, w.part_a,
                              w.part_b, stream);
    bn_grad_sums_kernel<<<cuda::grid_for(d.c * 32), cuda::kThreads, 0, stream>>>(
        w.part_a, w.part_b, S, d, elements<float>(gamma), mean, is, elements<float>(dgamma),
        elements<float>(dbeta), w.sums);
    REPLICA_LAUNCH_CHECK();
    if (!dxp) return;
    if (d.hw == 1) {
      cuda::with_row_blocks(d, 0, {xp, dyp, mask, dxp}, [&](auto width, const cuda::RowGrid& g) {
        bn_dx_rows_kernel<decltype(width)::value, T>
            <<<g.blocks, dim3(32, cuda::kRowWarps), 0, stream>>>(xp, dyp, mask, mean, is, w.sums,
                                                                 d, g.S, g.per, dxp);
      });
      REPLICA_LAUNCH_CHECK();
      return;
    }
    cuda::with_channel_index(d, {xp, dyp, mask, dxp}, [&](auto at, auto width) {
      constexpr int kVec = decltype(width)::value;
      bn_dx_kernel<decltype(at), kVec, T>
          <<<cuda::grid_for(d.numel() / kVec), cuda::kThreads, 0, stream>>>(
              xp, dyp, mask, mean, is, w.sums, d.c, at, double(d.m()), dxp);
    });
    REPLICA_LAUNCH_CHECK();
  });
}

}  // namespace replica
