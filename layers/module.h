// Module: a layer with explicit forward and backward. backward() returns the gradient of the
// input and ACCUMULATES (+=) parameter gradients, so micro-batches can accumulate. A module
// keeps what its backward needs from the last forward, so one module instance serves one
// replica. In evaluation mode (set_training(false)) it keeps nothing, so each activation is
// freed once the next layer has read it, as under PyTorch's no_grad: evaluating a batch takes
// a few activations' memory, not the whole network's. Composite modules call their children
// forward in order and backward in reverse.
//
// Parameters are declared (name, shape, initialiser) at construction; Model::materialize then
// makes every parameter a view into ONE flat value buffer and ONE flat gradient buffer.
// After a module's backward has finished writing its parameters' gradients it calls the grad
// hook with them: DP overlap and DDP bucketing build on that signal.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/ops.h"
#include "engine/tensor.h"

namespace replica {

struct Init {
  enum class Kind { Uniform, Normal, Constant } kind = Kind::Constant;
  float a = 0.f;  // Uniform: bound (values in [-a, a]); Normal: std; Constant: value
  static Init uniform(float bound) { return {Kind::Uniform, bound}; }
  static Init normal(float std) { return {Kind::Normal, std}; }
  static Init constant(float v) { return {Kind::Constant, v}; }
};

struct Param {
  std::string name;  // fully qualified after registration in a model: "layer1.0.conv1.weight"
  Shape shape;
  Init init;
  Tensor value;  // view into the model's flat parameter buffer
  Tensor grad;   // view into the model's flat gradient buffer
  int64_t offset = 0;  // element offset in the flat buffers
};

// Non-trainable state that follows the model (BatchNorm running statistics).
struct Buffer {
  std::string name;
  Shape shape;
  float initial = 0.f;
  Tensor value;  // view into the model's flat buffer of buffers
  int64_t offset = 0;
};

using GradHook = std::function<void(const std::vector<Param*>&)>;

class Module {
 public:
  virtual ~Module() = default;
  virtual std::string type() const = 0;
  virtual Tensor forward(DeviceContext& ctx, const Tensor& x) = 0;
  virtual Tensor backward(DeviceContext& ctx, const Tensor& dy) = 0;
  // backward, with the input gradient added onto `sum` (defined; returned): a residual block's
  // body adds onto its shortcut's gradient. Here: backward, then an add; a module whose op can
  // add as it writes (Conv2d, through cuDNN's beta) saves that pass.
  virtual Tensor backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum);
  // Shape of the output for an input of `in` (batch dimension included).
  virtual Shape output_shape(const Shape& in) const = 0;

  // Whether backward must produce the input gradient (false for a network's first layer).
  virtual void set_needs_input_grad(bool needed) { needs_input_grad_ = needed; }
  virtual void set_training(bool training);
  bool training() const { return training_; }
  // The children in registration order, with their names: for walking a model stage by stage
  // (tests/test_cuda_layout_walk.cpp compares each stage's output between two layouts).
  const std::vector<std::pair<std::string, std::unique_ptr<Module>>>& children() const {
    return children_;
  }
  // Multiply-adds of the last forward, this module and its children (for FLOP reports).
  virtual double last_forward_macs() const;

  // Registration order, recursively, with names qualified by the children's names.
  void collect(const std::string& prefix, std::vector<Param*>& params,
               std::vector<Buffer*>& buffers);
  void set_grad_hook(const GradHook* hook);

 protected:
  Param& add_param(const std::string& name, const Shape& shape, Init init);
  Buffer& add_buffer(const std::string& name, const Shape& shape, float initial);
  template <class M>
  M& add_child(const std::string& name, std::unique_ptr<M> child) {
    M& ref = *child;
    children_.emplace_back(name, std::move(child));
    return ref;
  }
  // Leaf modules call this at the end of backward.
  void grads_ready();

  std::vector<std::unique_ptr<Param>> params_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  const GradHook* hook_ = nullptr;
  bool needs_input_grad_ = true;
  bool training_ = true;
  double macs_ = 0;
};

// Children in order; backward in reverse. Only the first child may skip its input gradient.
class Sequential : public Module {
 public:
  Sequential() = default;
  template <class M>
  M& add(const std::string& name, std::unique_ptr<M> m) {
    return add_child(name, std::move(m));
  }
  std::string type() const override { return "Sequential"; }
  Tensor forward(DeviceContext& ctx, const Tensor& x) override;
  Tensor backward(DeviceContext& ctx, const Tensor& dy) override;
  Tensor backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum) override;
  Shape output_shape(const Shape& in) const override;
  void set_needs_input_grad(bool needed) override;
  size_t size() const { return children_.size(); }
};

}  // namespace replica
