// Residual blocks and the ResNet family, laid out and named as torchvision's resnet18/50/101
// (conv1, bn1, layer1.0.conv1, layer1.0.downsample.0, fc, ...), so weights map one to one.
#pragma once
#include <memory>

#include "layers/layers.h"

namespace replica {

// out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); 3x3 convs, expansion 1.
class BasicBlock : public Module {
 public:
  static constexpr int kExpansion = 1;
  BasicBlock(int64_t in, int64_t planes, int stride);
  std::string type() const override { return "BasicBlock"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  Sequential* body_;
  Sequential* downsample_ = nullptr;
  ReLU* out_relu_;
};

// out = relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))) + shortcut(x));
// 1x1 -> 3x3 (stride here, as torchvision v1.5) -> 1x1 with 4x expansion.
class Bottleneck : public Module {
 public:
  static constexpr int kExpansion = 4;
  Bottleneck(int64_t in, int64_t planes, int stride);
  std::string type() const override { return "Bottleneck"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Shape output_shape(const Shape& in) const override;

 private:
  Sequential* body_;
  Sequential* downsample_ = nullptr;
  ReLU* out_relu_;
};

// ResNet with `blocks` per stage. in_channels 3 for ImageNet-style 224x224 input; the
// 1-channel variant is the recipe's `conv1 = Conv2d(1, 64, 7, 2, 3, bias=False)`.
std::unique_ptr<Module> make_resnet(int depth, int64_t in_channels, int64_t num_classes);

}  // namespace replica
