// Shared by the DP tests: run K optimizer steps of an engine over fixed batches, and the
// one-device reference that does DP's math on a single replica.
#pragma once
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/allocator.h"
#include "engine/context.h"
#include "engine/data/dataset.h"
#include "engine/data/loader.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "parallel/engines/scatter.h"
#include "parallel/engines/train_engine.h"

namespace test {

using namespace replica;

// Batches of `batch` samples from a synthetic set, as host tensors (from `alloc`).
inline std::vector<Batch> make_batches(const Shape& shape, int64_t batch, int steps,
                                       uint64_t seed, Allocator& alloc = host_allocator()) {
  auto data = make_synthetic(batch * steps, shape, 10, seed);
  std::vector<Batch> out;
  for (int s = 0; s < steps; ++s) {
    std::vector<int64_t> idx(batch);
    for (int64_t i = 0; i < batch; ++i) idx[i] = s * batch + i;
    out.push_back(read_batch(*data, idx, alloc));
  }
  return out;
}

// Trains `e` over `batches` as the training loop does: each batch is prefetched one step early
// (TrainEngine::prefetch), which stages its rows as its step will ask for them (one staging for
// one device; DP over `dp_devices`: each busy replica's images and the labels on device 0), and
// its step must take every one.
inline void train_prefetching(TrainEngine& e, const std::vector<Batch>& batches,
                              int dp_devices = 0) {
  REQUIRE(e.prefetches());
  for (size_t k = 0; k < batches.size(); ++k) {
    CAPTURE(k);
    if (k + 1 < batches.size()) {
      const Batch& next = batches[k + 1];
      e.prefetch(next);
      size_t expected = 1;
      if (dp_devices > 0)
        for (const Chunk& c : scatter_chunks(next.size(), dp_devices)) expected += c.count > 0;
      CHECK(next.staged->size() == expected);
    }
    e.train_step(batches[k]);
    CHECK(batches[k].staged->size() == 0);
  }
}

// The values of t (a tensor on e's primary device) on the host.
inline std::vector<float> host_values(TrainEngine& e, const Tensor& t) {
  Tensor h;
  e.primary().run([&] {
    h = to_host(e.primary(), t);
    e.primary().synchronize();
  });
  return std::vector<float>(h.f32(), h.f32() + h.numel());
}

inline std::vector<float> params_of(TrainEngine& e) { return host_values(e, e.model().flat_params()); }

// The one-device equivalent of DP on `devices` devices. Every step, each chunk DP would send to
// a device runs forward/backward on ONE replica (loss gradient scaled by 1/B, as DP's loss over
// the gathered batch does) into its own zeroed gradient buffer; the chunk gradients are then
// summed in the order DP's reduction sums them (to-root: 0+1+2+...; tree: pairs in rounds) and
// one optimizer step is taken. This is DP's arithmetic, association included, so agreement is
// exact; BatchNorm normalises per chunk, as in PyTorch's DataParallel.
inline std::vector<float> reference_params(const EngineOptions& o, const std::vector<Batch>& batches,
                                           int devices, bool tree = false,
                                           Device device = Device{DeviceType::CPU, 0, 0}) {
  DeviceContext ctx(device, ContextOptions{1, true, o.precision});
  auto model = make_model(o.model, o.input_shape, o.num_classes);
  model->materialize(ctx, o.seed);
  auto opt = make_optimizer(o.optimizer);
  CrossEntropyLoss ce;
  const int64_t n = model->num_params();
  for (const Batch& b : batches) {
    const int64_t total = b.size();
    std::vector<Tensor> grads;
    for (const Chunk& c : scatter_chunks(total, devices)) {
      if (c.count == 0) continue;
      model->zero_grad(ctx);
      Tensor x = b.images.slice_rows(c.begin, c.begin + c.count);
      Tensor y = b.labels.slice_rows(c.begin, c.begin + c.count);
      if (ctx.is_cuda()) {
        Tensor dx = ctx.alloc(x.shape()), dy = ctx.alloc(y.shape(), DType::I32);
        ctx.ops().copy(ctx, dx, x);
        ctx.ops().copy(ctx, dy, y);
        x = dx;
        y = dy;
      }
      Tensor logits = model->forward(ctx, x);
      ce.forward(ctx, logits, y);
      model->backward(ctx, ce.backward(ctx, total));
      Tensor g = ctx.alloc({n});
      ctx.ops().copy(ctx, g, model->flat_grads());
      grads.push_back(g);
    }
    const int active = static_cast<int>(grads.size());
    if (!tree) {
      for (int r = 1; r < active; ++r) ctx.ops().add(ctx, grads[0], grads[r], 1.f);
    } else {
      for (int stride = 1; stride < active; stride *= 2)
        for (int r = 0; r + stride < active; r += 2 * stride)
          ctx.ops().add(ctx, grads[r], grads[r + stride], 1.f);
    }
    ctx.ops().copy(ctx, model->flat_grads(), grads[0]);
    opt->step(ctx, model->flat_params(), model->flat_grads());
  }
  const Tensor host = to_host(ctx, model->flat_params());
  ctx.synchronize();
  return std::vector<float>(host.f32(), host.f32() + host.numel());
}

// The GPU suites' training set-up: `model` on `shape`, SGD (lr 0.01, momentum 0.9), seed 11,
// deterministic algorithms.
inline EngineOptions sgd_options(const std::string& model, const Shape& shape) {
  EngineOptions o;
  o.model = model;
  o.input_shape = shape;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.01f;
  o.optimizer.momentum = 0.9f;
  o.seed = 11;
  o.deterministic = true;
  return o;
}

// Trains `a` and `b` on the same batches, step by step: `before(engine, k)` on each ahead of
// step k (e.g. a learning-rate schedule; may be empty), an evaluation of both on `eval` after
// step 3 (between captured steps: it may outgrow buffers a graph replays into), and
// `after(k)` once both took step k (the caller's checks).
inline void train_side_by_side(TrainEngine& a, TrainEngine& b, const std::vector<Batch>& batches,
                               const Batch& eval,
                               const std::function<void(TrainEngine&, size_t)>& before,
                               const std::function<void(size_t)>& after) {
  for (size_t k = 0; k < batches.size(); ++k) {
    CAPTURE(k);
    for (TrainEngine* e : {&a, &b}) {
      if (before) before(*e, k);
      e->train_step(batches[k]);
      if (k == 3) {
        EvalSums sums;
        e->set_training(false);
        e->eval_batch(eval, sums);
        e->set_training(true);
      }
    }
    after(k);
  }
}

// Trains `a` and `b` side by side for `steps` steps on the same synthetic batches of `batch`
// samples (data seed `data_seed`, one shuffled epoch); after every step their losses must agree
// within `loss_rtol` (relative, scale at least 1). Returns the losses as [step] = {a, b}.
inline std::vector<std::pair<float, float>> train_in_lockstep(TrainEngine& a, TrainEngine& b,
                                                              const Shape& shape, int steps,
                                                              int64_t batch, uint64_t data_seed,
                                                              double loss_rtol) {
  auto data = make_synthetic(batch * steps, shape, 10, data_seed);
  Loader loader(*data, batch, false);
  loader.start_epoch(epoch_order(data->size(), 1, 0, true), 0);
  std::vector<std::pair<float, float>> losses;
  for (int s = 0; s < steps; ++s) {
    auto next = loader.next();
    REQUIRE(bool(next));
    a.train_step(*next);
    b.train_step(*next);
    const float la = a.last_loss(), lb = b.last_loss();
    CAPTURE(s);
    CHECK(std::fabs(la - lb) <= loss_rtol * std::max(1.f, std::fabs(la)));
    losses.emplace_back(la, lb);
  }
  return losses;
}

// ||a-b|| / ||a||: the relative error of a whole parameter vector.
inline double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;  // fails every tolerance
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * double(a[i] - b[i]);
    den += double(a[i]) * a[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// How far `b`'s training moved the parameters from where `a`'s did, relative to `a`'s move (both
// started at `before`): a precision's effect on the update, which comparing parameters would
// hide under the parameters' own size.
inline double update_drift(TrainEngine& a, TrainEngine& b, const std::vector<float>& before) {
  auto update = [&](TrainEngine& e) {
    std::vector<float> u = params_of(e);
    for (size_t i = 0; i < u.size(); ++i) u[i] -= before[i];
    return u;
  };
  return relative_l2(update(a), update(b));
}

// b with every pixel scaled by (1 + u), u uniform in [-rel, rel]: rounding-sized noise, to hold a
// precision's or a device's effect on training against what rounding alone does to the model.
inline Batch perturbed(const Batch& b, float rel, uint32_t seed) {
  Batch p = b;
  p.images = Tensor::empty(host_allocator(), b.images.shape());
  p.copies = std::make_shared<PendingCopies>();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-rel, rel);
  for (int64_t i = 0; i < b.images.numel(); ++i)
    p.images.f32()[i] = b.images.f32()[i] * (1.f + u(rng));
  return p;
}

// Sets the weight of each residual block's last BatchNorm (the one before the sum with the
// shortcut) to `gamma`, in `model` on ctx's device, or in an engine's replicas; torchvision's
// zero_init_residual does it with 0. From the default init a ResNet-50's SGD step is chaotic: on
// the CPU, noise of 2^-16 on the input pixels moves its update by 9% (relative L2) and noise of
// 2^-9 by 90-140%, and one bf16 ulp at 14 of the stem's outputs moves its loss by 2.7%. With 0.1
// the same noise moves the update by 0.1-1.2% and 8-22%, and those ulps the loss by 0.04%
// (bench/results/2026-11-30-cpu.md): two steps compared then differ by what their arithmetic does.
// Every layer still has a gradient (with 0 the blocks' bodies get none).
inline constexpr float kDampedBlockGamma = 0.1f;

// The qualified names of the last BatchNorm weights of the residual blocks under `m` (at
// `path`). A block registers its body, unnamed, then that BatchNorm (layers/resnet.h): it is
// the child after an unnamed one. Parameter names skip the unnamed level, as collect() does.
inline void last_block_bn_weights(const Module& m, const std::string& path,
                                  std::set<std::string>& out) {
  const auto& children = m.children();
  if (children.size() > 1 && children[0].first.empty())
    out.insert(path + "." + children[1].first + ".weight");
  for (const auto& [name, child] : children)
    if (!name.empty()) last_block_bn_weights(*child, path.empty() ? name : path + "." + name, out);
}

inline void damp_residual_branches(Model& model, DeviceContext& ctx, float gamma) {
  std::set<std::string> weights;
  last_block_bn_weights(model.root(), "", weights);
  REQUIRE(!weights.empty());  // a ResNet
  size_t damped = 0;
  for (Param* p : model.params())
    if (weights.count(p->name)) {
      ctx.ops().fill(ctx, p->value, gamma);
      ++damped;
    }
  REQUIRE(damped == weights.size());
}
inline void damp_residual_branches(TrainEngine& e, float gamma = kDampedBlockGamma) {
  damp_residual_branches(e.model(), e.primary(), gamma);
  e.state_loaded();
}

// One SGD step of `ref`, `other` and `noisy` (ref's set-up) from the same parameters on `batch`,
// noisy's pixels scaled by (1 + u), |u| <= noise: how far other's update is from ref's, beside
// how far that rounding-sized noise alone moves it (update_drift), losses and drifts printed
// under `what`. For models where any change of rounding flips routes (ResNets at 28x28: max
// pools, BatchNorms over few values), so that only a bar set by the model's own noise holds.
struct NoiseDrift {
  double drift, noise_drift;
};
inline NoiseDrift step_against_noise(TrainEngine& ref, TrainEngine& other, TrainEngine& noisy,
                                     const Batch& batch, float noise, const std::string& what) {
  const std::vector<float> before = params_of(ref);
  ref.train_step(batch);
  other.train_step(batch);
  noisy.train_step(perturbed(batch, noise, 1));
  MESSAGE(what << " loss: reference " << ref.last_loss() << ", compared " << other.last_loss()
               << ", reference on noisy input " << noisy.last_loss());
  CHECK(std::fabs(ref.last_loss() - other.last_loss()) <= 1e-2 * ref.last_loss());
  const NoiseDrift d{update_drift(ref, other, before), update_drift(ref, noisy, before)};
  MESSAGE(what << ": update, relative L2 against the reference's: compared " << d.drift
               << ", input noise of " << noise << " " << d.noise_drift);
  CHECK(d.noise_drift > 0);  // the noise reached the update: the bar is not zero
  return d;
}

// The CNN (sgd_options) trained `steps` steps on `device` in fp32 and in `precision` side by
// side (train_in_lockstep, each step's losses printed); returns update_drift of `precision`
// against fp32.
inline double precision_update_drift(const Device& device, Precision precision, int steps,
                                     int64_t batch, double loss_rtol) {
  EngineOptions o = sgd_options("cnn", {1, 28, 28});
  auto fp32 = make_single_device_engine(device, o);
  o.precision = precision;
  auto other = make_single_device_engine(device, o);
  const std::vector<float> before = params_of(*fp32);
  const auto losses = train_in_lockstep(*fp32, *other, o.input_shape, steps, batch, 6, loss_rtol);
  const std::string name = precision_name(precision);
  for (size_t s = 0; s < losses.size(); ++s)
    MESSAGE("cnn step " << s << ": loss fp32 " << losses[s].first << ", " << name << " "
                        << losses[s].second);
  const double drift = update_drift(*fp32, *other, before);
  MESSAGE("cnn: update after " << steps << " steps, relative L2 " << name << " vs fp32: " << drift);
  return drift;
}

// `model` (sgd_options, 1x28x28) trained `steps` steps in `precision` on the CPU and on `device`
// side by side (train_in_lockstep, each step's losses printed): the parameters' relative L2
// between the two, and their updates' (update_drift: a few steps move parameters by about 1e-3
// of their size, under which a wrong gradient can hide in the first figure, not the second).
struct DeviceDrift {
  double params, update;
};
inline DeviceDrift device_vs_cpu_drift(const Device& device, const std::string& model,
                                       Precision precision, int steps, int64_t batch,
                                       double loss_rtol) {
  EngineOptions o = sgd_options(model, {1, 28, 28});
  o.precision = precision;
  auto cpu = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  auto other = make_single_device_engine(device, o);
  const std::vector<float> before = params_of(*cpu);
  const auto losses = train_in_lockstep(*cpu, *other, o.input_shape, steps, batch, 6, loss_rtol);
  const std::string name = precision_name(precision);
  for (size_t s = 0; s < losses.size(); ++s)
    MESSAGE(model << " step " << s << ": loss CPU " << name << " " << losses[s].first << ", "
                  << device.str() << " " << losses[s].second);
  const DeviceDrift d{relative_l2(params_of(*cpu), params_of(*other)),
                      update_drift(*cpu, *other, before)};
  MESSAGE(model << " after " << steps << " steps, " << device.str() << " vs CPU (both " << name
                << "): parameters' relative L2 " << d.params << ", updates' " << d.update);
  return d;
}

// max |a-b| / max |a|: a relative error over the whole parameter vector.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(a[i])));
  }
  return diff / std::max(scale, 1e-30);
}

}  // namespace test
