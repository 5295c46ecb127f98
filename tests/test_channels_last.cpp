// channels_last activations (engine/tensor.h): copies between layouts, the views a
// channels_last tensor allows, and the layout's plumbing through the layers. On CPU devices
// (REPLICA_CHANNELS_LAST_ON_CPU=1) every op runs on NCHW copies of channels_last tensors
// (engine/bf16_storage.h), so a model trained with its convolutions' outputs NHWC must end in
// the bits of one trained NCHW: any tensor laid out one way and read the other would show.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "dp_reference.h"
#include "engine/bf16_storage.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/ops.h"
#include "env_guard.h"
#include "layers/layers.h"
#include "layers/model.h"
#include "parallel/engines/dp_engine.h"
#include "parallel/engines/train_engine.h"

using namespace replica;

namespace {

const Device kCpu{DeviceType::CPU, 0, 0};

// An NCHW F32 tensor whose element (n, c, h, w) holds its NCHW index.
Tensor counting(DeviceContext& ctx, const Shape& shape) {
  Tensor t = ctx.alloc(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = float(i);
  return t;
}

struct ChannelsLastOnCpu : test::ScopedEnv {
  ChannelsLastOnCpu() : ScopedEnv("REPLICA_CHANNELS_LAST_ON_CPU", "1") {}
};

// A backend whose max pooling and add take one layout for all their tensors
// (Layouts::Uniform, as the CUDA kernels do), recording which of a call's tensors reach it
// channels_last.
class UniformMaxPool final : public Backend {
 public:
  UniformMaxPool() : inner_(make_cpu_backend()) {}
  std::vector<bool> channels_last;  // the last call's tensors, in order (copies not counted)

#define REPLICA_OP(name, params, args)        \
  void name params override {                 \
    if (OpId::name != OpId::copy) note args;  \
    inner_->name args;                        \
  }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

  Layouts layouts(OpId op) const override {
    return op == OpId::maxpool2d_forward || op == OpId::add ? Layouts::Uniform
                                                             : inner_->layouts(op);
  }

 private:
  template <class... A>
  void note(DeviceContext&, const A&... a) {
    channels_last.clear();
    (note_one(a), ...);
  }
  void note_one(const Tensor& t) { channels_last.push_back(t.channels_last()); }
  template <class T>
  void note_one(const T&) {}

  std::unique_ptr<Backend> inner_;
};

}  // namespace

TEST_CASE("copy lays a tensor out NHWC and back, converting F32 <-> BF16 on the way") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  const Shape shape{2, 3, 2, 5};  // N, C, H, W
  const Tensor nchw = counting(ctx, shape);
  Tensor nhwc = ctx.alloc(shape, DType::F32, true);
  ctx.ops().copy(ctx, nhwc, nchw);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t p = 0; p < 10; ++p)
        CHECK(nhwc.f32()[(n * 10 + p) * 3 + c] == float((n * 3 + c) * 10 + p));
  Tensor narrow = ctx.alloc(shape, DType::BF16, true);  // F32 NCHW -> BF16 NHWC in one copy
  ctx.ops().copy(ctx, narrow, nchw);
  Tensor back = ctx.alloc(shape);
  ctx.ops().copy(ctx, back, narrow);
  for (int64_t i = 0; i < back.numel(); ++i) CHECK(back.f32()[i] == bf16_round(float(i)));
  // Across layouts the shapes must be one; I32 has no layouts to convert.
  Tensor other = ctx.alloc({2, 3, 5, 2}, DType::F32, true);
  CHECK_THROWS_AS(ctx.ops().copy(ctx, other, nchw), Error);
}

TEST_CASE("a channels_last tensor: rows are samples; views only where NCHW lays it out alike") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  const Tensor t = ctx.alloc({4, 8, 3, 3}, DType::F32, true);
  const Tensor rows = t.slice_rows(1, 3);
  CHECK(rows.channels_last());
  CHECK(rows.shape() == Shape{2, 8, 3, 3});
  CHECK(static_cast<const char*>(rows.raw()) - static_cast<const char*>(t.raw()) == 72 * 4);
  CHECK_THROWS_AS(t.reshape({4, 72}), Error);  // its elements are not in NCHW's order
  const Tensor pooled = ctx.alloc({4, 8, 1, 1}, DType::F32, true);
  const Tensor flat = pooled.reshape({4, 8});  // one position per plane: the same order
  CHECK_FALSE(flat.channels_last());
  CHECK_THROWS_AS(ctx.alloc({4, 8}, DType::F32, true), Error);  // 4-D only
}

TEST_CASE("layers keep the layout: a convolution's NHWC output flows on; Flatten gives NCHW") {
  const ChannelsLastOnCpu on;
  DeviceContext ctx(kCpu, ContextOptions{1, false, Precision::Fp32, false, true});
  Model wide(ModelSpec{"wide", {}, 16}, std::make_unique<Conv2d>(8, 16, 3, 1, 1, false));
  Model stem(ModelSpec{"stem", {}, 8}, std::make_unique<Conv2d>(3, 8, 3, 1, 1, false));
  Model odd(ModelSpec{"odd", {}, 12}, std::make_unique<Conv2d>(8, 12, 3, 1, 1, false));
  wide.materialize(ctx, 1);
  stem.materialize(ctx, 2);
  odd.materialize(ctx, 4);
  const Tensor x = counting(ctx, {2, 8, 5, 5});
  CHECK(wide.forward(ctx, x).channels_last());  // 8 -> 16 channels: NHWC
  // 3 in, unpadded (the default): NCHW; 12 out, which cuDNN's NHWC kernels refuse: NCHW
  CHECK_FALSE(stem.forward(ctx, counting(ctx, {2, 3, 5, 5})).channels_last());
  CHECK_FALSE(odd.forward(ctx, x).channels_last());
  {
    const test::ScopedEnv padded("REPLICA_PAD_CHANNELS", "1");  // 3 in, padded to 8 on a GPU
    CHECK(stem.forward(ctx, counting(ctx, {2, 3, 5, 5})).channels_last());
    CHECK(wide.forward(ctx, x).channels_last());
  }

  // A max-pool of 8 NCHW channels hands its output on NHWC (the convolutions after it read
  // that); its gradient comes back in the input's layout, with NCHW's values.
  Model pool(ModelSpec{"pool", {}, 8}, std::make_unique<MaxPool2d>(3, 2, 1));
  pool.materialize(ctx, 3);
  pool.set_training(true);
  const Tensor pooled = pool.forward(ctx, x);
  CHECK(pooled.channels_last());
  Tensor pooled_nchw = ctx.alloc(pooled.shape());
  ctx.ops().copy(ctx, pooled_nchw, pooled);
  const Tensor dpool = pool.backward(ctx, pooled);
  CHECK_FALSE(dpool.channels_last());
  DeviceContext plain(kCpu, ContextOptions{1});
  Model reference(ModelSpec{"pool", {}, 8}, std::make_unique<MaxPool2d>(3, 2, 1));
  reference.materialize(plain, 3);
  reference.set_training(true);
  const Tensor ref_pooled = reference.forward(plain, x);
  CHECK_FALSE(ref_pooled.channels_last());
  const Tensor ref_dx = reference.backward(plain, ref_pooled);
  CHECK(std::vector<float>(pooled_nchw.f32(), pooled_nchw.f32() + pooled_nchw.numel()) ==
        std::vector<float>(ref_pooled.f32(), ref_pooled.f32() + ref_pooled.numel()));
  CHECK(std::vector<float>(dpool.f32(), dpool.f32() + dpool.numel()) ==
        std::vector<float>(ref_dx.f32(), ref_dx.f32() + ref_dx.numel()));

  // Flatten of an NHWC tensor: the features in NCHW's order; its gradient goes back NHWC.
  Tensor nhwc = ctx.alloc({2, 8, 5, 5}, DType::F32, true);
  ctx.ops().copy(ctx, nhwc, x);
  Flatten flatten;
  flatten.set_training(true);
  const Tensor features = flatten.forward(ctx, nhwc);
  REQUIRE(features.shape() == Shape{2, 200});
  for (int64_t i = 0; i < 400; ++i) CHECK(features.f32()[i] == float(i));
  const Tensor dx = flatten.backward(ctx, features);
  CHECK(dx.channels_last());
  CHECK(test::relative_l2(std::vector<float>(nhwc.f32(), nhwc.f32() + 400),
                          std::vector<float>(dx.f32(), dx.f32() + 400)) == 0.0);
}

TEST_CASE("ResNets trained with NHWC activations end in NCHW's bits (CPU: ops on NCHW copies)") {
  const ChannelsLastOnCpu on;
  struct Case {
    std::string model;
    Shape shape;
    Precision precision;
    std::string devices;
    const char* pad = "1";  // REPLICA_PAD_CHANNELS: "0" runs the stem NCHW (unpadded on a GPU)
  };
  // ResNet-18's basic blocks and ResNet-50's bottlenecks with their downsampling shortcuts;
  // fp32 and bf16 (whose copies convert dtype and layout at once); one device and DP; the stem
  // NHWC (its few channels padded on a GPU) and NCHW.
  for (const Case& c : {Case{"resnet18", {1, 28, 28}, Precision::Fp32, "cpu"},
                        Case{"resnet18", {1, 28, 28}, Precision::Bf16, "cpu"},
                        Case{"resnet50", {3, 32, 32}, Precision::Bf16, "cpu"},
                        Case{"resnet50", {3, 32, 32}, Precision::Bf16, "cpu", "0"},
                        Case{"resnet18", {1, 28, 28}, Precision::Fp32, "cpu*2"}}) {
    CAPTURE(c.model);
    CAPTURE(c.devices);
    CAPTURE(precision_name(c.precision));
    CAPTURE(c.pad);
    const test::ScopedEnv pad("REPLICA_PAD_CHANNELS", c.pad);
    EngineOptions o = test::sgd_options(c.model, c.shape);
    o.precision = c.precision;
    const auto batches = test::make_batches(o.input_shape, 4, 2, 5);
    auto train = [&](bool channels_last) {
      o.channels_last = channels_last;
      auto e = c.devices == "cpu" ? make_single_device_engine(kCpu, o)
                                  : make_dp_engine(parse_devices(c.devices), o);
      for (const Batch& b : batches) e->train_step(b);
      e->synchronize();
      return std::make_pair(test::params_of(*e), e->last_loss());
    };
    const auto [nchw, nchw_loss] = train(false);
    const auto [nhwc, nhwc_loss] = train(true);
    CHECK(nhwc_loss == nchw_loss);
    CHECK(test::relative_l2(nchw, nhwc) == 0.0);
  }
}

TEST_CASE("a one-layout op takes a 4-D tensor that both layouts lay out alike as it is") {
  const ChannelsLastOnCpu on;
  DeviceContext ctx(kCpu, ContextOptions{1, false, Precision::Fp32, false, true});
  auto recording = std::make_unique<UniformMaxPool>();
  const UniformMaxPool& seen = *recording;
  const std::unique_ptr<Backend> layer = make_bf16_storage_backend(std::move(recording));
  const Tensor x = ctx.alloc({2, 8, 3, 3}, DType::F32, true);
  // A 1x1 output is laid out alike either way: the call keeps x's layout, no copies.
  Tensor pixel = ctx.alloc({2, 8, 1, 1}, DType::F32, true);
  layer->maxpool2d_forward(ctx, x, pixel, Pool2dParams{3, 2, 0});
  CHECK(seen.channels_last == std::vector<bool>{true, true});
  Tensor nchw_pixel = ctx.alloc({2, 8, 1, 1});
  layer->maxpool2d_forward(ctx, x, nchw_pixel, Pool2dParams{3, 2, 0});
  CHECK(seen.channels_last == std::vector<bool>{true, false});
  // A 2x2 NCHW output beside an NHWC input: both reach the kernel NCHW.
  Tensor plane = ctx.alloc({2, 8, 2, 2});
  layer->maxpool2d_forward(ctx, x, plane, Pool2dParams{2, 1, 0});
  CHECK(seen.channels_last == std::vector<bool>{false, false});
  // [N, C*H*W, 1, 1] is laid out alike both ways too, but its elements are in NCHW's order of
  // x's: an elementwise op beside x gets NCHW copies.
  Tensor nhwc = ctx.alloc({2, 8, 3, 3}, DType::F32, true);
  const Tensor flat = ctx.alloc({2, 72, 1, 1});
  layer->add(ctx, nhwc, flat, 1.f);
  CHECK(seen.channels_last == std::vector<bool>{false, false});
}

TEST_CASE("channels_last on a CPU device is still refused outside the plumbing test") {
  CHECK_THROWS_AS(
      DeviceContext(kCpu, ContextOptions{1, false, Precision::Fp32, false, true}), UsageError);
}
