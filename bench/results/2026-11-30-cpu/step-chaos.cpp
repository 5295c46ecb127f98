// How far one SGD step of a ResNet (the GPU suites' set-up: SGD lr 0.01, momentum 0.9, seed 11,
// the batch test_cuda_channels_last uses) moves when every input pixel is scaled by (1 + u),
// |u| <= noise, four draws: the loss, and the update's relative L2 against the undisturbed
// step's (tests/dp_reference.h, update_drift). Two updates that share nothing are about sqrt(2)
// apart. GAMMA=g sets the last BatchNorm's weight in every residual block to g (torchvision's
// zero_init_residual is g = 0; tests/dp_reference.h, damp_residual_branches) before the step, in
// the reference and in every draw alike.
// CPU, the engine's API. Built against a build/ tree as a doctest case:
//   c++ -O2 -march=native -std=gnu++17 -DFMT_SHARED -I tests -I . -I build/generated THIS \
//     build/tests/CMakeFiles/replica_doctest_main.dir/Unity/unity_0_cxx.cxx.o -o chaos \
//     -Wl,-rpath,build/lib -Lbuild/lib -lreplica_parallel -lreplica_layers -lreplica_engine \
//     -ltbb -lfmt /usr/lib/libgloo.so.0.5.0
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dp_reference.h"
#include "parallel/engines/train_engine.h"

using namespace replica;

TEST_CASE("one step's loss and update under rounding-sized input noise") {
  const Device cpu{DeviceType::CPU, 0, 0};
  struct Config {
    std::string model;
    Shape shape;
    int64_t batch;
    Precision precision;
    float noise;
  };
  const char* gamma_env = std::getenv("GAMMA");
  const Config configs[] = {{"resnet50", {3, 32, 32}, 16, Precision::Bf16, 1.f / 512},
                            {"resnet50", {3, 32, 32}, 16, Precision::Fp32, 1.f / 512},
                            {"resnet50", {3, 32, 32}, 16, Precision::Fp32, 1.f / 65536},
                            {"resnet50", {3, 64, 64}, 16, Precision::Bf16, 1.f / 512},
                            {"resnet50", {3, 32, 32}, 64, Precision::Bf16, 1.f / 512},
                            {"resnet18", {1, 28, 28}, 16, Precision::Bf16, 1.f / 512}};
  for (const Config& c : configs) {
    if (gamma_env && c.model != "resnet50") continue;
    EngineOptions o = test::sgd_options(c.model, c.shape);
    o.precision = c.precision;
    const Batch batch = test::make_batches(o.input_shape, c.batch, 1, 6).at(0);
    auto prepared = [&] {
      auto e = make_single_device_engine(cpu, o);
      if (gamma_env) test::damp_residual_branches(*e, float(std::atof(gamma_env)));
      return e;
    };
    auto ref = prepared();
    const std::vector<float> before = test::params_of(*ref);
    ref->train_step(batch);
    std::printf("%s %s batch %lld %s, noise %g%s: loss %.5f\n", c.model.c_str(),
                shape_str(c.shape).c_str(), (long long)c.batch, precision_name(c.precision),
                c.noise, gamma_env ? (std::string(", block gammas ") + gamma_env).c_str() : "",
                ref->last_loss());
    for (uint32_t draw = 1; draw <= 4; ++draw) {
      auto noisy = prepared();
      noisy->train_step(test::perturbed(batch, c.noise, draw));
      std::printf("  draw %u: loss %.5f (%+.2f%%), update drift %.3g\n", draw, noisy->last_loss(),
                  100 * (noisy->last_loss() - ref->last_loss()) / ref->last_loss(),
                  test::update_drift(*ref, *noisy, before));
      std::fflush(stdout);
    }
  }
}
