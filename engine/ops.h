// Backend: the kernels one kind of device provides. Layers call ctx.ops().X(ctx, ...) and never
// know which device they run on. All tensors are contiguous, row-major, NCHW for images, F32
// unless said otherwise, and on the context's device. An undefined Tensor means "not wanted".
// Gradient outputs marked (+=) accumulate into what is there, so micro-batches can accumulate.
// Work is enqueued on the device's stream; nothing here synchronises with the host.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>

#include "engine/error.h"
#include "engine/tensor.h"

namespace replica {

class DeviceContext;

struct Conv2dParams {
  int stride = 1;
  int padding = 0;
};

struct Pool2dParams {
  int kernel = 2;
  int stride = 2;
  int padding = 0;
};

struct SgdConfig {
  float lr = 0.01f, momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
};

struct AdamConfig {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
};

// Output size of a convolution or pooling window along one axis.
inline int64_t window_out(int64_t in, int kernel, int stride, int padding) {
  return (in + 2 * padding - kernel) / stride + 1;
}

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- memory -------------------------------------------------------------------------
  virtual void fill(DeviceContext& ctx, Tensor& t, float value) = 0;
  // dst <- src. Same numel and dtype. Either side may be host memory (pinned for async H2D/D2H);
  // both may be on this device. Asynchronous on the device stream.
  virtual void copy(DeviceContext& ctx, Tensor& dst, const Tensor& src) = 0;
  virtual void add(DeviceContext& ctx, Tensor& dst, const Tensor& src, float alpha) = 0;  // dst += alpha*src
  virtual void scale(DeviceContext& ctx, Tensor& t, float alpha) = 0;                     // t *= alpha
  // dst[i] <- table[rows[i]]: whole rows (dim 0) of `table` picked by `rows` (I32 [n], on this
  // device, each in [0, table.dim(0)): the caller checks). dst [n, table's other dims], same
  // dtype as table (F32 or I32). How a batch is cut out of a training set held on the device.
  virtual void gather_rows(DeviceContext& ctx, Tensor& dst, const Tensor& table,
                           const Tensor& rows) = 0;

  // ---- dense --------------------------------------------------------------------------
  // x [N, in], w [out, in], b [out] or undefined, y [N, out]:  y = x w^T + b
  virtual void linear_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                              const Tensor& b, Tensor& y) = 0;
  // dx = dy w (skipped if undefined); dw += dy^T x; db += sum_n dy (skipped if undefined)
  virtual void linear_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                               const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db) = 0;

  // x [N, C, H, W], w [K, C, R, R] (square kernel), b [K] or undefined, y [N, K, P, Q]
  virtual void conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                              const Tensor& b, Tensor& y, const Conv2dParams& p) = 0;
  // dx (skipped if undefined, overwritten), dw (+=), db (+=, skipped if undefined)
  virtual void conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                               const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                               const Conv2dParams& p) = 0;

  // ---- normalisation ------------------------------------------------------------------
  // Training mode: batch statistics over (N, H, W) per channel; running stats updated as
  // PyTorch does (running = (1-m) running + m stat, unbiased variance); saves mean and
  // 1/sqrt(var+eps) (biased var) for backward.
  virtual void batchnorm_forward_train(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                       const Tensor& beta, Tensor& running_mean,
                                       Tensor& running_var, float momentum, float eps, Tensor& y,
                                       Tensor& save_mean, Tensor& save_invstd) = 0;
  virtual void batchnorm_forward_eval(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                      const Tensor& beta, const Tensor& running_mean,
                                      const Tensor& running_var, float eps, Tensor& y) = 0;
  // dx overwritten; dgamma, dbeta (+=)
  virtual void batchnorm_backward(DeviceContext& ctx, const Tensor& x, const Tensor& gamma,
                                  const Tensor& save_mean, const Tensor& save_invstd,
                                  const Tensor& dy, Tensor& dx, Tensor& dgamma,
                                  Tensor& dbeta) = 0;

  // ---- activations and pooling ----------------------------------------------------------
  virtual void relu_forward(DeviceContext& ctx, const Tensor& x, Tensor& y) = 0;
  virtual void relu_backward(DeviceContext& ctx, const Tensor& y, const Tensor& dy,
                             Tensor& dx) = 0;
  // Padding counts as -inf. Ties go to the first maximum in row-major window order.
  virtual void maxpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y,
                                 const Pool2dParams& p) = 0;
  virtual void maxpool2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& y,
                                  const Tensor& dy, Tensor& dx, const Pool2dParams& p) = 0;
  // PyTorch's adaptive windows: start = floor(i*In/Out), end = ceil((i+1)*In/Out).
  virtual void adaptive_avgpool2d_forward(DeviceContext& ctx, const Tensor& x, Tensor& y) = 0;
  virtual void adaptive_avgpool2d_backward(DeviceContext& ctx, const Tensor& dy, Tensor& dx) = 0;
  // Inverted dropout. keep(i) = hash(seed, i) >= p; the same mask on every backend.
  // mask (F32, same shape as x) stores 0 or 1/(1-p).
  virtual void dropout_forward(DeviceContext& ctx, const Tensor& x, Tensor& y, Tensor& mask,
                               float p, uint64_t seed) = 0;
  // dx = dy * mask (elementwise multiply; also usable as a general product)
  virtual void mul(DeviceContext& ctx, const Tensor& a, const Tensor& b, Tensor& out) = 0;

  // ---- loss and metrics --------------------------------------------------------------
  // logits [N, C], labels I32 [N] in [0, C). probs <- softmax(logits);
  // loss (F32 [1]) <- mean_n -log softmax(logits)[n, label_n]. Labels out of range: loss NaN.
  virtual void cross_entropy_forward(DeviceContext& ctx, const Tensor& logits,
                                     const Tensor& labels, Tensor& probs, Tensor& loss) = 0;
  // dlogits <- (probs - onehot(labels)) * scale   (scale = 1/N for a mean over N samples)
  virtual void cross_entropy_backward(DeviceContext& ctx, const Tensor& probs,
                                      const Tensor& labels, float scale, Tensor& dlogits) = 0;
  // correct (I32 [1]) += number of rows whose argmax equals the label (first max on ties)
  virtual void count_correct(DeviceContext& ctx, const Tensor& logits, const Tensor& labels,
                             Tensor& correct) = 0;

  // ---- optimisers (fused, over flat buffers; PyTorch's update rules) -------------------
  // first_step: momentum buffer is initialised to the gradient (PyTorch's rule).
  virtual void sgd_step(DeviceContext& ctx, Tensor& params, const Tensor& grads,
                        Tensor& momentum, const SgdConfig& c, bool first_step) = 0;
  // step counts from 1.
  virtual void adam_step(DeviceContext& ctx, Tensor& params, const Tensor& grads, Tensor& m,
                         Tensor& v, const AdamConfig& c, int64_t step) = 0;
};

// gather_rows' shapes, checked alike by every backend: returns the elements in one row.
inline int64_t gather_row_numel(const Tensor& dst, const Tensor& table, const Tensor& rows) {
  REPLICA_CHECK(dst.defined() && table.defined() && rows.defined(),
                "gather_rows: undefined tensor");
  REPLICA_CHECK(rows.dtype() == DType::I32 && rows.shape().size() == 1,
                "gather_rows: rows must be I32 [n], got {} {}", dtype_name(rows.dtype()),
                shape_str(rows.shape()));
  REPLICA_CHECK(dst.dtype() == table.dtype(), "gather_rows: dst is {}, table {}",
                dtype_name(dst.dtype()), dtype_name(table.dtype()));
  REPLICA_CHECK(!table.shape().empty() && !dst.shape().empty() && dst.dim(0) == rows.dim(0),
                "gather_rows: dst {} for {} rows of table {}", shape_str(dst.shape()),
                rows.dim(0), shape_str(table.shape()));
  const int64_t row = table.dim(0) ? table.numel() / table.dim(0) : 0;
  REPLICA_CHECK(dst.numel() == rows.dim(0) * row, "gather_rows: dst {} for {} rows of table {}",
                shape_str(dst.shape()), rows.dim(0), shape_str(table.shape()));
  return row;
}

std::unique_ptr<Backend> make_cpu_backend();  // the CUDA one: cudart::make_backend()

#if defined(__CUDACC__)
#define REPLICA_HOST_DEVICE __host__ __device__
#else
#define REPLICA_HOST_DEVICE
#endif

// The dropout hash shared by every backend: uniform in [0, 1) from (seed, index).
REPLICA_HOST_DEVICE inline float dropout_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// bf16 is the upper half of an fp32 number: 8 exponent bits as fp32, 7 mantissa bits. Rounded to
// nearest, ties to even, as tensor cores and PyTorch round; a NaN stays a (quiet) NaN and what is
// beyond bf16's largest finite value becomes infinity. Every backend rounds through these, so
// the CPU's bf16 products and the GPU's conversions round alike, bit for bit.
REPLICA_HOST_DEVICE inline uint16_t bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
REPLICA_HOST_DEVICE inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
REPLICA_HOST_DEVICE inline float bf16_round(float f) { return bf16_value(bf16_bits(f)); }

}  // namespace replica
