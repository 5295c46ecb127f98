// A device's training step run eagerly, or, with --cuda-graphs, captured once as a StepGraph
// (engine/step_graph.h) and replayed. The first steps run eagerly: they build what a step
// builds once (cuDNN plans, timed algorithms, the optimizer's state), which a capture must not
// contain. The third step is captured if the step before had the same batch shape (else the
// next such step is: an epoch's short last batch is never the one captured); from then on each
// step copies its batch into the tensors the graph reads and replays it. A batch of another
// shape runs eagerly. Where the device cannot capture the step, the run says why, once, on
// stderr, and goes on eagerly.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/step_graph.h"
#include "engine/tensor.h"

namespace replica {

class DeviceContext;

class CapturedStep {
 public:
  // The step over images x and labels y on their device; returns its mean loss (a device
  // tensor). Everything in it must be device work: it is what the graph records.
  using Body = std::function<Tensor(const Tensor& x, const Tensor& y)>;

  explicit CapturedStep(bool enabled) : enabled_(enabled) {}

  // Runs `body` over (x, y) on ctx, eagerly or by replay; returns the step's loss tensor.
  Tensor run(DeviceContext& ctx, const Tensor& x, const Tensor& y, const Body& body);

  bool captured() const { return graph_ != nullptr; }
  size_t nodes() const { return graph_ ? graph_->nodes() : 0; }
  int64_t replays() const { return replays_; }

  static constexpr int kEagerSteps = 2;  // run before the capture

 private:
  bool capture(DeviceContext& ctx, const Tensor& x, const Tensor& y, const Body& body);

  bool enabled_;
  bool refused_ = false;
  int64_t steps_ = 0, replays_ = 0;
  Tensor x_, y_, loss_;  // what the graph reads and where it leaves the loss
  Shape eager_x_, eager_y_;  // the batch shapes of the last eager step
  std::unique_ptr<StepGraph> graph_;
};

// --cuda-graphs for a run of `mode` ("single", "dp" or "ddp") over `devices`: a UsageError
// unless they are one CUDA device (DP over several devices and DDP run their steps uncaptured:
// their workers and collectives are not captured yet).
void check_cuda_graphs(const std::vector<Device>& devices, const std::string& mode);

}  // namespace replica
