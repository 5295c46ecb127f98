// cuDNN's two interfaces and a convolution's two layouts on the GPU, held to the CPU's numbers
// in each precision (tests/precision_rig.h): channels_last runs a convolution on NHWC copies of
// NCHW operands (weights KRSC) and copies the results back; ConvApi::Graph runs every direction
// through a plan of cuDNN's graph API, ConvApi::Legacy through its legacy calls; and
// REPLICA_CUDNN_API picks between them for contexts left at Auto. Skips visibly without a GPU,
// and the tf32 and bf16 cases without tensor cores.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "env_guard.h"
#include "gpu_skip.h"
#include "precision_rig.h"

using namespace replica;
using namespace test;

namespace {

// One convolution run on several contexts: forward (x, w, b -> y) and backward (x, w, dy and a
// nonzero gradient dw accumulates onto -> dx, dw, db); each output's values per context.
struct ConvRun {
  Shape x, w;
  Conv2dParams p;

  Shape y() const {
    return {x[0], w[0], window_out(x[2], int(w[2]), p.stride, p.padding),
            window_out(x[3], int(w[2]), p.stride, p.padding)};
  }
  std::vector<std::vector<float>> forward(Trio& t, const std::vector<DeviceContext*>& ctxs) const {
    return on_all(
        t, {x, w, {w[0]}}, {y()},
        [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
          c.ops().conv2d_forward(c, i[0], i[1], i[2], o[0], p);
        },
        ctxs)[0];
  }
  std::vector<std::vector<std::vector<float>>> backward(
      Trio& t, const std::vector<DeviceContext*>& ctxs) const {
    return on_all(
        t, {x, w, y(), w}, {x, w, {w[0]}},
        [&](DeviceContext& c, std::vector<Tensor>& i, std::vector<Tensor>& o) {
          c.ops().copy(c, o[1], i[3]);
          c.ops().conv2d_backward(c, i[0], i[1], i[2], o[0], o[1], o[2], p, InputGrad::Overwrite);
        },
        ctxs);
  }
};

// Shapes that cover tiled transposes with partial tiles (channels and positions not multiples
// of 32) and with several tiles each way, a 1x1 kernel and a 1x1 output (where NHWC and NCHW
// lay out alike and the copy is flat), and 3 input channels (a first layer's, padded to 8:
// engine/cuda/conv_padded.cu).
const ConvRun kLayoutCases[] = {{{5, 16, 17, 19}, {40, 16, 3, 3}, {1, 1}},
                                {{3, 48, 9, 9}, {72, 48, 1, 1}, {2, 0}},
                                {{6, 72, 3, 3}, {40, 72, 3, 3}, {1, 0}},
                                {{2, 64, 40, 40}, {64, 64, 3, 3}, {1, 1}},
                                {{4, 3, 12, 12}, {24, 3, 5, 5}, {1, 0}}};

}  // namespace

// channels_last copies a convolution's operands into NHWC (weights KRSC) and its results back
// (kLayoutCases).
TEST_CASE("channels_last convolutions: NCHW's results from NHWC copies, fp32 and bf16") {
  if (!test::have_gpu()) return;
  Trio t;
  const bool bf16 = have_tf32();
  for (const ConvRun& c : kLayoutCases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const auto f32 = c.forward(t, {&t.cpu, &t.fp32_nhwc});
    const auto b32 = c.backward(t, {&t.cpu, &t.fp32_nhwc});
    const char* names[] = {"dx", "dw", "db"};
    CHECK(test::relative_l2(f32[0], f32[1]) < 1e-5);
    for (int k = 0; k < 3; ++k) {
      CAPTURE(names[k]);
      CHECK(test::relative_l2(b32[k][0], b32[k][1]) < 1e-5);
    }
    if (!bf16) continue;
    const std::vector<DeviceContext*> ctxs = {&t.cpu, &t.cpu_bf16, &t.bf16_nhwc};
    expect_bf16(c.forward(t, ctxs), "channels_last conv y");
    const auto bb = c.backward(t, ctxs);
    expect_bf16(bb[0], "channels_last conv dx");
    expect_bf16(bb[1], "channels_last conv dw");
  }
  // The copies' 64-bit index path, which real shapes take only past 2^31 tiles.
  const test::WideIndexPath wide;
  for (const ConvRun& c : kLayoutCases) {
    CAPTURE(shape_str(c.x));
    const auto f32 = c.forward(t, {&t.cpu, &t.fp32_nhwc});
    const auto b32 = c.backward(t, {&t.cpu, &t.fp32_nhwc});
    CHECK(test::relative_l2(f32[0], f32[1]) < 1e-5);
    for (int k = 0; k < 3; ++k) CHECK(test::relative_l2(b32[k][0], b32[k][1]) < 1e-5);
  }
}

// ConvApi::Graph (REPLICA_CUDNN_API=graph) runs every convolution direction through an execution
// plan of cuDNN's graph API, built once per shape; Graph is strict (a shape with no engine, or
// buffers the plan cannot take, is an error, never the legacy calls), so each case here ran a
// plan. Each plan must give the CPU's numbers
// as the legacy calls do: fp32 (also with timed plans, whose trial runs must leave an
// accumulating dw alone, and NHWC), tf32 within TF32's rounding, bf16 the CPU's bf16 in both
// layouts, beside the legacy calls' bf16, on kLayoutCases. On an H200 (2026-11-26) the plans gave
// the CPU's bf16 bits exactly in every direction; the legacy calls' dx of the 3-channel case
// was 9.9e-4 off them in both layouts (a second rounding inside cuDNN's legacy engine, about
// 40% of bf16's own error), so the legacy dx is held to 2e-3 only: one more reason the graph
// API runs bf16 by default. (Since then an NHWC context runs that case on 8 padded channels,
// engine/cuda/conv_padded.cu.)
TEST_CASE("cuDNN graph API convolutions: the CPU's numbers in fp32, tf32 and bf16, both layouts") {
  if (!test::have_gpu()) return;
  auto options = [](Precision p, ConvApi api, bool nhwc, bool timed) {
    ContextOptions o{0, !timed, p};
    o.channels_last = nhwc;
    o.cudnn_benchmark = timed;
    o.conv_api = api;
    return o;
  };
  Trio t;
  DeviceContext fp32{kGpu, options(Precision::Fp32, ConvApi::Graph, false, false)};
  DeviceContext fp32_timed{kGpu, options(Precision::Fp32, ConvApi::Graph, false, true)};
  DeviceContext fp32_nhwc{kGpu, options(Precision::Fp32, ConvApi::Graph, true, false)};
  const bool tensor_cores = have_tf32();
  // tf32, then bf16: graph NCHW and NHWC, legacy NCHW and NHWC
  std::vector<std::unique_ptr<DeviceContext>> more;
  if (tensor_cores) {
    more.push_back(std::make_unique<DeviceContext>(
        kGpu, options(Precision::Tf32, ConvApi::Graph, false, false)));
    for (const auto& [api, nhwc] : {std::pair{ConvApi::Graph, false},
                                    std::pair{ConvApi::Graph, true},
                                    std::pair{ConvApi::Legacy, false},
                                    std::pair{ConvApi::Legacy, true}})
      more.push_back(std::make_unique<DeviceContext>(
          kGpu, options(Precision::Bf16, api, nhwc, false)));
  }
  for (const ConvRun& c : kLayoutCases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const std::vector<DeviceContext*> strict = {&t.cpu, &fp32, &fp32_timed, &fp32_nhwc};
    const auto f = c.forward(t, strict);
    const auto b = c.backward(t, strict);
    const char* names[] = {"fp32", "fp32 timed", "fp32 NHWC"};
    for (size_t i = 1; i < strict.size(); ++i) {
      CAPTURE(names[i - 1]);
      CHECK(test::relative_l2(f[0], f[i]) < 2e-5);
      CHECK(test::relative_l2(b[0][0], b[0][i]) < 2e-5);  // dx
      CHECK(test::relative_l2(b[1][0], b[1][i]) < 2e-5);  // dw, accumulated
    }
    if (!tensor_cores) continue;
    const std::vector<DeviceContext*> tf32 = {&t.cpu, &t.fp32, more[0].get()};
    const auto tb = c.backward(t, tf32);
    expect_precisions(c.forward(t, tf32), "graph tf32 conv y", false);
    expect_precisions(tb[0], "graph tf32 conv dx", false);
    expect_precisions(tb[1], "graph tf32 conv dw", false);
    const char* bf16_names[] = {"graph bf16 NCHW", "graph bf16 NHWC", "legacy bf16 NCHW",
                                "legacy bf16 NHWC"};
    for (size_t k = 1; k < more.size(); ++k) {
      const std::string name = bf16_names[k - 1];
      const std::vector<DeviceContext*> ctxs = {&t.cpu, &t.cpu_bf16, more[k].get()};
      expect_bf16(c.forward(t, ctxs), name + " y");
      const auto bb = c.backward(t, ctxs);
      expect_bf16(bb[0], name + " dx", /*loose=*/name.rfind("legacy", 0) == 0);
      expect_bf16(bb[1], name + " dw");
    }
  }
}

// REPLICA_CUDNN_API chooses for contexts left at Auto; a word it does not know stops the
// context's creation with a one-line usage error, which every program prints and exits on.
TEST_CASE("REPLICA_CUDNN_API: an unknown word is a usage error when a GPU context is made") {
  if (!test::have_gpu()) return;
  test::EnvGuard guard({"REPLICA_CUDNN_API"});  // the caller's, put back at the end
  ::setenv("REPLICA_CUDNN_API", "fast", 1);
  CHECK_THROWS_WITH_AS(DeviceContext{kGpu}, doctest::Contains("unknown cuDNN interface 'fast'"),
                       UsageError);
  ::setenv("REPLICA_CUDNN_API", "legacy", 1);
  CHECK(DeviceContext{kGpu}.conv_api() == ConvApi::Legacy);
  ContextOptions graph;
  graph.conv_api = ConvApi::Graph;  // set by the program: the environment does not override
  CHECK(DeviceContext{kGpu, graph}.conv_api() == ConvApi::Graph);
  ::unsetenv("REPLICA_CUDNN_API");
  CHECK(DeviceContext{kGpu}.conv_api() == ConvApi::Auto);
}
