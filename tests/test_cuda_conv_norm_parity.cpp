// CUDA vs CPU parity for the two ops with the most paths: convolution (cuDNN's heuristic,
// deterministic and timed algorithms, the graph API, channels_last copies, dx overwritten or
// added onto) and BatchNorm (one block a channel or sliced sums, rows of channels, residual and
// ReLU, unaligned tensors, the 64-bit index path). Each result is held to the CPU backend's;
// where the GPU promises the same bits twice, to itself. Without a GPU every case says so.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_parity_rig.h"
#include "engine/cuda/op_parts.h"
#include "engine/op_profile.h"
#include "env_guard.h"
#include "gpu_skip.h"

using namespace replica;
using namespace test;


namespace {

// The GPU's convolution against the CPU's. `gpu_options`: deterministic algorithms (then a rerun
// must be bit-identical too), or algorithms picked by timing (--cudnn-benchmark).
void conv_case(const ContextOptions& gpu_options, int64_t N, int64_t C, int64_t H, int64_t W,
               int64_t K, int64_t R, Conv2dParams p, bool bias) {
  const bool deterministic = gpu_options.deterministic;
  Rig r(gpu_options);
  const int64_t P = window_out(H, static_cast<int>(R), p.stride, p.padding);
  const int64_t Q = window_out(W, static_cast<int>(R), p.stride, p.padding);
  const std::string tag = "conv " + shape_str({N, C, H, W}) + " k" + std::to_string(R) + " s" +
                          std::to_string(p.stride) + " p" + std::to_string(p.padding) +
                          (deterministic ? " deterministic" : "") +
                          (gpu_options.cudnn_benchmark ? " timed algorithms" : "") +
                          (gpu_options.conv_api == ConvApi::Graph ? " graph API" : "") +
                          (gpu_options.channels_last ? " channels_last" : "");
  Pair x = make_random(r, {N, C, H, W}, 20), w = make_random(r, {K, C, R, R}, 21);
  Pair b = make_random(r, {K}, 22), y = make_random(r, {N, K, P, Q}, 23);
  Pair dy = make_random(r, {N, K, P, Q}, 24);
  Tensor bc = bias ? b.c : Tensor(), bg = bias ? b.g : Tensor();
  r.c().conv2d_forward(r.cpu, x.c, w.c, bc, y.c, p);
  r.g().conv2d_forward(r.gpu, x.g, w.g, bg, y.g, p);
  expect_close(r, y, kGemmRtol, kConvAtol, tag + " y");

  Pair dx = make_random(r, {N, C, H, W}, 25), dw = make_random(r, {K, C, R, R}, 26);
  Pair db = make_random(r, {K}, 27);
  Tensor dbc = bias ? db.c : Tensor(), dbg = bias ? db.g : Tensor();
  for (int rep = 0; rep < 2; ++rep) {
    r.c().conv2d_backward(r.cpu, x.c, w.c, dy.c, dx.c, dw.c, dbc, p, InputGrad::Overwrite);
    r.g().conv2d_backward(r.gpu, x.g, w.g, dy.g, dx.g, dw.g, dbg, p, InputGrad::Overwrite);
  }
  expect_close(r, dx, kGemmRtol, kConvAtol, tag + " dx");
  // Timed picks sum in whatever order (or transform: FFT, Winograd) was fastest: fp32 whose
  // error is a fraction of the whole output's scale, not of each element. On an H100 the filter
  // gradient of [8,16,14,14] k3 (sums of ~1,600 products, largest |dw| 110) was off by up to
  // 4.0e-4 where an element had cancelled to ~0.9: 4e-6 of the scale. 2e-5 of the largest
  // |value| bounds that with a 5x margin and still fails any wrong index or dropped term.
  const std::vector<float> dw_cpu = host_values(dw.c);
  double dw_scale = 0;
  for (float v : dw_cpu) dw_scale = std::max(dw_scale, std::fabs(double(v)));
  const double dw_atol = gpu_options.cudnn_benchmark ? std::max(kConvAtol, 2e-5 * dw_scale)
                                                     : kConvAtol;
  MESSAGE(tag << " dw: largest |value| " << dw_scale << ", tolerance " << dw_atol);
  expect_close(dw_cpu, gpu_values(r, dw.g), kGemmRtol, dw_atol, tag + " dw (+= twice)");
  if (bias) expect_close(r, db, kGemmRtol, kConvAtol, tag + " db (+= twice)");
  {  // dx added onto what it holds (a residual block's first convolution): cuDNN's beta 1, or
     // the staged result added; the same shape overwriting (above) and adding keeps two plans
    Pair acc = make_random(r, {N, C, H, W}, 28), dwa = make_random(r, {K, C, R, R}, 29);
    Tensor no_db;
    r.c().conv2d_backward(r.cpu, x.c, w.c, dy.c, acc.c, dwa.c, no_db, p, InputGrad::Accumulate);
    r.g().conv2d_backward(r.gpu, x.g, w.g, dy.g, acc.g, dwa.g, no_db, p, InputGrad::Accumulate);
    expect_close(r, acc, kGemmRtol, kConvAtol, tag + " dx (+=)");
    expect_close(host_values(dwa.c), gpu_values(r, dwa.g), kGemmRtol, dw_atol,
                 tag + " dw (+=, with dx added)");
  }

  if (deterministic) {  // a rerun is bit-identical
    Tensor dw2 = r.gpu.alloc({K, C, R, R}), dx2 = r.gpu.alloc({N, C, H, W});
    Tensor dw3 = r.gpu.alloc({K, C, R, R}), dx3 = r.gpu.alloc({N, C, H, W});
    Tensor no_db;
    r.g().fill(r.gpu, dw2, 0.f);
    r.g().fill(r.gpu, dw3, 0.f);
    r.g().conv2d_backward(r.gpu, x.g, w.g, dy.g, dx2, dw2, no_db, p, InputGrad::Overwrite);
    r.g().conv2d_backward(r.gpu, x.g, w.g, dy.g, dx3, dw3, no_db, p, InputGrad::Overwrite);
    expect_close(gpu_values(r, dw2), gpu_values(r, dw3), 0, 0, tag + " dw rerun");
    expect_close(gpu_values(r, dx2), gpu_values(r, dx3), 0, 0, tag + " dx rerun");
  }
}

}  // namespace

TEST_CASE("cuda parity: conv2d forward and backward") {
  if (!test::have_gpu()) return;
  const ContextOptions heuristic, deterministic{0, true};
  ContextOptions timed;
  timed.cudnn_benchmark = true;
  conv_case(heuristic, 3, 4, 5, 7, 6, 3, Conv2dParams{2, 1}, true);
  conv_case(heuristic, 3, 4, 5, 7, 6, 3, Conv2dParams{1, 1}, false);
  conv_case(heuristic, 3, 3, 9, 11, 8, 7, Conv2dParams{2, 3}, false);  // ResNet stem shape
  conv_case(heuristic, 3, 5, 5, 7, 4, 1, Conv2dParams{2, 0}, true);    // 1x1 downsample
  conv_case(deterministic, 3, 4, 5, 7, 6, 3, Conv2dParams{2, 1}, true);
  {  // the bias passes' 64-bit index path
    const test::WideIndexPath wide;
    conv_case(heuristic, 3, 4, 5, 7, 6, 3, Conv2dParams{2, 1}, true);
  }
  // Timed picks (cuDNN's Find) stay fp32 (no TF32): the same tolerance, but filter gradients
  // are held to the output's scale (conv_case).
  conv_case(timed, 3, 4, 5, 7, 6, 3, Conv2dParams{2, 1}, true);
  conv_case(timed, 8, 16, 14, 14, 32, 3, Conv2dParams{1, 1}, false);
  conv_case(timed, 3, 3, 9, 11, 8, 7, Conv2dParams{2, 3}, false);
  // The graph API on fp32 buffers (beta 1 in the plan when dx adds) and channels_last copies
  // (staged, as channels divisible by 8 are: the result added as it is copied back).
  ContextOptions graph, nhwc;
  graph.conv_api = ConvApi::Graph;
  nhwc.channels_last = true;
  conv_case(graph, 3, 4, 5, 7, 6, 3, Conv2dParams{1, 1}, false);
  conv_case(nhwc, 3, 8, 5, 7, 16, 3, Conv2dParams{1, 1}, false);
  {  // no output channels: nothing flows back, and dx, added onto, keeps what it held
    Rig r0;
    Tensor x = r0.gpu.alloc({2, 3, 4, 4}), w = r0.gpu.alloc({0, 3, 3, 3});
    Tensor dy = r0.gpu.alloc({2, 0, 4, 4}), dw = r0.gpu.alloc({0, 3, 3, 3}), no_db;
    Tensor dx = r0.gpu.alloc({2, 3, 4, 4});
    r0.g().fill(r0.gpu, dx, 0.5f);
    r0.g().conv2d_backward(r0.gpu, x, w, dy, dx, dw, no_db, Conv2dParams{1, 1},
                           InputGrad::Accumulate);
    for (float v : gpu_values(r0, dx)) CHECK(v == 0.5f);
  }
  Rig r;  // an empty batch is a no-op
  Tensor x0 = r.gpu.alloc({0, 4, 5, 7}), w = r.gpu.alloc({6, 4, 3, 3});
  Tensor y0 = r.gpu.alloc({0, 6, 5, 7});
  CHECK_NOTHROW(r.g().conv2d_forward(r.gpu, x0, w, Tensor(), y0, Conv2dParams{1, 1}));
  CHECK_NOTHROW(r.gpu.synchronize());
}

TEST_CASE("cuda parity: conv2d on planes smaller than the kernel, through the plane matrix") {
  if (!test::have_gpu()) return;
  // The GPU through M, the CPU's reference through im2col's columns: a wrong tap shows.
  const ScopedEnv on("REPLICA_CUDA_PLANE_MATRIX", "1"), columns("REPLICA_PLANE_MATRIX", "0");
  const ContextOptions heuristic, deterministic{0, true};
  // The seed recipe's 2x2 and 1x1 planes and the stride-2 step between; a 4x1 plane; a 5x5
  // kernel on 3x3 planes, whose 630 rows of M fold several pixels onto each weight.
  conv_case(heuristic, 5, 6, 2, 2, 4, 3, Conv2dParams{1, 1}, true);
  conv_case(deterministic, 5, 6, 2, 2, 4, 3, Conv2dParams{2, 1}, true);
  conv_case(heuristic, 5, 6, 1, 1, 4, 3, Conv2dParams{1, 1}, false);
  conv_case(heuristic, 3, 3, 4, 1, 5, 3, Conv2dParams{1, 1}, true);
  conv_case(deterministic, 4, 3, 3, 3, 70, 5, Conv2dParams{1, 2}, false);
  // It is the plane matrix that ran: its kernels are an op part of each call (forward: M
  // built; backward: M built and its gradient zeroed, then folded).
  Rig r;
  OpProfile profile;
  r.gpu.set_op_profile(&profile);
  Pair x = make_random(r, {5, 6, 2, 2}, 40), w = make_random(r, {4, 6, 3, 3}, 41);
  Pair y = make_random(r, {5, 4, 2, 2}, 42), dx = make_random(r, {5, 6, 2, 2}, 43);
  Pair dw = make_random(r, {4, 6, 3, 3}, 44);
  Tensor no_b;
  r.g().conv2d_forward(r.gpu, x.g, w.g, no_b, y.g, Conv2dParams{1, 1});
  r.g().conv2d_backward(r.gpu, x.g, w.g, y.g, dx.g, dw.g, no_b, Conv2dParams{1, 1},
                        InputGrad::Overwrite);
  r.gpu.set_op_profile(nullptr);
  auto parts = profile.parts();
  const std::string part = replica::cuda::kPlaneMatrixPart;
  CHECK(parts["conv2d_forward"][part].calls == 1);
  CHECK(parts["conv2d_backward"][part].calls == 2);
}

namespace {

// relu: with the ReLU fused (forward's output and backward's mask).
// unaligned: x, y, dy and dx (and the residual) start one float into their GPU allocations.
// residual: forward adds a residual before the ReLU (a residual block's last BatchNorm, whose
// backward then takes no mask: the block masks the gradient itself); unaligned_residual: the
// residual alone starts one float in.
void batchnorm_case(const Shape& shape, bool relu, bool unaligned = false, bool residual = false,
                    bool unaligned_residual = false) {
  Rig r;
  const int64_t C = shape[1];
  const std::string tag = "batchnorm " + shape_str(shape) + (relu ? " + relu" : "") +
                          (unaligned ? " unaligned" : "") + (residual ? " + residual" : "");
  const auto activation = unaligned ? make_random_unaligned : make_random;
  Pair x = activation(r, shape, 30, -2.f, 3.f), y = activation(r, shape, 31, -1.f, 1.f);
  const Pair res = !residual            ? Pair{}
                   : unaligned_residual ? make_random_unaligned(r, shape, 47, -1.f, 1.f)
                                        : activation(r, shape, 47, -1.f, 1.f);
  Pair gamma = make_random(r, {C}, 32, 0.5f, 1.5f), beta = make_random(r, {C}, 33);
  Pair rm = make_random(r, {C}, 34), rv = make_random(r, {C}, 35, 0.5f, 2.f);
  Pair sm = make_random(r, {C}, 36), si = make_random(r, {C}, 37);
  const float momentum = 0.1f, eps = 1e-5f;
  for (int rep = 0; rep < 2; ++rep) {  // twice: running stats updated twice
    r.c().batchnorm_forward_train(r.cpu, x.c, gamma.c, beta.c, rm.c, rv.c, momentum, eps, y.c,
                                  sm.c, si.c, res.c, relu);
    r.g().batchnorm_forward_train(r.gpu, x.g, gamma.g, beta.g, rm.g, rv.g, momentum, eps, y.g,
                                  sm.g, si.g, res.g, relu);
  }
  expect_close(r, y, 1e-4, 1e-4, tag + " train y");
  expect_close(r, sm, 1e-4, 1e-5, tag + " save_mean");
  expect_close(r, si, 1e-4, 1e-5, tag + " save_invstd");
  expect_close(r, rm, 1e-4, 1e-5, tag + " running_mean");
  expect_close(r, rv, 1e-4, 1e-5, tag + " running_var (unbiased)");

  Pair dy = activation(r, shape, 38, -1.f, 1.f), dx = activation(r, shape, 39, -1.f, 1.f);
  Pair dgamma = make_random(r, {C}, 40), dbeta = make_random(r, {C}, 41);
  // The mask is read from the CPU's output on both sides, so an element whose output sits at
  // zero on one backend and a rounding above it on the other cannot split the two.
  const bool masked = relu && !residual;
  Tensor mask_c = masked ? y.c : Tensor();
  Tensor mask_g = masked ? make_twin(r, shape, host_values(y.c)).g : Tensor();
  for (int rep = 0; rep < 2; ++rep) {
    r.c().batchnorm_backward(r.cpu, x.c, gamma.c, sm.c, si.c, dy.c, mask_c, dx.c, dgamma.c,
                             dbeta.c);
    r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx.g, dgamma.g,
                             dbeta.g);
  }
  expect_close(r, dx, 1e-3, 1e-4, tag + " dx");
  // The same inputs again give the same bits on the GPU (sums in a fixed order). Planes of up
  // to 4096 values a channel take a block per channel, which is an op part of each call; rows
  // (HW = 1) and larger planes the sliced passes.
  int64_t hw = 1;
  for (size_t i = 2; i < shape.size(); ++i) hw *= shape[i];
  const bool one_block = hw > 1 && shape[0] * hw <= 4096;
  auto one_block_calls = [&](const OpProfile& p) {
    const std::string part = replica::cuda::kNormOneBlockPart;
    int64_t calls = 0;
    for (const auto& [op, parts] : p.parts())
      if (parts.count(part)) calls += parts.at(part).calls;
    return calls;
  };
  Pair y2 = make_random(r, shape, 43), dx2 = make_random(r, shape, 44);
  Pair sm2 = make_random(r, {C}, 45), si2 = make_random(r, {C}, 46);
  Tensor none;
  OpProfile profile;
  r.gpu.set_op_profile(&profile);
  r.g().batchnorm_forward_train(r.gpu, x.g, gamma.g, beta.g, none, none, momentum, eps, y2.g,
                                sm2.g, si2.g, res.g, relu);
  r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx2.g, none, none);
  r.gpu.set_op_profile(nullptr);
  CHECK_MESSAGE(one_block_calls(profile) == (one_block ? 2 : 0), tag, " a block per channel");
  CHECK(gpu_values(r, y2.g) == gpu_values(r, y.g));
  CHECK(gpu_values(r, dx2.g) == gpu_values(r, dx.g));
  // Where the shape takes a block per channel (norm_block.cu), the sliced passes
  // (REPLICA_CUDA_SLICED_SUMS=1) give the same bits: the same sums in the same order, the same
  // formulas (channel_pass.h, norm_channel.h). Elsewhere the switch changes nothing.
  {
    Pair dg = make_random(r, {C}, 48), db = make_random(r, {C}, 49);
    Pair dg3 = make_random(r, {C}, 48), db3 = make_random(r, {C}, 49);
    r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx2.g, dg.g, db.g);
    const test::ScopedEnv sliced("REPLICA_CUDA_SLICED_SUMS", "1");
    Pair y3 = make_random(r, shape, 43), dx3 = make_random(r, shape, 44);
    Pair sm3 = make_random(r, {C}, 45), si3 = make_random(r, {C}, 46);
    OpProfile sliced_profile;
    r.gpu.set_op_profile(&sliced_profile);
    r.g().batchnorm_forward_train(r.gpu, x.g, gamma.g, beta.g, none, none, momentum, eps, y3.g,
                                  sm3.g, si3.g, res.g, relu);
    r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx3.g, dg3.g,
                             db3.g);
    r.gpu.set_op_profile(nullptr);
    CHECK_MESSAGE(one_block_calls(sliced_profile) == 0, tag, " sliced: no block per channel");
    CHECK_MESSAGE(gpu_values(r, y3.g) == gpu_values(r, y2.g), tag, " sliced y");
    CHECK_MESSAGE(gpu_values(r, sm3.g) == gpu_values(r, sm2.g), tag, " sliced save_mean");
    CHECK_MESSAGE(gpu_values(r, si3.g) == gpu_values(r, si2.g), tag, " sliced save_invstd");
    CHECK_MESSAGE(gpu_values(r, dx3.g) == gpu_values(r, dx2.g), tag, " sliced dx");
    CHECK_MESSAGE(gpu_values(r, dg3.g) == gpu_values(r, dg.g), tag, " sliced dgamma");
    CHECK_MESSAGE(gpu_values(r, db3.g) == gpu_values(r, db.g), tag, " sliced dbeta");
  }
  expect_close(r, dgamma, 1e-4, 1e-4, tag + " dgamma (+= twice)");
  expect_close(r, dbeta, 1e-4, 1e-4, tag + " dbeta (+= twice)");

  Pair ye = make_random(r, shape, 42);
  r.c().batchnorm_forward_eval(r.cpu, x.c, gamma.c, beta.c, rm.c, rv.c, eps, ye.c, res.c, relu);
  r.g().batchnorm_forward_eval(r.gpu, x.g, gamma.g, beta.g, rm.g, rv.g, eps, ye.g, res.g, relu);
  expect_close(r, ye, 1e-4, 1e-4, tag + " eval y");
}

}  // namespace

TEST_CASE("cuda parity: batchnorm train, backward and eval") {
  if (!test::have_gpu()) return;
  // Planes of at most 4096 values a channel ({3, 4, 5, 7}, {4, 8, 2, 2}, {3, 5, 12}) take a
  // block per channel (norm_block.cu), larger ones the sliced passes (norm.cu); each case holds
  // the two ways to the same bits too. At the boundary:
  // 4096 values in float4s (each thread's four groups a round), 3267 one at a time (four
  // rounds), and 4160 (two slices).
  for (const Shape& edge : {Shape{16, 8, 16, 16}, Shape{3, 4, 33, 33}, Shape{1, 2, 64, 65}})
    batchnorm_case(edge, true);
  for (const bool relu : {false, true}) {
    batchnorm_case({3, 4, 5, 7}, relu);
    batchnorm_case({5, 6}, relu);  // BatchNorm1d-style [N, C]
    // Enough values per channel for several slices of partial sums (ResNet's early layers),
    // and slices that begin inside an image's plane.
    batchnorm_case({16, 3, 40, 40}, relu);
    batchnorm_case({9, 2, 31, 31}, relu);
    // Planes of whole float4s, small ones included: the flat passes move float4s there. The
    // same shapes one float off alignment take the one-float path.
    batchnorm_case({4, 8, 2, 2}, relu);
    batchnorm_case({3, 5, 12}, relu);
    batchnorm_case({4, 8, 2, 2}, relu, true);
    batchnorm_case({16, 3, 40, 40}, relu, true);
    // A residual block's last BatchNorm with its sum (and ReLU): float4s, one float, unaligned.
    batchnorm_case({4, 8, 2, 2}, relu, false, true);
    batchnorm_case({3, 4, 5, 7}, relu, false, true);
    batchnorm_case({16, 3, 40, 40}, relu, true, true);
    batchnorm_case({4, 8, 2, 2}, relu, false, true, true);  // only the residual off alignment
    // Channels side by side in rows ([N, C], [N, C, 1, 1]: the row passes): 4 and 2 channels a
    // thread, last slices cut short, the one-channel path off alignment, and a residual.
    batchnorm_case({600, 128}, relu);
    batchnorm_case({70, 64, 1, 1}, relu);
    batchnorm_case({600, 128}, relu, true);
    batchnorm_case({40, 128, 1, 1}, relu, false, true);
  }
  // The 64-bit index path, which real shapes take only past 2^31 values.
  const test::WideIndexPath wide;
  batchnorm_case({9, 2, 31, 31}, true);
  batchnorm_case({16, 3, 40, 40}, false);
  batchnorm_case({5, 6}, false);
  batchnorm_case({4, 8, 2, 2}, true, false, true);
}
