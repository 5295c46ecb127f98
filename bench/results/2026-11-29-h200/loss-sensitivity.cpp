// How far one step's loss of ResNet-50 bf16 (3x32x32, batch 16, the training case's seed and
// batch) moves when its stem's output changes by a few bf16 ulps, against rounding-sized input
// noise: CPU, the Module API. Built against a build/ tree as a doctest case:
//   c++ -O2 -march=native -std=gnu++17 -DFMT_SHARED -I tests -I . -I build/generated THIS \
//     build/tests/CMakeFiles/replica_doctest_main.dir/Unity/unity_0_cxx.cxx.o -o sensitivity \
//     -Wl,-rpath,build/lib -Lbuild/lib -lreplica_parallel -lreplica_layers -lreplica_engine \
//     -ltbb -lfmt /usr/lib/libgloo.so.0.5.0
#include <doctest/doctest.h>
#include <cstdio>
#include <random>
#include "dp_reference.h"
#include "engine/context.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "parallel/engines/train_engine.h"
using namespace replica;
void run_chaos() {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2, true, Precision::Bf16});
  const EngineOptions o = test::sgd_options("resnet50", {3, 32, 32});
  auto m = make_model("resnet50", {3, 32, 32}, 10);
  m->materialize(ctx, o.seed);
  const Batch batch = test::make_batches(o.input_shape, 16, 1, 6).at(0);
  auto loss_of = [&](const Tensor& images, int flips, uint32_t seed) {
    Module& root = m->root();
    Tensor h = images;
    for (size_t k = 0; k < root.children().size(); ++k) {
      h = root.children()[k].second->forward(ctx, h);
      if (k == 0 && flips > 0) {
        std::mt19937 rng(seed);
        std::uniform_int_distribution<int64_t> at(0, h.numel() - 1);
        for (int f = 0; f < flips; ++f) {
          uint16_t& b = h.bf16()[at(rng)];
          b = uint16_t(b + ((rng() & 1) ? 1 : -1));
        }
      }
    }
    CrossEntropyLoss ce;
    Tensor l = ce.forward(ctx, h, batch.labels);
    return double(l.f32()[0]);
  };
  const double base = loss_of(batch.images, 0, 0);
  std::printf("base %.5f\n", base);
  for (int flips : {1, 2, 8, 64})
    for (uint32_t s = 1; s <= 5; ++s)
      std::printf("flips %d seed %u: %.5f (%+.4f)\n", flips, s, loss_of(batch.images, flips, s),
                  loss_of(batch.images, flips, s) - base);
  for (uint32_t s = 1; s <= 5; ++s) {
    const Batch p = test::perturbed(batch, 1.f / 512, s);
    const double l = loss_of(p.images, 0, 0);
    std::printf("input noise 1/512 seed %u: %.5f (%+.4f)\n", s, l, l - base);
  }
}
TEST_CASE("chaos") { run_chaos(); }
