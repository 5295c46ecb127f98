#include "layers/resnet.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "engine/env_switch.h"
#include "engine/error.h"

namespace replica {

namespace {

// torchvision's ResNet init: kaiming_normal_(mode="fan_out", nonlinearity="relu").
std::unique_ptr<Conv2d> resnet_conv(int64_t in, int64_t out, int k, int stride, int pad) {
  float std = std::sqrt(2.f / float(out * k * k));
  return std::make_unique<Conv2d>(in, out, k, stride, pad, false, Init::normal(std));
}

}  // namespace

ResidualBlock::ResidualBlock() : sum_in_conv_(switches::residual_sum_in_conv()) {
  body_ = &add_child("", std::make_unique<Sequential>());
}

void ResidualBlock::add_last_bn_and_shortcut(const std::string& bn_name, int64_t in, int64_t out,
                                             int stride) {
  last_bn_ = &add_child(bn_name, std::make_unique<BatchNorm2d>(out));
  if (stride != 1 || in != out) {
    downsample_ = &add_child("downsample", std::make_unique<Sequential>());
    downsample_->add("0", resnet_conv(in, out, 1, stride, 0));
    downsample_->add("1", std::make_unique<BatchNorm2d>(out));
  }
}

Shape ResidualBlock::output_shape(const Shape& in) const { return body_->output_shape(in); }

Tensor ResidualBlock::forward(DeviceContext& ctx, const Tensor& x) {
  Tensor h = body_->forward(ctx, x);
  Tensor shortcut = downsample_ ? downsample_->forward(ctx, x) : x;
  Tensor out = last_bn_->forward_add_relu(ctx, h, shortcut);  // one pass: BN, sum, ReLU
  if (training_) y_ = out;
  return out;
}

Tensor ResidualBlock::backward(DeviceContext& ctx, const Tensor& dy) {
  REPLICA_CHECK(y_.defined(), "{} backward without a training-mode forward", type());
  Tensor dsum = ReLU::gradient(ctx, y_, dy);
  y_ = Tensor();
  // The reverse of the parameters' order (body, last BatchNorm, downsample), so gradients
  // become ready in the order DDP's buckets are laid out.
  Tensor dshort = downsample_ ? downsample_->backward(ctx, dsum) : dsum;
  Tensor dh = last_bn_->backward(ctx, dsum);
  // The body's input gradient is added onto the shortcut's as its first convolution writes it.
  // On the identity path that is dsum's own buffer: every read of dsum is queued before.
  if (!sum_in_conv_) return body_->Module::backward_adding(ctx, dh, std::move(dshort));
  return body_->backward_adding(ctx, dh, std::move(dshort));
}

BasicBlock::BasicBlock(int64_t in, int64_t planes, int stride) {
  // Children registered in torchvision's order: conv1, bn1, conv2, bn2, downsample.
  body().add("conv1", resnet_conv(in, planes, 3, stride, 1));
  body().add("bn1", std::make_unique<BatchNorm2d>(planes, BatchNorm2d::ThenReLU{}));
  body().add("conv2", resnet_conv(planes, planes, 3, 1, 1));
  add_last_bn_and_shortcut("bn2", in, planes * kExpansion, stride);
}

Bottleneck::Bottleneck(int64_t in, int64_t planes, int stride) {
  body().add("conv1", resnet_conv(in, planes, 1, 1, 0));
  body().add("bn1", std::make_unique<BatchNorm2d>(planes, BatchNorm2d::ThenReLU{}));
  body().add("conv2", resnet_conv(planes, planes, 3, stride, 1));
  body().add("bn2", std::make_unique<BatchNorm2d>(planes, BatchNorm2d::ThenReLU{}));
  body().add("conv3", resnet_conv(planes, planes * kExpansion, 1, 1, 0));
  add_last_bn_and_shortcut("bn3", in, planes * kExpansion, stride);
}

namespace {

template <class Block>
std::unique_ptr<Module> build_resnet(const int (&blocks)[4], int64_t in_channels,
                                     int64_t num_classes) {
  auto net = std::make_unique<Sequential>();
  net->add("conv1", resnet_conv(in_channels, 64, 7, 2, 3));
  net->add("bn1", std::make_unique<BatchNorm2d>(64, BatchNorm2d::ThenReLU{}));
  net->add("maxpool", std::make_unique<MaxPool2d>(3, 2, 1));
  int64_t in = 64;
  const int64_t planes[4] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    auto layer = std::make_unique<Sequential>();
    for (int b = 0; b < blocks[stage]; ++b) {
      int stride = (stage > 0 && b == 0) ? 2 : 1;
      layer->add(std::to_string(b), std::make_unique<Block>(in, planes[stage], stride));
      in = planes[stage] * Block::kExpansion;
    }
    net->add("layer" + std::to_string(stage + 1), std::move(layer));
  }
  net->add("avgpool", std::make_unique<AdaptiveAvgPool2d>(1, 1));
  net->add("flatten", std::make_unique<Flatten>());
  net->add("fc", std::make_unique<Linear>(in, num_classes));
  return net;
}

}  // namespace

std::unique_ptr<Module> make_resnet(int depth, int64_t in_channels, int64_t num_classes) {
  static const int r18[4] = {2, 2, 2, 2}, r34[4] = {3, 4, 6, 3}, r50[4] = {3, 4, 6, 3},
                   r101[4] = {3, 4, 23, 3}, r152[4] = {3, 8, 36, 3};
  switch (depth) {
    case 18: return build_resnet<BasicBlock>(r18, in_channels, num_classes);
    case 34: return build_resnet<BasicBlock>(r34, in_channels, num_classes);
    case 50: return build_resnet<Bottleneck>(r50, in_channels, num_classes);
    case 101: return build_resnet<Bottleneck>(r101, in_channels, num_classes);
    case 152: return build_resnet<Bottleneck>(r152, in_channels, num_classes);
    default: throw UsageError(fmt::format("no ResNet of depth {} (18, 34, 50, 101, 152)", depth));
  }
}

}  // namespace replica
