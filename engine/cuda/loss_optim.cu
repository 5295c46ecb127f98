// CUDA backend: softmax cross-entropy, accuracy count and the fused optimiser updates.
// The mean loss is reduced in a fixed order (per-row losses in double, then one block's tree):
// no float atomics, so the loss is bit-identical run to run.
#include <cmath>

#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

constexpr int kRowThreads = 256;  // power of two: the tree reductions below rely on it

__device__ __forceinline__ double block_max(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sh[threadIdx.x] = fmax(sh[threadIdx.x], sh[threadIdx.x + half]);
    __syncthreads();
  }
  const double r = sh[0];
  __syncthreads();  // sh may be reused right after
  return r;
}

// One block per row: probs = softmax(row) (via log-sum-exp in double, as the CPU backend), and
// row_loss[n] = lse - x[label] (NaN for a label outside [0, C)).
__global__ void softmax_xent_rows_kernel(const float* logits, const int32_t* labels, float* probs,
                                         double* row_loss, int64_t C) {
  __shared__ double sh[kRowThreads];
  const int64_t n = blockIdx.x;
  const float* row = logits + n * C;
  float* prow = probs + n * C;
  double mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) mx = fmax(mx, double(row[j]));
  mx = block_max(mx, sh);
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += exp(double(row[j]) - mx);
  s = cuda::block_sum(s, sh);
  const double lse = mx + log(s);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) prow[j] = float(exp(double(row[j]) - lse));
  if (threadIdx.x == 0) {
    const int32_t label = labels[n];
    row_loss[n] = (label >= 0 && label < C) ? lse - double(row[label]) : double(NAN);
  }
}

// Single block: loss[0] = mean of row_loss, summed in a fixed order.
__global__ void mean_kernel(const double* row_loss, int64_t N, float* loss) {
  __shared__ double sh[kRowThreads];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) s += row_loss[i];
  s = cuda::block_sum(s, sh);
  if (threadIdx.x == 0) loss[0] = float(s / double(N));
}

__global__ void xent_backward_kernel(const float* probs, const int32_t* labels, float scale,
                                     float* dlogits, int64_t N, int64_t C) {
  const int64_t total = N * C;
  REPLICA_GRID_STRIDE(i, total) {
    const int64_t n = i / C, c = i - n * C;
    dlogits[i] = (probs[i] - (c == labels[n] ? 1.f : 0.f)) * scale;
  }
}

// One thread per row (its label's place: label_place, as the CPU backend); one atomic per
// block and count.
__global__ void count_correct_kernel(const float* logits, const int32_t* labels, int64_t N,
                                     int64_t C, int64_t K, int32_t* correct) {
  const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t place = n < N ? label_place(logits + n * C, C, labels[n]) : INT64_MAX;
  for (int64_t k = 0; k < K; ++k) {  // K is the same in every thread: each reaches the barrier
    const int hits = __syncthreads_count(place <= k);
    if (threadIdx.x == 0 && hits > 0) atomicAdd(correct + k, hits);
  }
}

// The step's numbers come from device memory (scalars, backend_ops.inc): a captured step
// replays with what the optimizer wrote before it.
__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n,
                           const float* scalars, float momentum, float dampening, float wd,
                           bool nesterov) {
  const float lr = scalars[0];
  const bool first_step = scalars[1] != 0.f;
  REPLICA_GRID_STRIDE(i, n) {
    float d = g[i] + wd * p[i];
    if (buf) {
      const float b = first_step ? d : momentum * buf[i] + (1.f - dampening) * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

__global__ void adam_kernel(float* p, const float* g, float* m, float* v, int64_t n, float b1,
                            float b2, float eps, float wd, const float* scalars) {
  const float step_size = scalars[0], bc2_sqrt = scalars[1];
  REPLICA_GRID_STRIDE(i, n) {
    const float grad = g[i] + wd * p[i];
    const float mi = b1 * m[i] + (1.f - b1) * grad;
    const float vi = b2 * v[i] + (1.f - b2) * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] -= step_size * mi / denom;
  }
}

void check_scalars(const DeviceContext& ctx, const Tensor& scalars, const char* op) {
  cuda::expect_device(ctx, scalars, op, "scalars");
  cuda::expect_dtype(scalars, DType::F32, op, "scalars");
  cuda::expect_numel(scalars, 2, op, "scalars");
}

void check_logits_labels(const DeviceContext& ctx, const Tensor& logits, const Tensor& labels,
                         const char* op) {
  cuda::expect_device(ctx, logits, op, "logits");
  cuda::expect_device(ctx, labels, op, "labels");
  REPLICA_CHECK(logits.ndim() == 2, "{}: logits {} must be [N, C]", op,
                shape_str(logits.shape()));
  cuda::expect_dtype(labels, DType::I32, op, "labels");
  cuda::expect_numel(labels, logits.dim(0), op, "labels");
}

}  // namespace

void CudaBackend::cross_entropy_forward(DeviceContext& ctx, const Tensor& logits,
                                        const Tensor& labels, Tensor& probs, Tensor& loss) {
  const char* op = "cross_entropy_forward";
  check_logits_labels(ctx, logits, labels, op);
  cuda::expect_device(ctx, probs, op, "probs");
  cuda::expect_numel(probs, logits.numel(), op, "probs");
  cuda::expect_device(ctx, loss, op, "loss");
  cuda::expect_numel(loss, 1, op, "loss");
  const int64_t N = logits.dim(0), C = logits.dim(1);
  CudaState& s = cuda_state(ctx);
  if (N == 0) {  // mean over no rows: 0, as the CPU backend
    REPLICA_CUDA_CHECK(cudaMemsetAsync(loss.raw(), 0, sizeof(float), s.stream));
    return;
  }
  REPLICA_CHECK(N <= INT32_MAX, "{}: {} rows is too many", op, N);
  // Per-row losses in double: 2 floats each of the (512-byte aligned) scratch.
  const Tensor rows = scratch(ctx, 2 * N);
  double* row_loss = reinterpret_cast<double*>(rows.f32());
  softmax_xent_rows_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, s.stream>>>(
      logits.f32(), labels.i32(), probs.f32(), row_loss, C);
  REPLICA_LAUNCH_CHECK();
  mean_kernel<<<1, kRowThreads, 0, s.stream>>>(row_loss, N, loss.f32());
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::cross_entropy_backward(DeviceContext& ctx, const Tensor& probs,
                                         const Tensor& labels, float scale, Tensor& dlogits) {
  const char* op = "cross_entropy_backward";
  check_logits_labels(ctx, probs, labels, op);
  cuda::expect_device(ctx, dlogits, op, "dlogits");
  cuda::expect_numel(dlogits, probs.numel(), op, "dlogits");
  const int64_t N = probs.dim(0), C = probs.dim(1);
  if (N * C == 0) return;
  xent_backward_kernel<<<cuda::grid_for(N * C), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
      probs.f32(), labels.i32(), scale, dlogits.f32(), N, C);
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::count_correct(DeviceContext& ctx, const Tensor& logits, const Tensor& labels,
                                Tensor& correct) {
  const char* op = "count_correct";
  check_logits_labels(ctx, logits, labels, op);
  cuda::expect_device(ctx, correct, op, "correct");
  cuda::expect_dtype(correct, DType::I32, op, "correct");
  REPLICA_CHECK(correct.numel() >= 1, "{}: counts {} must be [K >= 1]", op,
                shape_str(correct.shape()));
  const int64_t N = logits.dim(0), C = logits.dim(1), K = correct.numel();
  if (N == 0) return;
  const int64_t blocks = (N + cuda::kThreads - 1) / cuda::kThreads;
  REPLICA_CHECK(blocks <= INT32_MAX, "{}: {} rows is too many", op, N);
  count_correct_kernel<<<static_cast<unsigned>(blocks), cuda::kThreads, 0,
                         cuda_state(ctx).stream>>>(logits.f32(), labels.i32(), N, C, K,
                                                   correct.i32());
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::sgd_step(DeviceContext& ctx, Tensor& params, const Tensor& grads,
                           Tensor& momentum, const SgdConfig& c, const Tensor& scalars) {
  const char* op = "sgd_step";
  cuda::expect_device(ctx, params, op, "params");
  cuda::expect_device(ctx, grads, op, "grads");
  cuda::expect_numel(grads, params.numel(), op, "grads");
  check_scalars(ctx, scalars, op);
  float* buf = nullptr;
  if (c.momentum != 0.f) {
    cuda::expect_device(ctx, momentum, op, "momentum buffer");
    cuda::expect_numel(momentum, params.numel(), op, "momentum buffer");
    buf = momentum.f32();
  }
  const int64_t n = params.numel();
  if (n == 0) return;
  sgd_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
      params.f32(), grads.f32(), buf, n, scalars.f32(), c.momentum, c.dampening, c.weight_decay,
      c.nesterov);
  REPLICA_LAUNCH_CHECK();
}

void CudaBackend::adam_step(DeviceContext& ctx, Tensor& params, const Tensor& grads, Tensor& m,
                            Tensor& v, const AdamConfig& c, const Tensor& scalars) {
  const char* op = "adam_step";
  cuda::expect_device(ctx, params, op, "params");
  cuda::expect_device(ctx, grads, op, "grads");
  cuda::expect_device(ctx, m, op, "m");
  cuda::expect_device(ctx, v, op, "v");
  cuda::expect_numel(grads, params.numel(), op, "grads");
  cuda::expect_numel(m, params.numel(), op, "m");
  cuda::expect_numel(v, params.numel(), op, "v");
  check_scalars(ctx, scalars, op);
  const int64_t n = params.numel();
  if (n == 0) return;
  adam_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, cuda_state(ctx).stream>>>(
      params.f32(), grads.f32(), m.f32(), v.f32(), n, c.beta1, c.beta2, c.eps, c.weight_decay,
      scalars.f32());
  REPLICA_LAUNCH_CHECK();
}

}  // namespace replica
