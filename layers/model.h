// Model: a root module plus the flat buffers its parameters, gradients and buffers live in.
// materialize() allocates them on one device and initialises every parameter from the seed
// with a host RNG, in registration order, so every replica starts bit-identical.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "layers/module.h"

namespace replica {

struct ModelSpec {
  std::string name;         // "cnn", "resnet18", ...
  Shape input_shape;        // per sample, e.g. {1, 28, 28}
  int64_t num_classes = 10;
};

class Model {
 public:
  Model(ModelSpec spec, std::unique_ptr<Module> root);

  // Allocates flat buffers on ctx's device and fills them from `seed`. Call once.
  void materialize(DeviceContext& ctx, uint64_t seed);

  // In training mode it also notes what the forward left in use on ctx's device
  // (forward_kept_bytes).
  Tensor forward(DeviceContext& ctx, const Tensor& x);
  Tensor backward(DeviceContext& ctx, const Tensor& dy) { return root_->backward(ctx, dy); }
  void set_training(bool training) { root_->set_training(training); }
  // Called after each module's backward with the parameters whose gradients are final.
  void set_grad_hook(GradHook hook);
  void zero_grad(DeviceContext& ctx);

  const ModelSpec& spec() const { return spec_; }
  Module& root() { return *root_; }
  const std::vector<Param*>& params() const { return params_; }
  const std::vector<Buffer*>& buffers() const { return buffers_; }
  Tensor& flat_params() { return flat_params_; }
  Tensor& flat_grads() { return flat_grads_; }
  Tensor& flat_buffers() { return flat_buffers_; }  // may be empty (numel 0)
  int64_t num_params() const { return num_params_; }
  int64_t num_buffer_elements() const { return num_buffer_elements_; }
  // Multiply-adds of one forward pass over `batch` samples (measured from the last forward).
  double last_forward_macs() const { return root_->last_forward_macs(); }
  // The most bytes a training forward has left in use on its device, over the training
  // forwards so far (0 before the first): the activations and statistics kept for backward,
  // and the output. Layers release what they kept in their backward, so it is the bytes in use
  // after the forward less those before it.
  int64_t forward_kept_bytes() const { return forward_kept_bytes_; }
  std::string summary() const;  // one line: name, parameters, input shape

 private:
  ModelSpec spec_;
  std::unique_ptr<Module> root_;
  std::vector<Param*> params_;
  std::vector<Buffer*> buffers_;
  GradHook hook_;
  Tensor flat_params_, flat_grads_, flat_buffers_;
  int64_t num_params_ = 0, num_buffer_elements_ = 0;
  int64_t forward_kept_bytes_ = 0;
};

// The model zoo. Names: cnn, resnet18, resnet34, resnet50, resnet101, resnet152.
// input_shape picks the variant: {1, 28, 28} gives the MNIST ResNets (1-channel 7x7 stride-2
// conv1), {3, 224, 224} the standard ones. Errors (UsageError) for unknown names.
std::unique_ptr<Model> make_model(const std::string& name, const Shape& input_shape,
                                  int64_t num_classes);
std::vector<std::string> model_names();
// A UsageError naming the known models unless `name` is one (make_model's own check, also run
// by the programs before they start anything, such as the ranks of a DDP job).
void check_model_name(const std::string& name);

// Tutorial CNN: conv 1->20 5x5, ReLU, conv 20->20 5x5, ReLU, maxpool 2, flatten,
// fc -> 50, ReLU, fc -> classes. fc1's input is sized from the actual shape (2000 for 28x28).
std::unique_ptr<Module> make_cnn(const Shape& input_shape, int64_t num_classes);

}  // namespace replica
