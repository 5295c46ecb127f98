// Residual blocks and the ResNet family, laid out and named as torchvision's resnet18/50/101
// (conv1, bn1, layer1.0.conv1, layer1.0.downsample.0, fc, ...), so weights map one to one. A
// BatchNorm followed by a ReLU is one BatchNorm2d made with ThenReLU, and a block's last
// BatchNorm, its sum and its ReLU are one pass (BatchNorm2d::forward_add_relu): one pass over
// the activation each, not two or three.
#pragma once
#include <memory>

#include "layers/layers.h"

namespace replica {

// out = relu(bn(body(x)) + shortcut(x)), the shape both blocks share. The shortcut is x itself,
// or a strided 1x1 conv + BatchNorm ("downsample") where the block changes resolution or
// channels. The body's last BatchNorm, the sum and the ReLU are one pass over the activation
// (BatchNorm2d::forward_add_relu).
class ResidualBlock : public Module {
 public:
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 protected:
  ResidualBlock();
  // Called by a block's constructor after it filled body() up to its last convolution:
  // registers the last BatchNorm (named `bn_name`) and then downsample, torchvision's order, so
  // parameters map one to one.
  void add_last_bn_and_shortcut(const std::string& bn_name, int64_t in, int64_t out, int stride);
  Sequential& body() { return *body_; }

 private:
  Sequential* body_;
  BatchNorm2d* last_bn_ = nullptr;
  Sequential* downsample_ = nullptr;
  Tensor y_;  // the block's output, for the ReLU's backward (training mode)
  // Whether the body's input gradient is added onto the shortcut's by the body's first
  // convolution as it writes it (the default), or by an add of its own
  // (REPLICA_RESIDUAL_SUM=add, read when the block is made: for measuring the two on a GPU;
  // both give the same bits on CPU devices).
  bool sum_in_conv_;
};

// body = conv2(relu(bn1(conv1(x)))), then bn2; 3x3 convs, expansion 1.
class BasicBlock : public ResidualBlock {
 public:
  static constexpr int kExpansion = 1;
  BasicBlock(int64_t in, int64_t planes, int stride);
  std::string type() const override { return "BasicBlock"; }
};

// body = conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))), then bn3;
// 1x1 -> 3x3 (stride here, as torchvision v1.5) -> 1x1 with 4x expansion.
class Bottleneck : public ResidualBlock {
 public:
  static constexpr int kExpansion = 4;
  Bottleneck(int64_t in, int64_t planes, int stride);
  std::string type() const override { return "Bottleneck"; }
};

// ResNet with `blocks` per stage. in_channels 3 for ImageNet-style 224x224 input; the
// 1-channel variant is the recipe's `conv1 = Conv2d(1, 64, 7, 2, 3, bias=False)`.
std::unique_ptr<Module> make_resnet(int depth, int64_t in_channels, int64_t num_classes);

}  // namespace replica
