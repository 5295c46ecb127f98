// DP equivalence on GPUs: logical devices sharing GPU 0 (cuda:0*2, cuda:0*4) and, where there
// are several, distinct GPUs, against the one-device reference on GPU 0 doing DP's arithmetic
// in DP's order. Skips visibly without a GPU.
#include <doctest/doctest.h>

#include <cstdio>

#include "dp_reference.h"
#include "gpu_skip.h"
#include "parallel/engines/dp_engine.h"

using namespace replica;

namespace {

void check(const std::string& spec, const std::string& model, const std::string& opt,
           int64_t batch) {
  EngineOptions o;
  o.model = model;
  o.input_shape = {1, 28, 28};
  o.seed = 3;
  o.deterministic = true;
  o.optimizer.name = opt;
  o.optimizer.lr = opt == "sgd" ? 0.05f : 1e-3f;
  o.optimizer.momentum = opt == "sgd" ? 0.9f : 0.f;
  const auto devices = parse_devices(spec);
  const auto batches = test::make_batches(o.input_shape, batch, 5, 100 + batch);
  auto dp = make_dp_engine(devices, o);
  for (const auto& b : batches) dp->train_step(b);
  dp->synchronize();
  const auto ref =
      test::reference_params(o, batches, int(devices.size()), false, Device{DeviceType::CUDA, 0, 0});
  CAPTURE(spec);
  CAPTURE(model);
  CAPTURE(opt);
  CAPTURE(batch);
  CHECK(test::relative_difference(ref, test::params_of(*dp)) <= 1e-5);
}

}  // namespace

TEST_CASE("DP on logical devices of GPU 0 equals the one-device reference") {
  if (!test::have_gpu()) return;
  for (const char* spec : {"cuda:0*2", "cuda:0*4"})
    for (const char* model : {"cnn", "resnet18"})
      for (const char* opt : {"sgd", "adam"})
        for (int64_t batch : {8, 9, 15}) check(spec, model, opt, batch);
}

TEST_CASE("DP on distinct GPUs equals the one-device reference") {
  if (!test::have_gpu()) return;
  if (cuda_device_count() < 2) {
    std::printf("SKIPPED: one GPU only (distinct-GPU DP needs two)\n");
    return;
  }
  for (const char* opt : {"sgd", "adam"}) check("cuda", "cnn", opt, 15);
}
