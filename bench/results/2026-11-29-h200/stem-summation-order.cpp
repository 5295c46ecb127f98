// ResNet-50 bf16's stem (the training case's weights and batch, test_cuda_channels_last) summed
// in other valid orders: the same bf16-rounded operands and products, added in double, in fp32
// forward, in fp32 backward, and per input channel; each rounded to bf16 as a GPU kernel with
// that order would store it. How many stem outputs differ from the CPU kernel's, and how far the
// rest of the forward's loss moves from that alone. Built as loss-sensitivity.cpp beside it says.
#include <doctest/doctest.h>
#include <cstdio>
#include "dp_reference.h"
#include "engine/context.h"
#include "engine/ops.h"
#include "layers/loss.h"
#include "layers/model.h"
#include "parallel/engines/train_engine.h"
using namespace replica;
TEST_CASE("the stem's summation order") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2, true, Precision::Bf16});
  const EngineOptions o = test::sgd_options("resnet50", {3, 32, 32});
  auto m = make_model("resnet50", {3, 32, 32}, 10);
  m->materialize(ctx, o.seed);
  const Batch batch = test::make_batches(o.input_shape, 16, 1, 6).at(0);
  Module& root = m->root();
  REQUIRE(m->params()[0]->name == "conv1.weight");
  const float* w = m->params()[0]->value.f32();  // [64, 3, 7, 7]
  const float* x = batch.images.f32();            // [16, 3, 32, 32]
  const Tensor y = root.children()[0].second->forward(ctx, batch.images);
  REQUIRE(y.dtype() == DType::BF16);
  const int N = 16, C = 3, H = 32, K = 64, P = 16, R = 7;
  auto stem_in_order = [&](int order, int64_t* differ) {
    Tensor alt = Tensor::empty(host_allocator(), y.shape(), y.dtype());
    *differ = 0;
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k)
        for (int p = 0; p < P; ++p)
          for (int q = 0; q < P; ++q) {
            float terms[C * R * R];
            int t = 0;
            for (int c = 0; c < C; ++c)
              for (int i = 0; i < R; ++i)
                for (int j = 0; j < R; ++j) {
                  const int iy = p * 2 - 3 + i, ix = q * 2 - 3 + j;
                  const bool in = iy >= 0 && iy < H && ix >= 0 && ix < H;
                  terms[t++] = in ? bf16_round(x[((n * C + c) * H + iy) * H + ix]) *
                                        bf16_round(w[((k * C + c) * R + i) * R + j])
                                  : 0.f;
                }
            float f = 0;
            if (order == 0) {
              double d = 0;
              for (float v : terms) d += v;
              f = float(d);
            } else if (order == 1) {
              for (float v : terms) f += v;
            } else if (order == 2) {
              for (int u = t - 1; u >= 0; --u) f += terms[u];
            } else {
              float ch[C] = {};
              for (int u = 0; u < t; ++u) ch[u / (R * R)] += terms[u];
              f = (ch[0] + ch[1]) + ch[2];
            }
            const int64_t e = ((int64_t(n) * K + k) * P + p) * P + q;
            alt.bf16()[e] = bf16_bits(f);
            if (alt.bf16()[e] != y.bf16()[e]) ++*differ;
          }
    return alt;
  };
  auto rest = [&](Tensor h) {
    for (size_t k = 1; k < root.children().size(); ++k)
      h = root.children()[k].second->forward(ctx, h);
    CrossEntropyLoss ce;
    return double(ce.forward(ctx, h, batch.labels).f32()[0]);
  };
  const double base = rest(y);
  std::printf("the CPU kernel's stem: loss %.5f\n", base);
  const char* names[] = {"double", "fp32 forward", "fp32 backward", "fp32 per channel"};
  for (int order = 0; order < 4; ++order) {
    int64_t differ;
    const Tensor alt = stem_in_order(order, &differ);
    const double l = rest(alt);
    std::printf("%s: %lld of %lld stem outputs differ by an ulp or more; loss %.5f (%+.4f)\n",
                names[order], (long long)differ, (long long)y.numel(), l, l - base);
  }
}
