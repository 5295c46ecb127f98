// The graph-API convolution plans' descriptors (engine/cuda/conv_graph.h), checked by cuDNN
// itself without a GPU: every direction of the models' convolution shapes, fp32 and bf16, NCHW
// and (where conv.cu stages it) NHWC, is a graph cuDNN accepts, and a shape whose output does not
// follow from its input is refused with an error naming the operation, not a crash. Choosing an
// engine and running the plan need a GPU: tests/test_cuda_precision.cpp covers those.
#include <doctest/doctest.h>

#if REPLICA_TEST_CONV_GRAPH
#include <tuple>

#include "engine/cuda/conv_graph.h"
#include "engine/error.h"
#include "engine/ops.h"

using namespace replica;

namespace {

// (C, H, K, R, stride, padding) of square inputs; N is 8.
using Shape6 = std::tuple<int64_t, int64_t, int64_t, int64_t, int, int>;

ConvGraphSpec spec_of(const Shape6& s, ConvDirection dir, bool bf16, bool nhwc) {
  const auto [C, H, K, R, stride, padding] = s;
  ConvGraphSpec g;
  g.direction = dir;
  g.N = 8, g.C = C, g.H = H, g.W = H, g.K = K, g.R = R, g.stride = stride, g.padding = padding;
  g.P = g.Q = window_out(H, int(R), stride, padding);
  g.bf16 = bf16, g.nhwc = nhwc;
  g.beta = dir == ConvDirection::BackwardFilter ? 1.f : 0.f;
  return g;
}

}  // namespace

TEST_CASE("cuDNN accepts every convolution graph the models describe, without a GPU") {
  // ResNet-50's stem, bottleneck 1x1 and 3x3 (strided too), the CNN's two, ResNet-18's first.
  const Shape6 shapes[] = {{3, 224, 64, 7, 2, 3},  {64, 56, 64, 1, 1, 0},  {64, 56, 64, 3, 1, 1},
                           {256, 56, 512, 1, 2, 0}, {128, 56, 128, 3, 2, 1}, {1, 28, 20, 5, 1, 0},
                           {20, 12, 50, 5, 1, 0},  {1, 28, 64, 3, 1, 1}};
  int checked = 0;
  for (const Shape6& s : shapes)
    for (const ConvDirection dir : {ConvDirection::Forward, ConvDirection::BackwardData,
                                    ConvDirection::BackwardFilter})
      for (const bool bf16 : {false, true})
        for (const bool nhwc : {false, true}) {
          const auto [C, H, K, R, stride, padding] = s;
          if (nhwc && (C % 8 != 0 || K % 8 != 0)) continue;  // conv.cu keeps these NCHW
          CAPTURE(C);
          CAPTURE(K);
          CAPTURE(R);
          CAPTURE(conv_direction_name(dir));
          CAPTURE(bf16);
          CAPTURE(nhwc);
          CHECK_NOTHROW(ConvGraph::check(spec_of(s, dir, bf16, nhwc)));
          ++checked;
        }
  CHECK(checked == 4 * 3 * 4 + 4 * 3 * 2);  // the 4 shapes with channels in 8s run NHWC too
}

TEST_CASE("a convolution graph whose output shape is wrong is refused, naming the operation") {
  for (const ConvDirection dir : {ConvDirection::Forward, ConvDirection::BackwardData,
                                  ConvDirection::BackwardFilter}) {
    CAPTURE(conv_direction_name(dir));
    ConvGraphSpec g = spec_of({64, 14, 64, 3, 1, 1}, dir, true, true);
    g.Q -= 1;  // a 3x3 convolution padded by 1 keeps the width
    CHECK_THROWS_WITH_AS(ConvGraph::check(g),
                         doctest::Contains("convolution operation not accepted"), Error);
  }
}

TEST_CASE("a plan runs only on buffers as aligned as it was built for (16 bytes)") {
  alignas(16) static char block[64];
  CHECK(ConvGraph::aligned({block, block + 16, block + 48}));
  CHECK_FALSE(ConvGraph::aligned({block, block + 4, block + 48}));
  CHECK_FALSE(ConvGraph::aligned({block + 8, block + 16, block + 32}));
}

#else
TEST_CASE("cuDNN graph descriptors: not built here") {
  MESSAGE("test_conv_graph: replica was built without CUDA and cuDNN: nothing to check");
}
#endif
