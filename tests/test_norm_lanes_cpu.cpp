// CPU batch norm 8 channels to a vector on planes of up to 4 positions (engine/cpu/norm_lanes.h),
// against the element-wise loops (REPLICA_NORM_LANES=0): the same bits in every output of
// training, evaluation and backward, with a fused ReLU and a residual, on channel counts that
// leave a part-filled group, on enough channels for several parallel ranges, and on inputs far
// from 0 whose input gradient cancels (where a multiply-add fused one way and not the other
// shows). Builds without AVX-512 run both ways element-wise, and pass trivially.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/ops.h"
#include "env_guard.h"

using namespace replica;
using namespace test;

namespace {

// Every output of a forward (train, with and without the ReLU and a residual), the eval
// forward and the backwards (with and without the ReLU's mask, with and without dx), as bits.
std::vector<uint32_t> batchnorm_bits(DeviceContext& ctx, const Shape& xs, float x_scale) {
  const int64_t c = xs[1];
  std::vector<float> xv = random_values(shape_numel(xs), 1);
  for (float& v : xv) v = v * x_scale + x_scale / 3;
  std::vector<float> dyv = random_values(shape_numel(xs), 5), ryv = random_values(dyv.size(), 9);
  for (size_t i = 0; i < dyv.size(); i += 7) dyv[i] = -0.f;
  for (size_t i = 3; i < ryv.size(); i += 11) ryv[i] = std::numeric_limits<float>::quiet_NaN();
  for (size_t i = 5; i < ryv.size(); i += 13) ryv[i] = -0.f;
  Tensor x = make(ctx, xs, xv), gamma = make(ctx, {c}, 2), beta = make(ctx, {c}, 3);
  Tensor rm = make(ctx, {c}, 4), rv = make(ctx, {c}, std::vector<float>(size_t(c), 1.f));
  Tensor dy = make(ctx, xs, dyv), relu_y = make(ctx, xs, ryv), res = make(ctx, xs, 8);
  std::vector<Tensor> outs;
  for (int form = 0; form < 3; ++form) {  // plain, with the ReLU, with a residual and the ReLU
    Tensor y = ctx.alloc(xs), mean = ctx.alloc({c}), invstd = ctx.alloc({c}), ye = ctx.alloc(xs);
    ctx.ops().batchnorm_forward_train(ctx, x, gamma, beta, rm, rv, 0.1f, 1e-5f, y, mean, invstd,
                                      form == 2 ? res : Tensor(), form > 0);
    ctx.ops().batchnorm_forward_eval(ctx, x, gamma, beta, rm, rv, 1e-5f, ye,
                                     form == 2 ? res : Tensor(), form > 0);
    for (int masked = 0; masked < 2; ++masked) {
      // dx's values stay where the backward takes no dx (form 1).
      Tensor dx = make(ctx, xs, 11), dg = make(ctx, {c}, 6), db = make(ctx, {c}, 7), none;
      ctx.ops().batchnorm_backward(ctx, x, gamma, mean, invstd, dy, masked ? relu_y : none,
                                   form == 1 ? none : dx, dg, db);
      outs.insert(outs.end(), {dx, dg, db});
    }
    outs.insert(outs.end(), {y, mean, invstd, rm, rv, ye});
  }
  std::vector<uint32_t> bits;
  for (const Tensor& t : outs) append_bits(bits, t);
  return bits;
}

}  // namespace

TEST_CASE("batchnorm in lanes gives the element-wise loops' bits") {
  // Positions 1 to 4 (the lanes) and 6 and 15 (element-wise both ways); 8 channels and more,
  // and fewer, so that a group of 8 is part-filled; 200 channels of 64 samples make several
  // ranges; 203 channels make blocks of 8 groups (norm_lanes.cpp) and a last one part-filled,
  // its last group too, and 1,030 channels of 8 samples a range of 16 whole blocks and one of a
  // group; 2 samples of values about 1e4 from 0 leave an input gradient that cancels.
  struct Case {
    Shape xs;
    float x_scale;
  };
  const Case cases[] = {{{7, 11, 1, 1}, 1}, {{5, 13, 1, 2}, 1}, {{6, 17, 1, 3}, 1},
                        {{9, 20, 2, 2}, 1}, {{3, 8, 2, 2}, 1},  {{4, 5, 2, 2}, 1},
                        {{3, 9, 2, 3}, 1},  {{4, 9, 3, 5}, 1},  {{64, 200, 2, 2}, 1},
                        {{16, 203, 2, 2}, 1}, {{8, 1030, 1, 1}, 1},
                        {{2, 37, 1, 1}, 3e4f}, {{2, 29, 1, 2}, 3e4f}, {{2, 21, 1, 3}, 3e4f},
                        {{2, 19, 2, 2}, 3e4f}};
  for (const auto& [xs, x_scale] : cases) {
    CAPTURE(shape_str(xs));
    CAPTURE(x_scale);
    for (int threads : {1, 2}) {
      CAPTURE(threads);
      DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{threads});
      std::vector<uint32_t> ways[2];
      for (int lanes = 0; lanes < 2; ++lanes) {
        ScopedEnv way("REPLICA_NORM_LANES", lanes ? "1" : "0");
        ctx.run([&] { ways[lanes] = batchnorm_bits(ctx, xs, x_scale); });
      }
      REQUIRE(ways[0].size() == ways[1].size());
      size_t differ = 0;
      for (size_t i = 0; i < ways[0].size(); ++i) differ += ways[0][i] != ways[1][i];
      CHECK(differ == 0);
    }
  }
}
