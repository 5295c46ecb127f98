// Two differences that are not bugs, each beside the input noise a GPU test holds it to, from the
// default init and with the residual branches damped (tests/dp_reference.h,
// damp_residual_branches, 0.1): one SGD step's update drift (relative L2 against the reference's).
// - another order of sums: the last two stages' convolutions through im2col's columns instead of the
//   plane matrix (REPLICA_PLANE_MATRIX=0), bf16, against bf16 input noise of 2^-9 (the shape of
//   test_cuda_bf16_storage's GPU-against-CPU step, where the GPU sums in other orders);
// - rounding of every operand: bf16 against fp32, against fp32 input noise of 2^-9 (the shape of
//   test_cuda_precision's TF32 step at batch 8, TF32 against fp32 with noise of 2^-11).
// CPU; built as step-chaos.cpp beside it says.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <utility>

#include "dp_reference.h"
#include "env_guard.h"

using namespace replica;

TEST_CASE("another order of sums, and rounding every operand, against input noise") {
  const Device cpu{DeviceType::CPU, 0, 0};
  const std::pair<const char*, int64_t> models[] = {{"resnet18", 16}, {"resnet18", 8},
                                                    {"resnet50", 16}};
  for (const auto& [model, batch_size] : models)
    for (float gamma : {1.f, 0.1f}) {
      EngineOptions o = test::sgd_options(model, {1, 28, 28});
      const Batch batch = test::make_batches(o.input_shape, batch_size, 1, 6).at(0);
      auto make = [&](Precision p) {
        o.precision = p;
        auto e = make_single_device_engine(cpu, o);
        if (gamma != 1.f) test::damp_residual_branches(*e, gamma);
        return e;
      };
      auto noise_drifts = [&](TrainEngine& ref, const std::vector<float>& before, Precision p) {
        std::string out;
        for (uint32_t draw = 1; draw <= 3; ++draw) {
          auto noisy = make(p);
          noisy->train_step(test::perturbed(batch, 1.f / 512, draw));
          out += " " + std::to_string(test::update_drift(ref, *noisy, before));
        }
        return out;
      };
      std::printf("%s 1x28x28 batch %lld, block gammas %g\n", model, (long long)batch_size, gamma);
      auto bf16 = make(Precision::Bf16);
      const std::vector<float> before = test::params_of(*bf16);
      bf16->train_step(batch);
      auto reordered = make(Precision::Bf16);
      {
        const test::ScopedEnv im2col("REPLICA_PLANE_MATRIX", "0");
        reordered->train_step(batch);
      }
      std::printf("  bf16, the last two stages summed through im2col: %.3g; bf16 noise:%s\n",
                  test::update_drift(*bf16, *reordered, before),
                  noise_drifts(*bf16, before, Precision::Bf16).c_str());
      auto fp32 = make(Precision::Fp32);
      fp32->train_step(batch);
      std::printf("  bf16 against fp32: %.3g; fp32 noise:%s\n",
                  test::update_drift(*fp32, *bf16, before),
                  noise_drifts(*fp32, before, Precision::Fp32).c_str());
      std::fflush(stdout);
    }
}
