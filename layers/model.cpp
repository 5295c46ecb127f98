#include "layers/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/error.h"
#include "layers/resnet.h"

namespace replica {

namespace {

// xoshiro256** seeded through splitmix64: portable, so every machine initialises alike.
class InitRng {
 public:
  explicit InitRng(uint64_t seed) {
    for (auto& s : s_) {
      seed += 0x9E3779B97F4A7C15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      s = z ^ (z >> 31);
    }
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  double normal() {  // Box-Muller
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace

Model::Model(ModelSpec spec, std::unique_ptr<Module> root)
    : spec_(std::move(spec)), root_(std::move(root)) {
  root_->collect("", params_, buffers_);
  for (auto* p : params_) {
    p->offset = num_params_;
    num_params_ += shape_numel(p->shape);
  }
  for (auto* b : buffers_) {
    b->offset = num_buffer_elements_;
    num_buffer_elements_ += shape_numel(b->shape);
  }
  // The first layer never needs the gradient of the input images.
  root_->set_needs_input_grad(false);
}

void Model::materialize(DeviceContext& ctx, uint64_t seed) {
  REPLICA_CHECK(!flat_params_.defined(), "model already materialized");
  flat_params_ = ctx.alloc({num_params_});
  flat_grads_ = ctx.alloc({num_params_});
  flat_buffers_ = ctx.alloc({num_buffer_elements_});
  Tensor host_params = Tensor::empty(host_allocator(), {num_params_});
  Tensor host_buffers = Tensor::empty(host_allocator(), {num_buffer_elements_});
  InitRng rng(seed);
  for (auto* p : params_) {
    float* dst = host_params.f32() + p->offset;
    int64_t n = shape_numel(p->shape);
    for (int64_t i = 0; i < n; ++i) {
      switch (p->init.kind) {
        case Init::Kind::Uniform: dst[i] = float((2.0 * rng.uniform() - 1.0) * p->init.a); break;
        case Init::Kind::Normal: dst[i] = float(rng.normal() * p->init.a); break;
        case Init::Kind::Constant: dst[i] = p->init.a; break;
      }
    }
    p->value = flat_params_.view(p->offset, p->shape);
    p->grad = flat_grads_.view(p->offset, p->shape);
  }
  for (auto* b : buffers_) {
    float* dst = host_buffers.f32() + b->offset;
    std::fill(dst, dst + shape_numel(b->shape), b->initial);
    b->value = flat_buffers_.view(b->offset, b->shape);
  }
  ctx.ops().copy(ctx, flat_params_, host_params);
  ctx.ops().copy(ctx, flat_buffers_, host_buffers);
  ctx.ops().fill(ctx, flat_grads_, 0.f);
  ctx.synchronize();  // the host staging tensors die here
}

Tensor Model::forward(DeviceContext& ctx, const Tensor& x) {
  if (!root_->training()) return root_->forward(ctx, x);
  const int64_t before = int64_t(ctx.allocator().bytes_in_use());
  Tensor y = root_->forward(ctx, x);
  const int64_t kept = int64_t(ctx.allocator().bytes_in_use()) - before;
  forward_kept_bytes_ = std::max(forward_kept_bytes_, kept);
  return y;
}

void Model::set_grad_hook(GradHook hook) {
  hook_ = std::move(hook);
  root_->set_grad_hook(hook_ ? &hook_ : nullptr);
}

void Model::zero_grad(DeviceContext& ctx) { ctx.ops().fill(ctx, flat_grads_, 0.f); }

std::string Model::summary() const {
  return fmt::format("{}: {:.2f}M parameters, input {}, {} classes", spec_.name,
                     num_params_ / 1e6, shape_str(spec_.input_shape), spec_.num_classes);
}

std::unique_ptr<Module> make_cnn(const Shape& input_shape, int64_t num_classes) {
  REPLICA_USAGE_CHECK(input_shape.size() == 3, "cnn needs CxHxW input, got {}",
                      shape_str(input_shape));
  auto net = std::make_unique<Sequential>();
  net->add("conv1", std::make_unique<Conv2d>(input_shape[0], 20, 5));
  net->add("relu1", std::make_unique<ReLU>());
  net->add("conv2", std::make_unique<Conv2d>(20, 20, 5));
  net->add("relu2", std::make_unique<ReLU>());
  net->add("pool", std::make_unique<MaxPool2d>(2, 2));
  net->add("flatten", std::make_unique<Flatten>());
  Shape probe = {1, input_shape[0], input_shape[1], input_shape[2]};
  int64_t features = net->output_shape(probe)[1];
  net->add("fc1", std::make_unique<Linear>(features, 50));
  net->add("relu3", std::make_unique<ReLU>());
  net->add("fc2", std::make_unique<Linear>(50, num_classes));
  return net;
}

void check_model_name(const std::string& name) {
  const std::vector<std::string> names = model_names();
  REPLICA_USAGE_CHECK(std::find(names.begin(), names.end(), name) != names.end(),
                      "unknown model '{}' (choose from: {})", name, fmt::join(names, ", "));
}

std::vector<std::string> model_names() {
  return {"cnn", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"};
}

std::unique_ptr<Model> make_model(const std::string& name, const Shape& input_shape,
                                  int64_t num_classes) {
  REPLICA_USAGE_CHECK(num_classes >= 2, "a classifier needs at least 2 classes");
  // Far above any dataset's (ImageNet-21k: 21,841), and the last layer's weights, gradients and
  // Adam state at 2^20 classes are already gigabytes: 10^8 classes filled the host's memory.
  REPLICA_USAGE_CHECK(num_classes <= (int64_t(1) << 20),
                      "a classifier of {} classes: at most 1048576 (2^20)", num_classes);
  REPLICA_USAGE_CHECK(input_shape.size() == 3 && input_shape[0] > 0 && input_shape[1] > 0 &&
                          input_shape[2] > 0,
                      "model input must be CxHxW, got {}", shape_str(input_shape));
  check_model_name(name);
  std::unique_ptr<Module> root = name == "cnn"
                                     ? make_cnn(input_shape, num_classes)
                                     : make_resnet(std::stoi(name.substr(6)), input_shape.at(0),
                                                   num_classes);
  return std::make_unique<Model>(ModelSpec{name, input_shape, num_classes}, std::move(root));
}

}  // namespace replica
