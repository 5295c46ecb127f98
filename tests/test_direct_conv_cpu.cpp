// The CPU's direct convolution (engine/cpu/direct_conv.h): on the layers its rule takes, equal
// to a convolution summed in double with the same bits for 1, 2 and 3 threads, the weight
// gradient's bits with and without an input gradient, and the layers it leaves to im2col.
#include <doctest/doctest.h>

#include "conv_layer_check.h"
#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/conv_geometry.h"
#include "engine/cpu/direct_conv.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

TEST_CASE("conv2d at stride 1 with few output channels (the direct convolution) equals a "
          "convolution summed in double, with the same bits for 1, 2 and 3 threads") {
  // The CNN's second layer (5x5, 20 channels in and out) and a 5x5 layer of 4 inputs; 3x3 with
  // padding on 10x10; 7 output channels (a block of 5 and two rows alone; weight gradients in a
  // block of 4 and three rows alone) and 45 taps (blocks of 4 and one alone); a 2x2 kernel on a
  // 9x11 plane, padded; padding past the kernel's reach (outputs that see only zeros); 32 output
  // channels, the most it takes; 4x4 and 7x7 kernels; a plane one output column wide (every
  // wide row but its first pixel dropped); batches of 1, 13 (the weight gradient's chunks of 2
  // samples and 1: a pass over a whole chunk) and 41 (chunks of 6 and 5: passes over 4
  // samples, then 2 or 1). Builds for CPUs without AVX-512 leave every layer to im2col.
  if (!cpu::direct_conv_built()) {
    MESSAGE("skipped: this build is not for AVX-512, and the direct convolution is off in it");
    CHECK_FALSE(cpu::direct_conv_pays(geometry_of(Layer{2, 20, 20, 24, 24, 5, 1, 0})));
    return;
  }
  for (Layer l : {Layer{3, 20, 20, 24, 24, 5, 1, 0}, Layer{2, 4, 20, 28, 28, 5, 1, 0},
                  Layer{3, 6, 5, 10, 10, 3, 1, 1}, Layer{2, 5, 7, 10, 12, 3, 1, 1},
                  Layer{2, 4, 4, 9, 11, 2, 1, 1}, Layer{2, 4, 3, 4, 5, 3, 1, 4},
                  Layer{1, 4, 32, 10, 10, 3, 1, 1}, Layer{2, 4, 5, 12, 13, 4, 1, 2},
                  Layer{2, 4, 5, 12, 12, 7, 1, 3}, Layer{2, 4, 6, 104, 3, 3, 1, 0},
                  Layer{13, 4, 6, 10, 11, 3, 1, 1}, Layer{41, 4, 6, 10, 11, 3, 1, 1}}) {
    const ConvGeometry g = geometry_of(l);
    REQUIRE(cpu::direct_conv_pays(g));
    REQUIRE_FALSE(plane_matrix_pays(g));
    check_layer(l);
  }
  // Without an input gradient (a network's first layer) the weight gradient keeps its bits.
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{2});
  ctx.run([&] {
    const Shape xs = {3, 20, 24, 24}, ws = {20, 20, 5, 5}, ys = {3, 20, 20, 20};
    Tensor x = make(ctx, xs, 1), w = make(ctx, ws, 2), dy = make(ctx, ys, 3);
    Tensor dx = ctx.alloc(xs), no_dx, db1 = make(ctx, {20}, 4), db2 = make(ctx, {20}, 4);
    Tensor dw1 = make(ctx, ws, 5), dw2 = make(ctx, ws, 5);
    ctx.ops().conv2d_backward(ctx, x, w, dy, dx, dw1, db1, Conv2dParams{1, 0},
                              InputGrad::Overwrite);
    ctx.ops().conv2d_backward(ctx, x, w, dy, no_dx, dw2, db2, Conv2dParams{1, 0},
                              InputGrad::Overwrite);
    CHECK(values(dw2) == values(dw1));
    CHECK(values(db2) == values(db1));
  });
  // It leaves to im2col strided layers, 1x1 kernels, more than 32 output channels, fewer than
  // 4 input channels (the CNN's first layer) and planes under 100 output pixels.
  auto takes = [](Layer l) { return cpu::direct_conv_pays(geometry_of(l)); };
  CHECK_FALSE(takes(Layer{2, 20, 20, 24, 24, 5, 2, 0}));
  CHECK_FALSE(takes(Layer{2, 20, 20, 24, 24, 1, 1, 0}));
  CHECK_FALSE(takes(Layer{2, 20, 33, 24, 24, 3, 1, 1}));
  CHECK_FALSE(takes(Layer{2, 1, 20, 28, 28, 5, 1, 0}));
  CHECK_FALSE(takes(Layer{2, 64, 32, 8, 8, 3, 1, 1}));
  CHECK(takes(Layer{2, 4, 32, 10, 10, 3, 1, 1}));
}
