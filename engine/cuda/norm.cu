// CUDA backend: batch normalisation through cuDNN (CUDNN_BATCHNORM_SPATIAL: statistics over
// N, H, W per channel), as PyTorch's cuDNN path does:
//  - exponentialAverageFactor = momentum: running = (1 - m) running + m batch_stat, with the
//    running variance stored unbiased (cuDNN applies the n/(n-1) factor);
//  - resultSaveInvVariance is 1/sqrt(biased var + eps), i.e. the save_invstd of ops.h;
//  - backward uses the saved mean/invstd (epsilon is then not used to recompute them), writes dx
//    (betaDataDiff = 0) and accumulates dgamma/dbeta (betaParamDiff = 1).
// Inputs may be [N, C] (BatchNorm1d), [N, C, L] or [N, C, H, W]; they are described to cuDNN as
// [N, C, H*W..., 1], which gives the same per-channel statistics.
#include <utility>

#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

// Owns one cuDNN tensor descriptor.
class TensorDesc {
 public:
  TensorDesc() { REPLICA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d_)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  cudnnTensorDescriptor_t get() const { return d_; }

 private:
  cudnnTensorDescriptor_t d_ = nullptr;
};

struct BnShape {
  int64_t N = 0, C = 0, HW = 0;
};

BnShape bn_shape(const Tensor& x, const char* op) {
  REPLICA_CHECK(x.ndim() >= 2 && x.ndim() <= 4, "{}: x {} must be [N, C], [N, C, L] or [N, C, H, W]",
                op, shape_str(x.shape()));
  BnShape s;
  s.N = x.dim(0);
  s.C = x.dim(1);
  s.HW = 1;
  for (int i = 2; i < x.ndim(); ++i) s.HW *= x.dim(i);
  REPLICA_CHECK(s.N <= INT32_MAX && s.C <= INT32_MAX && s.HW <= INT32_MAX,
                "{}: x {} is too large for cuDNN", op, shape_str(x.shape()));
  return s;
}

// x/y described as [N, C, HW, 1]; the parameter descriptor derived by cuDNN ([1, C, 1, 1]).
void describe(const BnShape& s, TensorDesc& xd, TensorDesc& pd) {
  REPLICA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(xd.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                                 static_cast<int>(s.N), static_cast<int>(s.C),
                                                 static_cast<int>(s.HW), 1));
  REPLICA_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(pd.get(), xd.get(), CUDNN_BATCHNORM_SPATIAL));
}

void expect_param(const DeviceContext& ctx, const Tensor& t, int64_t C, const char* op,
                  const char* what) {
  cuda::expect_device(ctx, t, op, what);
  cuda::expect_numel(t, C, op, what);
}

// cuDNN needs both affine parameters: undefined ones become gamma = 1 / beta = 0 in scratch
// (2C floats, taken only when needed).
template <class Scratch>
std::pair<const float*, const float*> affine_or_default(const Tensor& gamma, const Tensor& beta,
                                                        int64_t C, cudaStream_t stream,
                                                        Scratch&& scratch) {
  const float* g = gamma.defined() ? gamma.f32() : nullptr;
  const float* b = beta.defined() ? beta.f32() : nullptr;
  if (!g || !b) {
    float* tmp = scratch();
    if (!g) {
      cuda::fill_async(tmp, C, 1.f, stream);
      g = tmp;
    }
    if (!b) {
      cuda::fill_async(tmp + C, C, 0.f, stream);
      b = tmp + C;
    }
  }
  return {g, b};
}

}  // namespace

void CudaBackend::batchnorm_forward_train(DeviceContext& ctx, const Tensor& x,
                                          const Tensor& gamma, const Tensor& beta,
                                          Tensor& running_mean, Tensor& running_var,
                                          float momentum, float eps, Tensor& y,
                                          Tensor& save_mean, Tensor& save_invstd) {
  const char* op = "batchnorm_forward_train";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  const BnShape sh = bn_shape(x, op);
  const bool have_running = running_mean.defined() || running_var.defined();
  if (have_running) {
    expect_param(ctx, running_mean, sh.C, op, "running_mean");
    expect_param(ctx, running_var, sh.C, op, "running_var");
  }
  const bool have_save = save_mean.defined() || save_invstd.defined();
  if (have_save) {
    expect_param(ctx, save_mean, sh.C, op, "save_mean");
    expect_param(ctx, save_invstd, sh.C, op, "save_invstd");
  }
  if (gamma.defined()) expect_param(ctx, gamma, sh.C, op, "gamma");
  if (beta.defined()) expect_param(ctx, beta, sh.C, op, "beta");
  REPLICA_CHECK(eps >= CUDNN_BN_MIN_EPSILON, "{}: eps {} is below cuDNN's minimum {}", op, eps,
                CUDNN_BN_MIN_EPSILON);
  if (x.numel() == 0) return;
  REPLICA_CHECK(sh.N * sh.HW > 1,
                "{}: expected more than 1 value per channel when training, got input {}", op,
                shape_str(x.shape()));
  CudaState& s = cuda_state(ctx);

  const auto [g, b] =
      affine_or_default(gamma, beta, sh.C, s.stream, [&] { return scratch(ctx, 2 * sh.C); });
  TensorDesc xd, pd;
  describe(sh, xd, pd);
  const float one = 1.f, zero = 0.f;
  REPLICA_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
      s.cudnn, CUDNN_BATCHNORM_SPATIAL, &one, &zero, xd.get(), x.f32(), xd.get(), y.f32(),
      pd.get(), g, b, static_cast<double>(momentum),
      have_running ? running_mean.f32() : nullptr, have_running ? running_var.f32() : nullptr,
      static_cast<double>(eps), have_save ? save_mean.f32() : nullptr,
      have_save ? save_invstd.f32() : nullptr));
}

void CudaBackend::batchnorm_forward_eval(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                         const Tensor& beta, const Tensor& running_mean,
                                         const Tensor& running_var, float eps, Tensor& y) {
  const char* op = "batchnorm_forward_eval";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, y, op, "y");
  cuda::expect_shape(y, x.shape(), op, "y");
  const BnShape sh = bn_shape(x, op);
  expect_param(ctx, running_mean, sh.C, op, "running_mean");
  expect_param(ctx, running_var, sh.C, op, "running_var");
  if (gamma.defined()) expect_param(ctx, gamma, sh.C, op, "gamma");
  if (beta.defined()) expect_param(ctx, beta, sh.C, op, "beta");
  REPLICA_CHECK(eps >= CUDNN_BN_MIN_EPSILON, "{}: eps {} is below cuDNN's minimum {}", op, eps,
                CUDNN_BN_MIN_EPSILON);
  if (x.numel() == 0) return;
  CudaState& s = cuda_state(ctx);
  const auto [g, b] =
      affine_or_default(gamma, beta, sh.C, s.stream, [&] { return scratch(ctx, 2 * sh.C); });
  TensorDesc xd, pd;
  describe(sh, xd, pd);
  const float one = 1.f, zero = 0.f;
  REPLICA_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
      s.cudnn, CUDNN_BATCHNORM_SPATIAL, &one, &zero, xd.get(), x.f32(), xd.get(), y.f32(),
      pd.get(), g, b, running_mean.f32(), running_var.f32(), static_cast<double>(eps)));
}

void CudaBackend::batchnorm_backward(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                     const Tensor& save_mean, const Tensor& save_invstd,
                                     const Tensor& dy, Tensor& dx, Tensor& dgamma,
                                     Tensor& dbeta) {
  const char* op = "batchnorm_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, dy, op, "dy");
  cuda::expect_shape(dy, x.shape(), op, "dy");
  const BnShape sh = bn_shape(x, op);
  expect_param(ctx, save_mean, sh.C, op, "save_mean");
  expect_param(ctx, save_invstd, sh.C, op, "save_invstd");
  if (gamma.defined()) expect_param(ctx, gamma, sh.C, op, "gamma");
  if (dx.defined()) {
    cuda::expect_device(ctx, dx, op, "dx");
    cuda::expect_shape(dx, x.shape(), op, "dx");
  }
  if (dgamma.defined()) expect_param(ctx, dgamma, sh.C, op, "dgamma");
  if (dbeta.defined()) expect_param(ctx, dbeta, sh.C, op, "dbeta");
  if (x.numel() == 0) return;
  CudaState& s = cuda_state(ctx);

  // cuDNN wants every buffer: what the caller does not want goes to scratch, laid out as
  // [gamma ones (C) | dgamma (C) | dbeta (C) | dx (numel)].
  const bool need_g = !gamma.defined(), need_dg = !dgamma.defined(), need_db = !dbeta.defined();
  const bool need_dx = !dx.defined();
  const float* g = gamma.defined() ? gamma.f32() : nullptr;
  float* dg = dgamma.defined() ? dgamma.f32() : nullptr;
  float* db = dbeta.defined() ? dbeta.f32() : nullptr;
  float* dxp = dx.defined() ? dx.f32() : nullptr;
  if (need_g || need_dg || need_db || need_dx) {
    float* tmp = scratch(ctx, 3 * sh.C + (need_dx ? x.numel() : 0));
    if (need_g) {
      cuda::fill_async(tmp, sh.C, 1.f, s.stream);
      g = tmp;
    }
    if (need_dg) dg = tmp + sh.C;
    if (need_db) db = tmp + 2 * sh.C;
    if (need_dx) dxp = tmp + 3 * sh.C;
  }
  TensorDesc xd, pd;
  describe(sh, xd, pd);
  const float one = 1.f, zero = 0.f;
  // The saved statistics are used as they are; epsilon must still be a valid value.
  const double eps_unused = 1e-5;
  REPLICA_CUDNN_CHECK(cudnnBatchNormalizationBackward(
      s.cudnn, CUDNN_BATCHNORM_SPATIAL, &one, &zero, &one, &one, xd.get(), x.f32(), xd.get(),
      dy.f32(), xd.get(), dxp, pd.get(), g, dg, db, eps_unused, save_mean.f32(),
      save_invstd.f32()));
}

}  // namespace replica
