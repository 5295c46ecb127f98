#include "layers/module.h"

#include <iterator>

#include "engine/context.h"
#include "engine/error.h"

namespace replica {

void Module::set_training(bool training) {
  training_ = training;
  for (auto& [name, child] : children_) child->set_training(training);
}

double Module::last_forward_macs() const {
  double total = macs_;
  for (const auto& [name, child] : children_) total += child->last_forward_macs();
  return total;
}

void Module::collect(const std::string& prefix, std::vector<Param*>& params,
                     std::vector<Buffer*>& buffers) {
  for (auto& p : params_) {
    p->name = prefix + p->name.substr(p->name.rfind('.') + 1);
    params.push_back(p.get());
  }
  for (auto& b : buffers_) {
    b->name = prefix + b->name.substr(b->name.rfind('.') + 1);
    buffers.push_back(b.get());
  }
  // A child registered under "" (a block's body) adds no level to the names.
  for (auto& [name, child] : children_)
    child->collect(name.empty() ? prefix : prefix + name + ".", params, buffers);
}

void Module::set_grad_hook(const GradHook* hook) {
  hook_ = hook;
  for (auto& [name, child] : children_) child->set_grad_hook(hook);
}

Param& Module::add_param(const std::string& name, const Shape& shape, Init init) {
  params_.push_back(std::make_unique<Param>());
  Param& p = *params_.back();
  p.name = name;
  p.shape = shape;
  p.init = init;
  return p;
}

Buffer& Module::add_buffer(const std::string& name, const Shape& shape, float initial) {
  buffers_.push_back(std::make_unique<Buffer>());
  Buffer& b = *buffers_.back();
  b.name = name;
  b.shape = shape;
  b.initial = initial;
  return b;
}

Tensor Module::backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum) {
  REPLICA_CHECK(sum.defined(), "{}: backward_adding onto an undefined sum", type());
  Tensor g = backward(ctx, dy);
  if (g.defined()) ctx.ops().add(ctx, sum, g, 1.f);
  return sum;
}

void Module::grads_ready() {
  if (!hook_ || params_.empty()) return;
  std::vector<Param*> ready;
  for (auto& p : params_) ready.push_back(p.get());
  (*hook_)(ready);
}

Tensor Sequential::forward(DeviceContext& ctx, const Tensor& x) {
  Tensor h = x;
  for (auto& [name, child] : children_) h = child->forward(ctx, h);
  return h;
}

Tensor Sequential::backward(DeviceContext& ctx, const Tensor& dy) {
  Tensor g = dy;
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) g = it->second->backward(ctx, g);
  return g;
}

Tensor Sequential::backward_adding(DeviceContext& ctx, const Tensor& dy, Tensor sum) {
  if (children_.empty()) return Module::backward_adding(ctx, dy, std::move(sum));
  Tensor g = dy;
  for (auto it = children_.rbegin(); it != std::prev(children_.rend()); ++it)
    g = it->second->backward(ctx, g);
  return children_.front().second->backward_adding(ctx, g, std::move(sum));
}

Shape Sequential::output_shape(const Shape& in) const {
  Shape s = in;
  for (const auto& [name, child] : children_) s = child->output_shape(s);
  return s;
}

void Sequential::set_needs_input_grad(bool needed) {
  needs_input_grad_ = needed;
  if (!children_.empty()) children_.front().second->set_needs_input_grad(needed);
}

}  // namespace replica
