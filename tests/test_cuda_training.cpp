// CUDA vs CPU for whole training steps: the same model, seed and batches on both backends give
// the same loss, gradients and parameters within float tolerance. Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "dp_reference.h"
#include "gpu_skip.h"
#include "engine/data/dataset.h"
#include "engine/device.h"
#include "parallel/engines/captured_step.h"
#include "parallel/engines/train_engine.h"

using namespace replica;

namespace {

void compare_training(const std::string& model, const Shape& shape, const std::string& optimizer,
                      int steps, double rel_tol, bool timed_algorithms = false) {
  EngineOptions o = test::sgd_options(model, shape);
  if (optimizer == "adam") {
    o.optimizer.name = "adam";
    o.optimizer.lr = 1e-3f;
    o.optimizer.momentum = 0.f;
  }
  auto cpu = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  o.cudnn_benchmark = timed_algorithms;
  o.deterministic = !timed_algorithms;  // a context refuses the two together
  auto gpu = make_single_device_engine(Device{DeviceType::CUDA, 0, 0}, o);
  REQUIRE(gpu->contexts().at(0)->cudnn_benchmark() == timed_algorithms);
  test::train_in_lockstep(*cpu, *gpu, shape, steps, 8, 5, 1e-4);
  CHECK(test::relative_l2(test::params_of(*cpu), test::params_of(*gpu)) < rel_tol);
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

// --cudnn-benchmark changes which algorithms run, not the math (still fp32, no TF32), but their
// summation order is whichever was fastest when timed. On an H100 the parameters after 5 steps
// were within 1e-5 of the CPU's when this test ran alone, and 2.5e-4 off when it ran beside other
// GPU suites (Find timed under load picked other algorithms; every step's loss still agreed to
// 1e-4, and the CNN's max-pools turn rounding into routing, as in test_cuda_precision). So the
// losses are held to 1e-4 per step, which is what a wrong algorithm breaks, and the parameters
// to 1e-3, against drift beyond what rounding's routing gave.
TEST_CASE("cnn with timed convolution algorithms: 5 SGD-momentum steps agree on CPU and CUDA") {
  if (!test::have_gpu()) return;
  compare_training("cnn", {1, 28, 28}, "sgd", 5, 1e-3, /*timed_algorithms=*/true);
}

// ResNet-18 is checked one step at a time, per tensor. Free-running it for several steps
// cannot pass any tight tolerance: its stem max-pool follows a ReLU, and windows whose two
// largest inputs differ by about one float32 ulp (seen in the synthetic data of seed 5: 2.0548906
// against 2.0548906 - 2.55e-7) route the gradient to whichever the backend's rounding makes
// larger. Perturbing every CPU convolution output by 1e-6 relative reproduces exactly what the
// first GPU run measured for the 3-step test (loss off by 0.0059 after step 1 and 0.115 after
// step 2, parameters by 1.06%), with no backend difference at all. So: the data seed below has no
// such near-tie (its one-step gradients stayed within 2e-4 under 1e-5 perturbations), one step
// from identical parameters, every parameter's gradient within 1e-3 relative L2 (rounding alone
// gives ~1e-5), and the parameters after that step within 1e-5.
TEST_CASE("resnet18 (28x28, BatchNorm): one SGD step agrees per tensor on CPU and CUDA") {
  if (!test::have_gpu()) return;
  const EngineOptions o = test::sgd_options("resnet18", {1, 28, 28});
  auto cpu = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  auto gpu = make_single_device_engine(Device{DeviceType::CUDA, 0, 0}, o);
  auto data = make_synthetic(24, o.input_shape, 10, 6);
  Loader loader(*data, 8, false);
  loader.start_epoch(epoch_order(data->size(), 1, 0, true), 0);
  auto batch = loader.next();
  REQUIRE(bool(batch));
  cpu->train_step(*batch);
  gpu->train_step(*batch);
  gpu->synchronize();
  const float lc = cpu->last_loss(), lg = gpu->last_loss();
  CHECK(std::fabs(lc - lg) <= 1e-5 * std::max(1.f, std::fabs(lc)));

  const auto gc = test::host_values(*cpu, cpu->model().flat_grads());
  const auto gg = test::host_values(*gpu, gpu->model().flat_grads());
  std::string worst;
  double worst_rel = 0;
  for (const Param* p : cpu->model().params()) {
    double num = 0, den = 0;
    for (int64_t i = p->offset; i < p->offset + p->value.numel(); ++i) {
      num += double(gc[size_t(i)] - gg[size_t(i)]) * double(gc[size_t(i)] - gg[size_t(i)]);
      den += double(gc[size_t(i)]) * gc[size_t(i)];
    }
    const double rel = std::sqrt(num / std::max(den, 1e-30));
    CAPTURE(p->name);
    CHECK(rel < 1e-3);
    if (rel > worst_rel) {
      worst_rel = rel;
      worst = p->name;
    }
  }
  MESSAGE("largest gradient difference: " << worst << " " << worst_rel);
  CHECK(test::relative_l2(test::params_of(*cpu), test::params_of(*gpu)) < 1e-5);
}

// --cuda-graphs (CapturedStep): the step captured as a CUDA Graph after two eager steps and
// replayed ends where eager steps end: the same kernels with the same arguments, the
// optimizer's per-step numbers (a learning rate set every step, Adam's bias corrections) read
// from device memory, an epoch's short batch run eagerly in between. The same bits are
// expected with deterministic algorithms, but cuBLAS takes its workspace differently while
// captured (and may pick another kernel), so the check is a tolerance far below what a stale
// learning rate or a stale batch gives, and whether the bits agreed is reported.
// test_step_graph checks the same rules, bit for bit, on CPU devices.
TEST_CASE("cuda graphs: captured steps train as eager ones (CNN SGD, ResNet-18 Adam)") {
  if (!test::have_gpu()) return;
  struct Case {
    const char* model;
    Shape shape;
    const char* optimizer;
  };
  for (const Case& c : {Case{"cnn", {1, 28, 28}, "sgd"}, Case{"resnet18", {3, 32, 32}, "adam"}}) {
    CAPTURE(c.model);
    EngineOptions o = test::sgd_options(c.model, c.shape);
    if (std::string(c.optimizer) == "adam") {
      o.optimizer = OptimizerOptions{};
      o.optimizer.lr = 1e-3f;
    }
    const Device gpu{DeviceType::CUDA, 0, 0};
    auto eager = make_single_device_engine(gpu, o);
    o.cuda_graphs = true;
    auto captured = make_single_device_engine(gpu, o);
    auto batches = test::make_batches(c.shape, 16, 7, 3);
    batches.insert(batches.begin() + 4, test::make_batches(c.shape, 5, 1, 4)[0]);
    // An evaluation on a larger batch between replays takes larger scratch blocks than the
    // graph's, from the shared pool: the blocks the graph replays into must stay its own.
    const Batch eval = test::make_batches(c.shape, 64, 1, 21)[0];
    const float lr = o.optimizer.lr;
    test::train_side_by_side(
        *eager, *captured, batches, eval,
        [lr](TrainEngine& e, size_t k) {
          e.optimizer().set_lr(LrSchedule("cosine").at(lr, int64_t(k), 8));
        },
        [&](size_t) {
          const float le = eager->last_loss(), lc = captured->last_loss();
          CHECK(std::fabs(le - lc) <= 1e-5f * std::max(1.f, std::fabs(le)));
        });
    REQUIRE(captured->captured_step() != nullptr);
    CHECK(captured->captured_step()->captured());
    CHECK(captured->captured_step()->replays() == 5);
    const auto a = test::params_of(*eager), b = test::params_of(*captured);
    const bool same_bits = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    const std::string said =
        std::string(c.model) + ": graph of " +
        std::to_string(captured->captured_step()->nodes()) + " nodes; " +
        (same_bits ? std::string("the same bits")
                   : "parameters' relative difference " + std::to_string(test::relative_l2(a, b)));
    MESSAGE(said);
    CHECK(test::relative_l2(a, b) < 1e-5);
  }
}
