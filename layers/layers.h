// The leaf layers: Linear, Conv2d, BatchNorm2d, ReLU, MaxPool2d, AdaptiveAvgPool2d, Flatten,
// Dropout. Semantics and parameter names follow torch.nn, so state dicts line up.
#pragma once
#include "layers/module.h"

namespace replica {

// y = x W^T + b.  weight [out, in], bias [out]. PyTorch's default init: U(-1/sqrt(in), ..).
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias = true);
  std::string type() const override { return "Linear"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;
  Param& weight() { return *params_[0]; }

 private:
  int64_t in_, out_;
  bool has_bias_;
  Tensor x_;
};

// Square kernels, no groups or dilation. Init: U(-1/sqrt(fan_in), ..) for weight and bias
// (PyTorch's default), or a given initialiser for the weight (torchvision's ResNet init).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in, int64_t out, int kernel, int stride = 1, int padding = 0, bool bias = true);
  Conv2d(int64_t in, int64_t out, int kernel, int stride, int padding, bool bias, Init weight_init);
  std::string type() const override { return "Conv2d"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Tensor backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum) override;
  Shape output_shape(const Shape& in) const override;

 private:
  // dx: the input gradient's buffer (undefined: not wanted), written or added to.
  void run_backward(DeviceContext& ctx, const Tensor& dy, Tensor& dx, InputGrad mode);
  int64_t in_, out_;
  int kernel_;
  Conv2dParams p_;
  bool has_bias_;
  Tensor x_;
};

// Per-channel batch normalisation; running statistics are buffers (eps 1e-5, momentum 0.1).
// Made with ThenReLU, the ReLU that follows it in a ResNet is computed in the same kernels
// (torch.nn's BatchNorm2d then ReLU, in one pass over the activation): the parameters and their
// names are BatchNorm2d's, the numbers those of the two layers.
class BatchNorm2d : public Module {
 public:
  struct ThenReLU {};  // a tag, so no number can be taken for it
  explicit BatchNorm2d(int64_t channels, float eps = 1e-5f, float momentum = 0.1f);
  BatchNorm2d(int64_t channels, ThenReLU);
  std::string type() const override { return relu_ ? "BatchNorm2d+ReLU" : "BatchNorm2d"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  // relu(BN(x) + residual) in one pass: a residual block's last BatchNorm, its sum and the
  // ReLU after it. backward() is then BatchNorm's alone: the block masks the gradient by its
  // output and passes the sum's gradient on to the residual's branch itself.
  Tensor forward_add_relu(DeviceContext& ctx, const Tensor& x, const Tensor& residual);
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override { return in; }

 private:
  Tensor normalize(DeviceContext& ctx, const Tensor& x, const Tensor& residual, bool relu);

  int64_t channels_;
  bool relu_;
  float eps_, momentum_;
  Tensor x_, y_, save_mean_, save_invstd_;  // y_: the output, kept with a fused ReLU
};

class ReLU : public Module {
 public:
  std::string type() const override { return "ReLU"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override { return in; }
  // The gradient through a ReLU whose output was y (also a fused ReLU's: a residual block's).
  static Tensor gradient(DeviceContext& ctx, const Tensor& y, const Tensor& dy);

 private:
  Tensor y_;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(int kernel, int stride, int padding = 0);
  std::string type() const override { return "MaxPool2d"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  Pool2dParams p_;
  Tensor x_, y_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(int64_t out_h, int64_t out_w);
  std::string type() const override { return "AdaptiveAvgPool2d"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  int64_t oh_, ow_;
  Shape in_shape_;  // the input's shape, dtype and layout, for dx (its memory is not kept)
  DType in_dtype_ = DType::F32;
  bool in_channels_last_ = false;
};

// [N, ...] -> [N, prod(...)]: a view, no copy; of a channels_last input (engine/tensor.h), an
// NCHW copy first, so that the features are in PyTorch's order (and the gradient goes back
// into the input's layout).
class Flatten : public Module {
 public:
  std::string type() const override { return "Flatten"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  Shape in_shape_;
  bool in_channels_last_ = false;
};

// Inverted dropout in training mode, identity in eval. The mask is a pure function of
// (seed, call count, element index), so a replayed run draws the same masks.
class Dropout : public Module {
 public:
  explicit Dropout(float p, uint64_t seed = 0);
  std::string type() const override { return "Dropout"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override { return in; }
  void set_seed(uint64_t seed, uint64_t calls) { seed_ = seed; calls_ = calls; }
  uint64_t calls() const { return calls_; }

 private:
  float p_;
  uint64_t seed_, calls_ = 0;
  Tensor mask_;
};

}  // namespace replica
