// CUDA vs CPU parity for every Backend op: the same inputs through both backends, outputs
// compared within per-op tolerances. Odd shapes on purpose (batch 3, 5x7 images, stride 2,
// padding 1). Without a GPU every case says so, visibly, and passes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/cudart.h"
#include "engine/device.h"
#include "engine/ops.h"
#include "engine/tensor.h"
#include "env_guard.h"
#include "gpu_skip.h"

using namespace replica;

namespace {

// One CPU and one GPU context per test case.
struct Rig {
  DeviceContext cpu{Device{DeviceType::CPU, 0, 0}};
  DeviceContext gpu;
  explicit Rig(bool deterministic = false) : Rig(ContextOptions{0, deterministic}) {}
  explicit Rig(const ContextOptions& gpu_options)
      : gpu(Device{DeviceType::CUDA, 0, 0}, gpu_options) {
    gpu.activate();
  }
  Backend& c() { return cpu.ops(); }
  Backend& g() { return gpu.ops(); }
};

std::vector<float> random_values(int64_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// A tensor held twice: on the CPU device and (a copy) on the GPU.
struct Pair {
  Tensor c, g;
};

Pair make_twin(Rig& r, const Shape& shape, const std::vector<float>& values) {
  Pair p;
  p.c = r.cpu.alloc(shape);
  REQUIRE(static_cast<int64_t>(values.size()) == p.c.numel());
  std::copy(values.begin(), values.end(), p.c.f32());
  p.g = r.gpu.alloc(shape);
  r.g().copy(r.gpu, p.g, p.c);
  return p;
}

Pair make_random(Rig& r, const Shape& shape, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return make_twin(r, shape, random_values(shape_numel(shape), seed, lo, hi));
}

// As make_random, but the GPU tensor starts one float into its allocation: not 16-byte aligned,
// so kernels that move float4s must take their one-float path.
Pair make_random_unaligned(Rig& r, const Shape& shape, uint32_t seed, float lo = -1.f,
                           float hi = 1.f) {
  Pair p = make_random(r, shape, seed, lo, hi);
  Tensor g = r.gpu.alloc({shape_numel(shape) + 1}).view(1, shape);
  r.g().copy(r.gpu, g, p.g);
  p.g = g;
  return p;
}

// An optimizer step's numbers (backend_ops.inc) on both devices.
Pair step_scalars(Rig& r, const StepScalars& values) {
  return make_twin(r, {2}, {values[0], values[1]});
}

Pair make_labels(Rig& r, const std::vector<int32_t>& labels) {
  Pair p;
  const Shape shape{static_cast<int64_t>(labels.size())};
  p.c = r.cpu.alloc(shape, DType::I32);
  std::copy(labels.begin(), labels.end(), p.c.i32());
  p.g = r.gpu.alloc(shape, DType::I32);
  r.g().copy(r.gpu, p.g, p.c);
  return p;
}

std::vector<float> host_values(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

std::vector<float> gpu_values(Rig& r, const Tensor& t) {
  Tensor h = Tensor::empty(host_allocator(), t.shape());
  r.g().copy(r.gpu, h, t);
  r.gpu.synchronize();
  return host_values(h);
}

std::vector<int32_t> gpu_ints(Rig& r, const Tensor& t) {
  Tensor h = Tensor::empty(host_allocator(), t.shape(), DType::I32);
  r.g().copy(r.gpu, h, t);
  r.gpu.synchronize();
  return std::vector<int32_t>(h.i32(), h.i32() + h.numel());
}

int32_t gpu_int(Rig& r, const Tensor& t) { return gpu_ints(r, t)[0]; }

// |cpu - gpu| <= atol + rtol * |cpu| everywhere (NaN must match NaN).
void expect_close(const std::vector<float>& cpu, const std::vector<float>& gpu, double rtol,
                  double atol, const std::string& what) {
  REQUIRE_MESSAGE(cpu.size() == gpu.size(), what << ": size " << cpu.size() << " vs " << gpu.size());
  size_t bad = 0, first = 0;
  double worst = 0.0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double a = cpu[i], b = gpu[i];
    if (std::isnan(a) || std::isnan(b)) {
      if (!(std::isnan(a) && std::isnan(b))) {
        if (bad++ == 0) first = i;
      }
      continue;
    }
    const double err = std::fabs(a - b);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::fabs(a))) {
      if (bad++ == 0) first = i;
    }
  }
  INFO(what << ": " << bad << " of " << cpu.size() << " elements differ; first at " << first
            << " (cpu " << (cpu.empty() ? 0.f : cpu[first]) << ", gpu "
            << (gpu.empty() ? 0.f : gpu[first]) << "); max abs error " << worst);
  CHECK(bad == 0);
}

void expect_close(Rig& r, const Pair& p, double rtol, double atol, const std::string& what) {
  expect_close(host_values(p.c), gpu_values(r, p.g), rtol, atol, what);
}

constexpr double kGemmRtol = 1e-4, kGemmAtol = 1e-5;
// cuDNN may pick Winograd or FFT algorithms: exact in exact arithmetic, slightly noisier in FP32.
constexpr double kConvAtol = 1e-4;

}  // namespace

TEST_CASE("cuda runtime: device count, names and versions") {
  int n = -1;
  CHECK_NOTHROW(n = cuda_device_count());  // no driver or no GPU is zero, never an error
  CHECK(n >= 0);
  CHECK(cuda_device_count() == n);
  if (!test::have_gpu()) return;
  MESSAGE(cudart::versions());
  for (int i = 0; i < n; ++i) {
    CHECK(!cudart::device_name(i).empty());
    CHECK(cudart::device_total_memory(i) > 0);
  }
}

TEST_CASE("cuda parity: memory ops (fill, copy, add, scale, zero-size)") {
  if (!test::have_gpu()) return;
  Rig r;
  Pair a = make_random(r, {3, 5, 7}, 1);
  Pair b = make_random(r, {3, 5, 7}, 2);
  expect_close(r, a, 0, 0, "copy host->device->host round trip");

  r.c().add(r.cpu, a.c, b.c, -0.75f);
  r.g().add(r.gpu, a.g, b.g, -0.75f);
  expect_close(r, a, 1e-6, 1e-7, "add");

  r.c().scale(r.cpu, a.c, 3.5f);
  r.g().scale(r.gpu, a.g, 3.5f);
  expect_close(r, a, 1e-6, 1e-7, "scale");
  Pair u = make_random_unaligned(r, {3, 5, 7}, 4, -1.f, 1.f);  // one float at a time
  r.c().add(r.cpu, u.c, b.c, 2.f);
  r.g().add(r.gpu, u.g, b.g, 2.f);
  r.c().scale(r.cpu, u.c, -1.5f);
  r.g().scale(r.gpu, u.g, -1.5f);
  expect_close(r, u, 1e-6, 1e-7, "add and scale, unaligned");

  Tensor d2d = r.gpu.alloc({3, 5, 7});
  r.g().copy(r.gpu, d2d, a.g);
  expect_close(host_values(a.c), gpu_values(r, d2d), 0, 0, "device-to-device copy");

  Pair f = make_random(r, {13}, 3);
  r.c().fill(r.cpu, f.c, 2.5f);
  r.g().fill(r.gpu, f.g, 2.5f);
  expect_close(r, f, 0, 0, "fill 2.5");
  r.c().fill(r.cpu, f.c, 0.f);
  r.g().fill(r.gpu, f.g, 0.f);
  expect_close(r, f, 0, 0, "fill 0");

  Tensor ig = r.gpu.alloc({1}, DType::I32);
  r.g().fill(r.gpu, ig, 7.f);
  CHECK(gpu_int(r, ig) == 7);

  // Zero-size tensors are no-ops, not errors.
  Tensor z1 = r.gpu.alloc({0, 4}), z2 = r.gpu.alloc({0, 4});
  CHECK_NOTHROW(r.g().fill(r.gpu, z1, 1.f));
  CHECK_NOTHROW(r.g().add(r.gpu, z1, z2, 1.f));
  CHECK_NOTHROW(r.g().scale(r.gpu, z1, 2.f));
  CHECK_NOTHROW(r.g().copy(r.gpu, z1, z2));
  CHECK_NOTHROW(r.g().relu_forward(r.gpu, z1, z2));
  CHECK_NOTHROW(r.gpu.synchronize());
}

TEST_CASE("cuda parity: gather_rows (float4 rows, odd rows, I32 labels, an unaligned table)") {
  if (!test::have_gpu()) return;
  Rig r;
  const std::vector<int32_t> rows = {4, 0, 4, 2, 6};  // repeats and out of order
  Pair idx = make_labels(r, rows);
  // Shapes: rows of 28 floats (the float4 path), of 7 (one float at a time); labels are I32 rows
  // of one element; a table starting one float into an allocation takes the 4-byte path.
  for (const Shape& table_shape : {Shape{7, 1, 4, 7}, Shape{7, 7}}) {
    CAPTURE(shape_str(table_shape));
    Pair table = make_random(r, table_shape, 11);
    Shape out_shape = table_shape;
    out_shape[0] = 5;
    Pair out = make_random(r, out_shape, 12);
    r.c().gather_rows(r.cpu, out.c, table.c, idx.c);
    r.g().gather_rows(r.gpu, out.g, table.g, idx.g);
    expect_close(r, out, 0, 0, "gather_rows");
  }
  Pair big = make_random(r, {1 + 7 * 8}, 13);
  Tensor unaligned_g = big.g.slice_rows(1, 1 + 7 * 8).reshape({7, 8});
  Tensor unaligned_c = big.c.slice_rows(1, 1 + 7 * 8).reshape({7, 8});
  Pair out{r.cpu.alloc({5, 8}), r.gpu.alloc({5, 8})};
  r.c().gather_rows(r.cpu, out.c, unaligned_c, idx.c);
  r.g().gather_rows(r.gpu, out.g, unaligned_g, idx.g);
  expect_close(r, out, 0, 0, "gather_rows from a table 4 bytes past an alignment");

  Pair labels = make_labels(r, {10, 11, 12, 13, 14, 15, 16});
  Tensor got = r.gpu.alloc({5}, DType::I32);
  r.g().gather_rows(r.gpu, got, labels.g, idx.g);
  Tensor host = Tensor::empty(host_allocator(), {5}, DType::I32);
  r.g().copy(r.gpu, host, got);
  r.gpu.synchronize();
  for (int i = 0; i < 5; ++i) CHECK(host.i32()[i] == 10 + rows[size_t(i)]);
}

TEST_CASE("cuda parity: linear forward and backward") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t N = 3, in = 7, out = 5;
  Pair x = make_random(r, {N, in}, 10), w = make_random(r, {out, in}, 11);
  Pair b = make_random(r, {out}, 12), dy = make_random(r, {N, out}, 13);
  Pair y = make_random(r, {N, out}, 14), y2 = make_random(r, {N, out}, 15);
  r.c().linear_forward(r.cpu, x.c, w.c, b.c, y.c);
  r.g().linear_forward(r.gpu, x.g, w.g, b.g, y.g);
  expect_close(r, y, kGemmRtol, kGemmAtol, "linear y (with bias)");
  r.c().linear_forward(r.cpu, x.c, w.c, Tensor(), y2.c);
  r.g().linear_forward(r.gpu, x.g, w.g, Tensor(), y2.g);
  expect_close(r, y2, kGemmRtol, kGemmAtol, "linear y (no bias)");

  // dw and db accumulate onto what is there; dx is overwritten.
  Pair dx = make_random(r, {N, in}, 16), dw = make_random(r, {out, in}, 17);
  Pair db = make_random(r, {out}, 18);
  for (int rep = 0; rep < 2; ++rep) {
    r.c().linear_backward(r.cpu, x.c, w.c, dy.c, dx.c, dw.c, db.c);
    r.g().linear_backward(r.gpu, x.g, w.g, dy.g, dx.g, dw.g, db.g);
  }
  expect_close(r, dx, kGemmRtol, kGemmAtol, "linear dx");
  expect_close(r, dw, kGemmRtol, kGemmAtol, "linear dw (+= twice)");
  expect_close(r, db, kGemmRtol, kGemmAtol, "linear db (+= twice)");

  // Skipped outputs and an empty batch.
  Tensor none;
  CHECK_NOTHROW(r.g().linear_backward(r.gpu, x.g, w.g, dy.g, none, dw.g, none));
  Tensor x0 = r.gpu.alloc({0, in}), y0 = r.gpu.alloc({0, out});
  CHECK_NOTHROW(r.g().linear_forward(r.gpu, x0, w.g, b.g, y0));
  CHECK_NOTHROW(r.gpu.synchronize());

  // The bias passes' 64-bit index path (real shapes take it only past 2^31 values).
  const test::WideIndexPath wide;
  Pair yw = make_random(r, {N, out}, 19), dbw = make_random(r, {out}, 20);
  r.c().linear_forward(r.cpu, x.c, w.c, b.c, yw.c);
  r.g().linear_forward(r.gpu, x.g, w.g, b.g, yw.g);
  expect_close(r, yw, kGemmRtol, kGemmAtol, "linear y (with bias, wide index)");
  r.c().linear_backward(r.cpu, x.c, w.c, dy.c, none, none, dbw.c);
  r.g().linear_backward(r.gpu, x.g, w.g, dy.g, none, none, dbw.g);
  expect_close(r, dbw, kGemmRtol, kGemmAtol, "linear db (wide index)");
}

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
  Tensor x0 = r.gpu.alloc({0, 4, 5, 7}), w = r.gpu.alloc({6, 4, 3, 3}), y0 = r.gpu.alloc({0, 6, 5, 7});
  CHECK_NOTHROW(r.g().conv2d_forward(r.gpu, x0, w, Tensor(), y0, Conv2dParams{1, 1}));
  CHECK_NOTHROW(r.gpu.synchronize());
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
  // The same inputs again give the same bits on the GPU (sums in a fixed order).
  Pair y2 = make_random(r, shape, 43), dx2 = make_random(r, shape, 44);
  Pair sm2 = make_random(r, {C}, 45), si2 = make_random(r, {C}, 46);
  Tensor none;
  r.g().batchnorm_forward_train(r.gpu, x.g, gamma.g, beta.g, none, none, momentum, eps, y2.g,
                                sm2.g, si2.g, res.g, relu);
  r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx2.g, none, none);
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
    r.g().batchnorm_forward_train(r.gpu, x.g, gamma.g, beta.g, none, none, momentum, eps, y3.g,
                                  sm3.g, si3.g, res.g, relu);
    r.g().batchnorm_backward(r.gpu, x.g, gamma.g, sm.g, si.g, dy.g, mask_g, dx3.g, dg3.g,
                             db3.g);
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

TEST_CASE("cuda parity: relu, mul and dropout") {
  if (!test::have_gpu()) return;
  Rig r;
  // Float4s (420 values), float4s and a tail of 1 (105), and one float at a time (unaligned).
  for (const Shape& shape : {Shape{3, 4, 5, 7}, Shape{3, 5, 7}})
    for (const bool unaligned : {false, true}) {
      const auto make = unaligned ? make_random_unaligned : make_random;
      const std::string tag = shape_str(shape) + (unaligned ? " unaligned" : "");
      Pair x = make(r, shape, 50, -1.f, 1.f), y = make(r, shape, 51, -1.f, 1.f);
      Pair dy = make(r, shape, 52, -1.f, 1.f), dx = make(r, shape, 53, -1.f, 1.f);
      r.c().relu_forward(r.cpu, x.c, y.c);
      r.g().relu_forward(r.gpu, x.g, y.g);
      expect_close(r, y, 0, 0, "relu y " + tag);
      r.c().relu_backward(r.cpu, y.c, dy.c, dx.c);
      r.g().relu_backward(r.gpu, y.g, dy.g, dx.g);
      expect_close(r, dx, 0, 0, "relu dx " + tag);
      Pair prod = make(r, shape, 54, -1.f, 1.f);
      r.c().mul(r.cpu, x.c, dy.c, prod.c);
      r.g().mul(r.gpu, x.g, dy.g, prod.g);
      expect_close(r, prod, 0, 0, "mul " + tag);
    }

  const Shape s{3, 4, 5, 7};
  Pair x = make_random(r, s, 50);

  for (float p : {0.f, 0.3f, 0.5f, 1.f}) {
    Pair yd = make_random(r, s, 55), mask = make_random(r, s, 56);
    r.c().dropout_forward(r.cpu, x.c, yd.c, mask.c, p, 1234567);
    r.g().dropout_forward(r.gpu, x.g, yd.g, mask.g, p, 1234567);
    expect_close(r, mask, 0, 0, "dropout mask p=" + std::to_string(p));
    expect_close(r, yd, 0, 0, "dropout y p=" + std::to_string(p));
  }
}

namespace {

void maxpool_case(const Shape& xs, Pool2dParams p, bool ties) {
  Rig r;
  const int64_t P = window_out(xs[2], p.kernel, p.stride, p.padding);
  const int64_t Q = window_out(xs[3], p.kernel, p.stride, p.padding);
  const Shape ys{xs[0], xs[1], P, Q};
  std::vector<float> v = random_values(shape_numel(xs), 60, -3.f, 3.f);
  if (ties)
    for (auto& e : v) e = std::round(e);  // few distinct values: many tied maxima
  const std::string tag = "maxpool " + shape_str(xs) + " k" + std::to_string(p.kernel) + " s" +
                          std::to_string(p.stride) + " p" + std::to_string(p.padding) +
                          (ties ? " ties" : "");
  Pair x = make_twin(r, xs, v), y = make_random(r, ys, 61), dy = make_random(r, ys, 62);
  Pair dx = make_random(r, xs, 63);
  r.c().maxpool2d_forward(r.cpu, x.c, y.c, p);
  r.g().maxpool2d_forward(r.gpu, x.g, y.g, p);
  expect_close(r, y, 0, 0, tag + " y");
  r.c().maxpool2d_backward(r.cpu, x.c, y.c, dy.c, dx.c, p);
  r.g().maxpool2d_backward(r.gpu, x.g, y.g, dy.g, dx.g, p);
  expect_close(r, dx, 1e-6, 1e-7, tag + " dx");
}

void adaptive_case(const Shape& xs, int64_t P, int64_t Q) {
  Rig r;
  const Shape ys{xs[0], xs[1], P, Q};
  const std::string tag = "adaptive avgpool " + shape_str(xs) + " -> " + std::to_string(P) + "x" +
                          std::to_string(Q);
  Pair x = make_random(r, xs, 70), y = make_random(r, ys, 71), dy = make_random(r, ys, 72);
  Pair dx = make_random(r, xs, 73);
  r.c().adaptive_avgpool2d_forward(r.cpu, x.c, y.c);
  r.g().adaptive_avgpool2d_forward(r.gpu, x.g, y.g);
  expect_close(r, y, 1e-6, 1e-7, tag + " y");
  r.c().adaptive_avgpool2d_backward(r.cpu, dy.c, dx.c);
  r.g().adaptive_avgpool2d_backward(r.gpu, dy.g, dx.g);
  expect_close(r, dx, 1e-6, 1e-7, tag + " dx");
}

}  // namespace

TEST_CASE("cuda parity: max pooling") {
  if (!test::have_gpu()) return;
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, false);  // ResNet's stem pool
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, true);
  maxpool_case({3, 4, 5, 7}, Pool2dParams{2, 2, 0}, true);
  maxpool_case({3, 2, 9, 8}, Pool2dParams{3, 1, 1}, true);  // overlapping windows, stride 1
  const test::WideIndexPath wide;  // the 64-bit index path
  maxpool_case({3, 4, 5, 7}, Pool2dParams{3, 2, 1}, true);
  maxpool_case({3, 2, 9, 8}, Pool2dParams{3, 1, 1}, true);
}

TEST_CASE("cuda parity: adaptive average pooling") {
  if (!test::have_gpu()) return;
  adaptive_case({3, 4, 7, 7}, 1, 1);
  adaptive_case({3, 4, 5, 5}, 2, 2);
  adaptive_case({3, 4, 5, 7}, 3, 2);
  adaptive_case({3, 2, 3, 2}, 5, 4);  // output larger than input
  const test::WideIndexPath wide;  // the 64-bit index path
  adaptive_case({3, 4, 5, 7}, 3, 2);
  adaptive_case({3, 2, 3, 2}, 5, 4);
}

TEST_CASE("cuda parity: cross-entropy and count_correct") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t N = 5, C = 7;
  Pair logits = make_random(r, {N, C}, 80, -4.f, 4.f), probs = make_random(r, {N, C}, 81);
  Pair loss = make_random(r, {1}, 82);
  Pair labels = make_labels(r, {3, 0, 6, 2, 3});
  r.c().cross_entropy_forward(r.cpu, logits.c, labels.c, probs.c, loss.c);
  r.g().cross_entropy_forward(r.gpu, logits.g, labels.g, probs.g, loss.g);
  expect_close(r, probs, 1e-5, 1e-7, "cross-entropy probs");
  expect_close(r, loss, 1e-5, 1e-7, "cross-entropy loss");

  Pair dlogits = make_random(r, {N, C}, 83);
  r.c().cross_entropy_backward(r.cpu, probs.c, labels.c, 1.f / N, dlogits.c);
  r.g().cross_entropy_backward(r.gpu, probs.g, labels.g, 1.f / N, dlogits.g);
  expect_close(r, dlogits, 1e-5, 1e-7, "cross-entropy dlogits");

  // A label out of range gives a NaN loss on both.
  Pair bad = make_labels(r, {3, 0, 7, 2, 3});
  r.c().cross_entropy_forward(r.cpu, logits.c, bad.c, probs.c, loss.c);
  r.g().cross_entropy_forward(r.gpu, logits.g, bad.g, probs.g, loss.g);
  CHECK(std::isnan(gpu_values(r, loss.g)[0]));
  expect_close(r, loss, 0, 0, "cross-entropy loss, bad label");

  // count_correct adds to what is there; ties go to the lower index, a NaN label logit and a
  // label out of range are never counted; top-1 ... top-K for K = 1, 5 and past C.
  std::vector<float> tied = random_values(N * C, 84);
  for (auto& e : tied) e = std::round(e * 2.f);
  tied[3] = std::nanf("");  // row 0's label (3)
  tied[C + 4] = std::nanf("");  // another class of row 1
  Pair tl = make_twin(r, {N, C}, tied);
  for (const int64_t K : {int64_t(1), int64_t(5), C + 2}) {
    for (const Pair* lg : {&logits, &tl}) {
      CAPTURE(K);
      Tensor cc = r.cpu.alloc({K}, DType::I32);
      Tensor cg = r.gpu.alloc({K}, DType::I32);
      r.c().fill(r.cpu, cc, 3.f);
      r.g().fill(r.gpu, cg, 3.f);
      for (const Pair* lb : {&labels, &bad}) {
        r.c().count_correct(r.cpu, lg->c, lb->c, cc);
        r.g().count_correct(r.gpu, lg->g, lb->g, cg);
      }
      CHECK(gpu_ints(r, cg) == std::vector<int32_t>(cc.i32(), cc.i32() + K));
    }
  }
}

TEST_CASE("cuda parity: sgd (momentum, nesterov, weight decay)") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t n = 1000;
  struct Variant {
    SgdConfig c;
    const char* name;
  };
  const Variant variants[] = {
      {SgdConfig{0.1f, 0.9f, 0.f, 1e-4f, true}, "momentum 0.9 nesterov wd 1e-4"},
      {SgdConfig{0.05f, 0.9f, 0.1f, 5e-4f, false}, "momentum 0.9 dampening 0.1 wd 5e-4"},
      {SgdConfig{0.1f, 0.f, 0.f, 1e-2f, false}, "plain, wd 1e-2"},
  };
  for (const auto& var : variants) {
    Pair p = make_random(r, {n}, 90), buf = make_random(r, {n}, 91);
    Tensor bc = var.c.momentum != 0.f ? buf.c : Tensor(), bg = var.c.momentum != 0.f ? buf.g : Tensor();
    for (int step = 0; step < 3; ++step) {
      Pair g = make_random(r, {n}, 92 + step);
      Pair scalars = step_scalars(r, sgd_step_scalars(var.c, step == 0));
      r.c().sgd_step(r.cpu, p.c, g.c, bc, var.c, scalars.c);
      r.g().sgd_step(r.gpu, p.g, g.g, bg, var.c, scalars.g);
    }
    expect_close(r, p, 1e-5, 1e-6, std::string("sgd params, ") + var.name);
    if (var.c.momentum != 0.f) expect_close(r, buf, 1e-5, 1e-6, std::string("sgd buffer, ") + var.name);
  }
}

TEST_CASE("cuda parity: adam, 3 steps") {
  if (!test::have_gpu()) return;
  Rig r;
  const int64_t n = 1000;
  AdamConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 1e-2f;
  Pair p = make_random(r, {n}, 100);
  Pair m = make_twin(r, {n}, std::vector<float>(n, 0.f));
  Pair v = make_twin(r, {n}, std::vector<float>(n, 0.f));
  for (int64_t step = 1; step <= 3; ++step) {
    Pair g = make_random(r, {n}, 101 + static_cast<uint32_t>(step));
    Pair scalars = step_scalars(r, adam_step_scalars(c, step));
    r.c().adam_step(r.cpu, p.c, g.c, m.c, v.c, c, scalars.c);
    r.g().adam_step(r.gpu, p.g, g.g, m.g, v.g, c, scalars.g);
  }
  expect_close(r, p, 1e-5, 1e-6, "adam params");
  expect_close(r, m, 1e-5, 1e-7, "adam m");
  expect_close(r, v, 1e-5, 1e-8, "adam v");
}
