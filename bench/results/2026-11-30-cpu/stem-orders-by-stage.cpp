// ResNet-50 bf16's stem (test_cuda_channels_last's training case: seed 11, its batch) summed in
// other valid orders, as 2026-11-29-h200/stem-summation-order.cpp does, and the rest of the
// forward run from each: every stage's relative L2 against the CPU kernel's forward (each block
// of layer1..layer4, then each later module), the largest, and the loss. GAMMA=g first sets each
// residual block's last BatchNorm weight to g (tests/dp_reference.h, damp_residual_branches):
// what test_cuda_layout_walk's damped case holds every stage of to 3e-2. Built as
// step-chaos.cpp beside it says.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device_tensors.h"
#include "dp_reference.h"
#include "layers/loss.h"

using namespace replica;

TEST_CASE("the stem's summation order, stage by stage") {
  EngineOptions o = test::sgd_options("resnet50", {3, 32, 32});
  o.precision = Precision::Bf16;
  auto engine = make_single_device_engine(Device{DeviceType::CPU, 0, 0}, o);
  const char* gamma = std::getenv("GAMMA");
  if (gamma) test::damp_residual_branches(*engine, float(std::atof(gamma)));
  DeviceContext& ctx = engine->primary();
  Model& m = engine->model();
  const Batch batch = test::make_batches(o.input_shape, 16, 1, 6).at(0);
  Module& root = m.root();
  REQUIRE(m.params()[0]->name == "conv1.weight");
  const float* w = m.params()[0]->value.f32();  // [64, 3, 7, 7]
  const float* x = batch.images.f32();           // [16, 3, 32, 32]
  const Tensor y = root.children()[0].second->forward(ctx, batch.images);
  REQUIRE(y.dtype() == DType::BF16);
  const int N = 16, C = 3, H = 32, K = 64, P = 16, R = 7;
  // order 0: the products summed in double; 1: in fp32 from the last tap back
  auto stem_in_order = [&](int order) {
    Tensor alt = Tensor::empty(host_allocator(), y.shape(), y.dtype());
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < P; ++q) {
            double d = 0;
            float f = 0;
            for (int u = C * R * R - 1; u >= 0; --u) {
              const int c = u / (R * R), i = u / R % R, j = u % R;
              const int iy = p * 2 - 3 + i, ix = q * 2 - 3 + j;
              const bool in = iy >= 0 && iy < H && ix >= 0 && ix < H;
              const float term = in ? bf16_round(x[((n * C + c) * H + iy) * H + ix]) *
                                          bf16_round(w[((k * C + c) * R + i) * R + j])
                                    : 0.f;
              d += term;
              f += term;
            }
            alt.bf16()[((int64_t(n) * K + k) * P + p) * P + q] = bf16_bits(order ? f : float(d));
          }
    return alt;
  };
  // Each stage's output from `h`, the stem's output: layer1..layer4 block by block.
  auto stages = [&](Tensor h) {
    std::vector<std::pair<std::string, std::vector<float>>> out;
    for (size_t k = 1; k < root.children().size(); ++k) {
      const auto& [name, module] = root.children()[k];
      if (module->type() == "Sequential" && name.rfind("layer", 0) == 0) {
        for (const auto& [block, b] : module->children()) {
          h = b->forward(ctx, h);
          out.emplace_back(name + "." + block, test::get(ctx, h));
        }
      } else {
        h = module->forward(ctx, h);
        out.emplace_back(name, test::get(ctx, h));
      }
    }
    CrossEntropyLoss ce;
    out.emplace_back("loss", std::vector<float>{ce.forward(ctx, h, batch.labels).f32()[0]});
    return out;
  };
  const auto base = stages(y);
  std::printf("block gammas %s: the CPU kernel's stem, loss %.5f\n", gamma ? gamma : "as initialised",
              base.back().second[0]);
  for (int order : {0, 1}) {
    const Tensor alt = stem_in_order(order);
    const auto other = stages(alt);
    double worst = 0;
    std::string line;
    for (size_t s = 0; s + 1 < base.size(); ++s) {
      const double d = test::relative_l2(base[s].second, other[s].second);
      worst = std::max(worst, d);
      char buf[64];
      std::snprintf(buf, sizeof buf, " %s %.2g", base[s].first.c_str(), d);
      line += buf;
    }
    std::printf("%s: stem %.2g;%s\n  largest %.3g, loss %.5f\n",
                order ? "fp32 from the last tap" : "double",
                test::relative_l2(test::get(ctx, y), test::get(ctx, alt)), line.c_str(), worst,
                other.back().second[0]);
  }
}
