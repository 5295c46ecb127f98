// CUDA vs CPU for whole training steps: the same model, seed and batches on both backends give
// the same loss and parameters within float tolerance. Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "dp_reference.h"
#include "gpu_skip.h"
#include "engine/data/dataset.h"
#include "engine/device.h"
#include "parallel/train_engine.h"

using namespace replica;

namespace {

void compare_training(const std::string& model, const Shape& shape, const std::string& optimizer,
                      int steps, double rel_tol) {
  EngineOptions o;
  o.model = model;
  o.input_shape = shape;
  o.optimizer.name = optimizer;
  o.optimizer.lr = optimizer == "sgd" ? 0.01f : 1e-3f;
  o.optimizer.momentum = optimizer == "sgd" ? 0.9f : 0.f;
  o.seed = 11;
  o.deterministic = true;
  auto cpu = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  auto gpu = make_single_device_engine(Device{DeviceType::CUDA, 0, 0}, o);
  auto data = make_synthetic(8 * steps, shape, 10, 5);
  Loader loader(*data, 8, false);
  loader.start_epoch(epoch_order(data->size(), 1, 0, true), 0);
  for (int s = 0; s < steps; ++s) {
    auto batch = loader.next();
    REQUIRE(bool(batch));
    cpu->train_step(*batch);
    gpu->train_step(*batch);
    gpu->synchronize();
    float lc = cpu->last_loss(), lg = gpu->last_loss();
    CAPTURE(s);
    CHECK(std::fabs(lc - lg) <= 1e-4 * std::max(1.f, std::fabs(lc)));
  }
  auto pc = test::params_of(*cpu), pg = test::params_of(*gpu);
  REQUIRE(pc.size() == pg.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < pc.size(); ++i) {
    num += (pc[i] - pg[i]) * double(pc[i] - pg[i]);
    den += double(pc[i]) * pc[i];
  }
  CHECK(std::sqrt(num / std::max(den, 1e-30)) < rel_tol);
}

}  // namespace

TEST_CASE("cnn: 5 SGD-momentum steps agree on CPU and CUDA") {
  if (!test::have_gpu()) return;
  compare_training("cnn", {1, 28, 28}, "sgd", 5, 1e-5);
}

TEST_CASE("cnn: 5 Adam steps agree on CPU and CUDA") {
  if (!test::have_gpu()) return;
  compare_training("cnn", {1, 28, 28}, "adam", 5, 1e-4);
}

TEST_CASE("resnet18 (28x28, BatchNorm): 3 SGD steps agree on CPU and CUDA") {
  if (!test::have_gpu()) return;
  compare_training("resnet18", {1, 28, 28}, "sgd", 3, 1e-4);
}
