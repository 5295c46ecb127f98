// A ResNet's forward walked stage by stage in channels_last against NCHW on the GPU: each
// module's output in both layouts, from the same weights and input, so that a wrong layout or
// kernel is named at the stage where it first shows, not only in a loss at the end.
// tests/test_cuda_channels_last.cpp checks the ops one by one and a training step as a whole.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "device_tensors.h"
#include "dp_reference.h"
#include "engine/context.h"
#include "env_guard.h"
#include "gpu_skip.h"
#include "layers/model.h"
#include "seeded_values.h"

using namespace replica;

namespace {

const Device kGpu{DeviceType::CUDA, 0, 0};

// One model in two contexts (NCHW and channels_last): each module's output in both and their
// relative L2 distance, one line each; Sequentials entered child by child, and a block's
// Sequential children (a residual block's body, its shortcut) entered on the block's input. A
// block runs its body again in its own forward: in training mode a BatchNorm then counts the
// batch twice in its running statistics, alike in both layouts, and nothing compares them.
struct LayoutWalk {
  LayoutWalk(DeviceContext& nchw, DeviceContext& nhwc, double tolerance, size_t leaves_checked)
      : a(nchw), b(nhwc), tol(tolerance), checked(leaves_checked) {}
  DeviceContext &a, &b;
  double tol;            // the largest distance a checked leaf may have
  size_t checked;        // how many leaves, in forward order, are held to tol
  std::vector<std::string> lines;
  std::string first_off;  // the first checked leaf past tol
  size_t leaves = 0;
  double worst = 0;       // over every stage

  static std::string child_name(const std::string& name, const Module& m, size_t k) {
    const std::string& own = m.children()[k].first;
    return name + "." + (own.empty() ? "body" : own);  // a residual block's body is unnamed
  }

  std::pair<Tensor, Tensor> run(Module& ma, Module& mb, const Tensor& xa, const Tensor& xb,
                                const std::string& name) {
    if (ma.type() == "Sequential") {
      Tensor ya = xa, yb = xb;
      for (size_t k = 0; k < ma.children().size(); ++k)
        std::tie(ya, yb) = run(*ma.children()[k].second, *mb.children()[k].second, ya, yb,
                               child_name(name, ma, k));
      return {ya, yb};
    }
    for (size_t k = 0; k < ma.children().size(); ++k)
      if (ma.children()[k].second->type() == "Sequential")
        run(*ma.children()[k].second, *mb.children()[k].second, xa, xb, child_name(name, ma, k));
    Tensor ya = ma.forward(a, xa), yb = mb.forward(b, xb);
    const double d = test::relative_l2(test::get(a, ya), test::get(b, yb));
    lines.push_back(fmt::format("{} {} {}: {:.3g}{}", name, ma.type(), shape_str(ya.shape()), d,
                                yb.channels_last() ? " (NHWC)" : ""));
    if (ma.children().empty() && leaves++ < checked && d > tol && first_off.empty())
      first_off = name;
    worst = std::max(worst, d);
    return {ya, yb};
  }
};

struct Case {
  Precision precision;
  bool pad;  // REPLICA_PAD_CHANNELS: the stem's 3 channels padded to 8
  uint64_t seed;
  bool training_batch;  // the training case's batch (test_cuda_channels_last), else N(0, 1)
  size_t checked;       // leaves held to the tolerance
  float block_gamma = 1;  // each residual block's last BatchNorm weight (damp_residual_branches)
  double tol = 0;         // the largest distance a checked leaf may have; 0: the precision's
};

void walk_resnet50(const Case& c) {
  const test::ScopedEnv pad("REPLICA_PAD_CHANNELS", c.pad ? "1" : "0");
  const std::string what = fmt::format(
      "resnet50 {}, padded stem {}, seed {}{}{}", precision_name(c.precision), c.pad ? "on" : "off",
      c.seed, c.training_batch ? ", the training batch" : "",
      c.block_gamma != 1 ? fmt::format(", block gammas {}", c.block_gamma) : "");
  CAPTURE(what);
  ContextOptions o{0, true, c.precision};
  DeviceContext nchw(kGpu, o);
  o.channels_last = true;
  DeviceContext nhwc(kGpu, o);
  const Shape xs{16, 3, 32, 32};
  auto ma = make_model("resnet50", {3, 32, 32}, 10), mb = make_model("resnet50", {3, 32, 32}, 10);
  ma->materialize(nchw, c.seed);
  mb->materialize(nhwc, c.seed);
  if (c.block_gamma != 1) {
    test::damp_residual_branches(*ma, nchw, c.block_gamma);
    test::damp_residual_branches(*mb, nhwc, c.block_gamma);
  }
  const auto input = [&] {
    if (!c.training_batch) return test::normal_values(shape_numel(xs), 12);
    const Batch batch = test::make_batches({3, 32, 32}, 16, 1, 6).at(0);
    return std::vector<float>(batch.images.f32(), batch.images.f32() + batch.images.numel());
  };
  const std::vector<float> xv = input();
  // Two kernels' outputs of one bf16 convolution differ by an ulp (2^-8 relative) where their
  // sums round apart; a value read from the wrong place differs by O(1). fp32's rounding grows
  // to about 1e-4 by the logits.
  const double tol = c.tol > 0 ? c.tol : c.precision == Precision::Bf16 ? 3e-2 : 1e-3;
  LayoutWalk walk{nchw, nhwc, tol, c.checked};
  walk.run(ma->root(), mb->root(), test::put(nchw, xs, xv), test::put(nhwc, xs, xv),
           "resnet50");
  std::string all;
  for (const std::string& l : walk.lines) all += l + "\n";
  MESSAGE(what << ": each stage's relative L2, channels_last against NCHW (largest " << walk.worst
               << ")\n" << all);
  CHECK_MESSAGE(walk.first_off.empty(), "first stage past " << walk.tol << ": " << walk.first_off);
}

}  // namespace

// ResNet-50 on 3x32x32: the stem padded to 8 channels or not, BatchNorms of 64 to 2048 channels
// over planes of 16x16 down to 1x1, the NHWC max pool, the bottlenecks. Seed-5 weights and a
// standard normal input: every stage agreed to rounding on an H200 (2026-11-29; in bf16 the
// layouts' outputs were the same bits from the max pool on).
TEST_CASE("each stage of a ResNet's forward in channels_last gives NCHW's output") {
  if (!test::have_gpu()) return;
  constexpr size_t kAll = std::numeric_limits<size_t>::max();
  for (const Case& c : {Case{Precision::Fp32, true, 5, false, kAll},
                        Case{Precision::Bf16, true, 5, false, kAll},
                        Case{Precision::Bf16, false, 5, false, kAll}}) {
    if (c.precision == Precision::Bf16 && !test::have_tensor_cores("bf16 cases")) continue;
    walk_resnet50(c);
  }
}

// The weights (seed 11) and batch of test_cuda_channels_last's training case, whose loss with
// the padded stem was 2.533 against NCHW's 2.397 on an H200 (2026-11-29). From the default init
// that model's loss moves by percents for an ulp anywhere (bench/results/2026-11-30-cpu.md), so
// there only the stem's own output is held to rounding, and every later stage is printed, to
// say whether the difference starts in the stem or grows from rounding after it. On the CPU,
// the stem summed in another order grew from 1.5e-5 to 0.39 by the logits. With the residual
// branches damped (as the training case now starts) it grew to 0.017 (2026-11-30-cpu/
// stem-orders-by-stage.cpp): every stage is held to 0.1 there, where a value read from the
// wrong place is O(1).
TEST_CASE("the padded stem's output on the training case's weights and batch is NCHW's") {
  if (!test::have_gpu() || !test::have_tensor_cores("bf16 cases")) return;
  constexpr size_t kAll = std::numeric_limits<size_t>::max();
  const uint64_t seed = test::sgd_options("resnet50", {3, 32, 32}).seed;  // the training case's
  walk_resnet50(Case{Precision::Bf16, true, seed, true, 1});
  walk_resnet50(Case{Precision::Bf16, true, seed, true, kAll, test::kDampedBlockGamma, 0.1});
}
