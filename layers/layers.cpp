#include "layers/layers.h"

#include <cmath>

#include "engine/bf16_storage.h"
#include "engine/error.h"

namespace replica {

namespace {
float default_bound(int64_t fan_in) { return fan_in > 0 ? 1.f / std::sqrt(float(fan_in)) : 0.f; }

// t laid out channels_last or NCHW (engine/tensor.h): t itself where its memory already is, else
// a copy (the backend's copy converts).
Tensor laid_out(DeviceContext& ctx, const Tensor& t, bool channels_last) {
  if (t.nhwc_memory() == (channels_last && !t.layout_free())) return t;
  Tensor out = ctx.alloc(t.shape(), t.dtype(), channels_last);
  ctx.ops().copy(ctx, out, t);
  return out;
}
}  // namespace

// ---- Linear ---------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool bias) : in_(in), out_(out), has_bias_(bias) {
  add_param("weight", {out, in}, Init::uniform(default_bound(in)));
  if (bias) add_param("bias", {out}, Init::uniform(default_bound(in)));
}

Shape Linear::output_shape(const Shape& in) const {
  REPLICA_CHECK(in.size() == 2 && in[1] == in_, "Linear({}, {}) got input {}", in_, out_,
                shape_str(in));
  return {in[0], out_};
}

Tensor Linear::forward(DeviceContext& ctx, const Tensor& x) {
  if (training_) x_ = x;
  Tensor y = ctx.alloc(output_shape(x.shape()), activation_dtype(ctx));
  ctx.ops().linear_forward(ctx, x, params_[0]->value, has_bias_ ? params_[1]->value : Tensor(), y);
  macs_ = double(x.dim(0)) * in_ * out_;
  return y;
}

Tensor Linear::backward(DeviceContext& ctx, const Tensor& dy) {
  REPLICA_CHECK(x_.defined(), "Linear backward without a training-mode forward");
  Tensor dx = needs_input_grad_ ? ctx.alloc_as(x_) : Tensor();
  Tensor db = has_bias_ ? params_[1]->grad : Tensor();
  ctx.ops().linear_backward(ctx, x_, params_[0]->value, dy, dx, params_[0]->grad, db);
  x_ = Tensor();
  grads_ready();
  return dx;
}

// ---- Conv2d ---------------------------------------------------------------------------------

Conv2d::Conv2d(int64_t in, int64_t out, int kernel, int stride, int padding, bool bias)
    : Conv2d(in, out, kernel, stride, padding, bias,
             Init::uniform(default_bound(in * kernel * kernel))) {}

Conv2d::Conv2d(int64_t in, int64_t out, int kernel, int stride, int padding, bool bias,
               Init weight_init)
    : in_(in), out_(out), kernel_(kernel), p_{stride, padding}, has_bias_(bias) {
  REPLICA_CHECK(kernel >= 1 && stride >= 1 && padding >= 0, "Conv2d: bad kernel/stride/padding");
  add_param("weight", {out, in, kernel, kernel}, weight_init);
  if (bias) add_param("bias", {out}, Init::uniform(default_bound(in * kernel * kernel)));
}

Shape Conv2d::output_shape(const Shape& in) const {
  REPLICA_CHECK(in.size() == 4 && in[1] == in_, "Conv2d({}, {}) got input {}", in_, out_,
                shape_str(in));
  int64_t p = window_out(in[2], kernel_, p_.stride, p_.padding);
  int64_t q = window_out(in[3], kernel_, p_.stride, p_.padding);
  // The images' size is the user's (--input-shape, the data): a usage error, no source line.
  REPLICA_USAGE_CHECK(p > 0 && q > 0,
                      "the model's layers shrink its input below one pixel: a {}x{} kernel "
                      "(stride {}) gets {}; give larger images", kernel_, kernel_, p_.stride,
                      shape_str(in));
  return {in[0], out_, p, q};
}

Tensor Conv2d::forward(DeviceContext& ctx, const Tensor& x) {
  if (training_) x_ = x;
  Shape os = output_shape(x.shape());
  // NHWC where the convolution runs NHWC: the next layers read it as cuDNN wrote it.
  Tensor y = ctx.alloc(os, activation_dtype(ctx), ctx.nhwc_convolution(in_, out_));
  ctx.ops().conv2d_forward(ctx, x, params_[0]->value, has_bias_ ? params_[1]->value : Tensor(), y,
                           p_);
  macs_ = double(os[0]) * os[1] * os[2] * os[3] * in_ * kernel_ * kernel_;
  return y;
}

Tensor Conv2d::backward(DeviceContext& ctx, const Tensor& dy) {
  Tensor dx = needs_input_grad_ && x_.defined() ? ctx.alloc_as(x_) : Tensor();
  run_backward(ctx, dy, dx, InputGrad::Overwrite);
  return dx;
}

Tensor Conv2d::backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum) {
  REPLICA_CHECK(sum.defined(), "Conv2d: backward_adding onto an undefined sum");
  if (!needs_input_grad_) return Module::backward_adding(ctx, dy, std::move(sum));
  run_backward(ctx, dy, sum, InputGrad::Accumulate);
  return sum;
}

void Conv2d::run_backward(DeviceContext& ctx, const Tensor& dy, Tensor& dx, InputGrad mode) {
  REPLICA_CHECK(x_.defined(), "Conv2d backward without a training-mode forward");
  Tensor db = has_bias_ ? params_[1]->grad : Tensor();
  ctx.ops().conv2d_backward(ctx, x_, params_[0]->value, dy, dx, params_[0]->grad, db, p_, mode);
  x_ = Tensor();
  grads_ready();
}

// ---- BatchNorm2d ----------------------------------------------------------------------------

BatchNorm2d::BatchNorm2d(int64_t channels, ThenReLU) : BatchNorm2d(channels) { relu_ = true; }

BatchNorm2d::BatchNorm2d(int64_t channels, float eps, float momentum)
    : channels_(channels), relu_(false), eps_(eps), momentum_(momentum) {
  add_param("weight", {channels}, Init::constant(1.f));
  add_param("bias", {channels}, Init::constant(0.f));
  add_buffer("running_mean", {channels}, 0.f);
  add_buffer("running_var", {channels}, 1.f);
}

Tensor BatchNorm2d::forward(DeviceContext& ctx, const Tensor& x) {
  return normalize(ctx, x, Tensor(), relu_);
}

Tensor BatchNorm2d::forward_add_relu(DeviceContext& ctx, const Tensor& x,
                                     const Tensor& residual) {
  REPLICA_CHECK(!relu_, "BatchNorm2d+ReLU: forward_add_relu would apply a second ReLU");
  return normalize(ctx, x, residual, true);
}

Tensor BatchNorm2d::normalize(DeviceContext& ctx, const Tensor& x, const Tensor& residual,
                              bool relu) {
  REPLICA_CHECK(x.ndim() >= 2 && x.dim(1) == channels_, "BatchNorm2d({}) got input {}",
                channels_, shape_str(x.shape()));
  Tensor y = ctx.alloc_as(x);
  Tensor& gamma = params_[0]->value;
  Tensor& beta = params_[1]->value;
  if (training_) {
    // PyTorch's "Expected more than 1 value per channel when training": a batch (or a device's
    // share of it) too small for the input's size, which the user changes, so said as such.
    REPLICA_USAGE_CHECK(x.numel() / channels_ > 1,
                        "BatchNorm in training mode needs more than one value per channel (got "
                        "input {}): use a larger batch per device or larger inputs",
                        shape_str(x.shape()));
    x_ = x;
    if (relu_) y_ = y;  // the next layer keeps it too: no memory of its own
    save_mean_ = ctx.alloc({channels_});
    save_invstd_ = ctx.alloc({channels_});
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, buffers_[0]->value, buffers_[1]->value,
                                      momentum_, eps_, y, save_mean_, save_invstd_, residual,
                                      relu);
  } else {
    ctx.ops().batchnorm_forward_eval(ctx, x, gamma, beta, buffers_[0]->value, buffers_[1]->value,
                                     eps_, y, residual, relu);
  }
  return y;
}

Tensor BatchNorm2d::backward(DeviceContext& ctx, const Tensor& dy) {
  REPLICA_CHECK(x_.defined(), "BatchNorm2d backward without a training-mode forward");
  Tensor dx = ctx.alloc_as(x_);
  ctx.ops().batchnorm_backward(ctx, x_, params_[0]->value, save_mean_, save_invstd_, dy, y_, dx,
                               params_[0]->grad, params_[1]->grad);
  x_ = y_ = save_mean_ = save_invstd_ = Tensor();
  grads_ready();
  return dx;
}

// ---- ReLU, pooling, flatten, dropout --------------------------------------------------------

Tensor ReLU::forward(DeviceContext& ctx, const Tensor& x) {
  Tensor y = ctx.alloc_as(x);
  ctx.ops().relu_forward(ctx, x, y);
  if (training_) y_ = y;
  return y;
}

Tensor ReLU::gradient(DeviceContext& ctx, const Tensor& y, const Tensor& dy) {
  Tensor dx = ctx.alloc_as(y);  // x's gradient: x's shape, dtype and layout, which are y's
  ctx.ops().relu_backward(ctx, y, dy, dx);
  return dx;
}

Tensor ReLU::backward(DeviceContext& ctx, const Tensor& dy) {
  REPLICA_CHECK(y_.defined(), "ReLU backward without a training-mode forward");
  Tensor dx = gradient(ctx, y_, dy);
  y_ = Tensor();
  return dx;
}

MaxPool2d::MaxPool2d(int kernel, int stride, int padding) : p_{kernel, stride, padding} {}

Shape MaxPool2d::output_shape(const Shape& in) const {
  REPLICA_CHECK(in.size() == 4, "MaxPool2d expects NCHW input, got {}", shape_str(in));
  int64_t p = window_out(in[2], p_.kernel, p_.stride, p_.padding);
  int64_t q = window_out(in[3], p_.kernel, p_.stride, p_.padding);
  REPLICA_USAGE_CHECK(p > 0 && q > 0,
                      "the model's layers shrink its input below one pixel: a {}x{} max-pool "
                      "(stride {}) gets {}; give larger images", p_.kernel, p_.kernel, p_.stride,
                      shape_str(in));
  return {in[0], in[1], p, q};
}

Tensor MaxPool2d::forward(DeviceContext& ctx, const Tensor& x) {
  const Shape os = output_shape(x.shape());
  Tensor y = ctx.alloc(os, x.dtype(), x.channels_last());
  ctx.ops().maxpool2d_forward(ctx, x, y, p_);
  if (training_) x_ = x, y_ = y;
  // An NCHW input whose channels the convolutions after it read NHWC (a ResNet's stem): the
  // pooled output is handed on channels_last, one transpose here instead of copies in each of
  // the first block's convolutions and its shortcut.
  return laid_out(ctx, y, x.channels_last() || ctx.nhwc_convolution(x.dim(1), x.dim(1)));
}

Tensor MaxPool2d::backward(DeviceContext& ctx, const Tensor& dy) {
  REPLICA_CHECK(x_.defined(), "MaxPool2d backward without a training-mode forward");
  // The gradient of the output as forward handed it on, in y_'s layout.
  const Tensor g = laid_out(ctx, dy, y_.channels_last());
  Tensor dx = ctx.alloc_as(x_);
  ctx.ops().maxpool2d_backward(ctx, x_, y_, g, dx, p_);
  x_ = y_ = Tensor();
  return dx;
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(int64_t out_h, int64_t out_w) : oh_(out_h), ow_(out_w) {}

Shape AdaptiveAvgPool2d::output_shape(const Shape& in) const {
  REPLICA_CHECK(in.size() == 4, "AdaptiveAvgPool2d expects NCHW input, got {}", shape_str(in));
  return {in[0], in[1], oh_, ow_};
}

Tensor AdaptiveAvgPool2d::forward(DeviceContext& ctx, const Tensor& x) {
  in_shape_ = x.shape();
  in_dtype_ = x.dtype();
  in_channels_last_ = x.channels_last();
  Tensor y = ctx.alloc(output_shape(x.shape()), x.dtype(), x.channels_last());
  ctx.ops().adaptive_avgpool2d_forward(ctx, x, y);
  return y;
}

Tensor AdaptiveAvgPool2d::backward(DeviceContext& ctx, const Tensor& dy) {
  Tensor dx = ctx.alloc(in_shape_, in_dtype_, in_channels_last_);
  ctx.ops().adaptive_avgpool2d_backward(ctx, dy, dx);
  return dx;
}

Shape Flatten::output_shape(const Shape& in) const {
  REPLICA_CHECK(!in.empty(), "Flatten of a scalar");
  return {in[0], in[0] ? shape_numel(in) / in[0] : 0};
}

Tensor Flatten::forward(DeviceContext& ctx, const Tensor& x) {
  in_shape_ = x.shape();
  in_channels_last_ = x.nhwc_memory();
  return laid_out(ctx, x, false).reshape(output_shape(x.shape()));
}

Tensor Flatten::backward(DeviceContext& ctx, const Tensor& dy) {
  return laid_out(ctx, dy.reshape(in_shape_), in_channels_last_);
}

Dropout::Dropout(float p, uint64_t seed) : p_(p), seed_(seed) {
  REPLICA_CHECK(p >= 0.f && p < 1.f, "Dropout probability must be in [0, 1), got {}", p);
}

Tensor Dropout::forward(DeviceContext& ctx, const Tensor& x) {
  if (!training_ || p_ == 0.f) {
    mask_ = Tensor();
    return x;
  }
  // Its seed is a kernel argument that changes every call: a replayed step would draw the
  // captured step's mask again. So a step with dropout is not captured (it runs eagerly).
  REPLICA_CHECK(!ctx.capturing(), "dropout draws a new mask every step: a step with dropout "
                "cannot be captured");
  Tensor y = ctx.alloc_as(x);
  mask_ = ctx.alloc(x.shape(), DType::F32, x.channels_last());
  ctx.ops().dropout_forward(ctx, x, y, mask_, p_, seed_ * 0x100000001B3ull + calls_++);
  return y;
}

Tensor Dropout::backward(DeviceContext& ctx, const Tensor& dy) {
  if (!mask_.defined()) return dy;
  Tensor dx = ctx.alloc_as(dy);
  ctx.ops().mul(ctx, dy, mask_, dx);
  mask_ = Tensor();
  return dx;
}

}  // namespace replica
