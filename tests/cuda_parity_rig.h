// The CPU-vs-GPU parity suites' rig: one CPU and one GPU context, tensors held on both
// (random, unaligned, labels, an optimizer's scalars), GPU values read back, and the
// per-element comparison |cpu - gpu| <= atol + rtol * |cpu| with its report.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/device.h"
#include "engine/ops.h"
#include "engine/tensor.h"
#include "seeded_values.h"

namespace test {

using namespace replica;


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

// A tensor held twice: on the CPU device and (a copy) on the GPU.
struct Pair {
  Tensor c, g;
};

inline Pair make_twin(Rig& r, const Shape& shape, const std::vector<float>& values) {
  Pair p;
  p.c = r.cpu.alloc(shape);
  REQUIRE(static_cast<int64_t>(values.size()) == p.c.numel());
  std::copy(values.begin(), values.end(), p.c.f32());
  p.g = r.gpu.alloc(shape);
  r.g().copy(r.gpu, p.g, p.c);
  return p;
}

inline Pair make_random(Rig& r, const Shape& shape, uint32_t seed, float lo = -1.f,
                        float hi = 1.f) {
  return make_twin(r, shape, random_values(shape_numel(shape), seed, lo, hi));
}

// As make_random, but the GPU tensor starts one float into its allocation: not 16-byte aligned,
// so kernels that move float4s must take their one-float path.
inline Pair make_random_unaligned(Rig& r, const Shape& shape, uint32_t seed,
                                  float lo = -1.f, float hi = 1.f) {
  Pair p = make_random(r, shape, seed, lo, hi);
  Tensor g = r.gpu.alloc({shape_numel(shape) + 1}).view(1, shape);
  r.g().copy(r.gpu, g, p.g);
  p.g = g;
  return p;
}

// An optimizer step's numbers (backend_ops.inc) on both devices.
inline Pair step_scalars(Rig& r, const StepScalars& values) {
  return make_twin(r, {2}, {values[0], values[1]});
}

inline Pair make_labels(Rig& r, const std::vector<int32_t>& labels) {
  Pair p;
  const Shape shape{static_cast<int64_t>(labels.size())};
  p.c = r.cpu.alloc(shape, DType::I32);
  std::copy(labels.begin(), labels.end(), p.c.i32());
  p.g = r.gpu.alloc(shape, DType::I32);
  r.g().copy(r.gpu, p.g, p.c);
  return p;
}

inline std::vector<float> host_values(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

inline std::vector<float> gpu_values(Rig& r, const Tensor& t) {
  const Tensor h = to_host(r.gpu, t);
  r.gpu.synchronize();
  return host_values(h);
}

inline std::vector<int32_t> gpu_ints(Rig& r, const Tensor& t) {
  const Tensor h = to_host(r.gpu, t);
  r.gpu.synchronize();
  return std::vector<int32_t>(h.i32(), h.i32() + h.numel());
}

inline int32_t gpu_int(Rig& r, const Tensor& t) { return gpu_ints(r, t)[0]; }

// |cpu - gpu| <= atol + rtol * |cpu| everywhere (NaN must match NaN).
inline void expect_close(const std::vector<float>& cpu, const std::vector<float>& gpu, double rtol,
                         double atol, const std::string& what) {
  REQUIRE_MESSAGE(cpu.size() == gpu.size(),
                  what << ": size " << cpu.size() << " vs " << gpu.size());
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

inline void expect_close(Rig& r, const Pair& p, double rtol, double atol,
                         const std::string& what) {
  expect_close(host_values(p.c), gpu_values(r, p.g), rtol, atol, what);
}

constexpr double kGemmRtol = 1e-4, kGemmAtol = 1e-5;
// cuDNN may pick Winograd or FFT algorithms: exact in exact arithmetic, slightly noisier in FP32.
constexpr double kConvAtol = 1e-4;

}  // namespace test
