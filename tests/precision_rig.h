// The GPU precision suites' rig: the same op run on the CPU (the reference) and on GPU contexts
// in each precision and layout (Trio, on_all), and the two yardsticks: fp32 within float
// rounding of the CPU and tf32 within TF32's (expect_precisions), the GPU's bf16 near the CPU's
// bf16 and visibly off fp32 (expect_bf16).
#pragma once
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "device_tensors.h"
#include "dp_reference.h"
#include "engine/context.h"
#include "engine/device.h"
#include "engine/ops.h"
#include "gpu_skip.h"
#include "seeded_values.h"

namespace test {

using namespace replica;


inline const Device kGpu{DeviceType::CUDA, 0, 0};

inline bool have_tf32() { return test::have_tensor_cores("tf32 and bf16 cases"); }

// The same op on the CPU (the reference) and GPU contexts in each precision.
struct Trio {
  DeviceContext cpu{Device{DeviceType::CPU, 0, 0}};
  DeviceContext fp32{kGpu, ContextOptions{0, true, Precision::Fp32}};
  DeviceContext tf32{kGpu, ContextOptions{0, true, Precision::Tf32}};
  DeviceContext cpu_bf16{Device{DeviceType::CPU, 0, 0}, ContextOptions{0, true, Precision::Bf16}};
  DeviceContext bf16{kGpu, ContextOptions{0, true, Precision::Bf16}};
  // Convolutions on NHWC copies of their operands (--memory-format channels_last).
  DeviceContext fp32_nhwc{kGpu, channels_last(Precision::Fp32)};
  DeviceContext bf16_nhwc{kGpu, channels_last(Precision::Bf16)};

  static ContextOptions channels_last(Precision p) {
    ContextOptions o{0, true, p};
    o.channels_last = true;
    return o;
  }

};

// Runs `op(ctx, inputs..., outputs...)` on each context of `ctxs`; returns each output's values
// per context: [output][i] for ctxs[i] (default: 0 = cpu, 1 = fp32, 2 = tf32).
template <class Op>
std::vector<std::vector<std::vector<float>>> on_all(Trio& t, const std::vector<Shape>& inputs,
                                                    const std::vector<Shape>& outputs, Op op,
                                                    std::vector<DeviceContext*> ctxs = {}) {
  std::vector<std::vector<std::vector<float>>> out(outputs.size());
  if (ctxs.empty()) ctxs = {&t.cpu, &t.fp32, &t.tf32};
  for (DeviceContext* ctx : ctxs) {
    std::vector<Tensor> in, res;
    for (size_t i = 0; i < inputs.size(); ++i)
      in.push_back(test::put(*ctx, inputs[i], random_values(shape_numel(inputs[i]), 100 + uint32_t(i))));
    for (size_t i = 0; i < outputs.size(); ++i)
      res.push_back(
          test::put(*ctx, outputs[i], std::vector<float>(size_t(shape_numel(outputs[i])), 0.f)));
    op(*ctx, in, res);
    for (size_t i = 0; i < outputs.size(); ++i) out[i].push_back(test::get(*ctx, res[i]));
  }
  return out;
}

// NVIDIA_TF32_OVERRIDE=0 in the environment turns TF32 off under every library: tf32 then
// rounds as fp32 does, and the checks that it differs cannot hold.
inline bool tf32_overridden() {
  const char* v = std::getenv("NVIDIA_TF32_OVERRIDE");
  if (v && std::string(v) == "0") {
    static bool said = false;
    if (!said) MESSAGE("NVIDIA_TF32_OVERRIDE=0: tf32 runs as fp32, not checked to differ");
    said = true;
    return true;
  }
  return false;
}

// fp32 on the GPU matches the CPU to float rounding; tf32 to TF32's rounding (and, for a GEMM,
// visibly off fp32: the tensor cores were used).
inline void expect_precisions(const std::vector<std::vector<float>>& v, const std::string& what,
                       bool must_differ) {
  const double e32 = test::relative_l2(v[0], v[1]), etf = test::relative_l2(v[0], v[2]);
  MESSAGE(what << ": relative L2 vs CPU: fp32 " << e32 << ", tf32 " << etf);
  CHECK(e32 < 1e-5);
  CHECK(etf < 3e-3);
  if (must_differ && !tf32_overridden()) CHECK(etf > 2e-5);
}

// bf16 on the GPU against bf16 on the CPU and fp32 on the CPU ([0] cpu, [1] cpu_bf16, [2] bf16).
// `loose`: held only to 2e-3 of the CPU's bf16, not to a third of bf16's own error (cuDNN's
// legacy calls, below).
inline void expect_bf16(const std::vector<std::vector<float>>& v, const std::string& what,
                 bool loose = false) {
  const double vs_cpu = test::relative_l2(v[1], v[2]), vs_fp32 = test::relative_l2(v[0], v[2]);
  const double cpu_vs_fp32 = test::relative_l2(v[0], v[1]);
  MESSAGE(what << ": relative L2 of the GPU's bf16 vs the CPU's bf16 " << vs_cpu << ", vs fp32 "
               << vs_fp32 << " (CPU bf16 vs fp32 " << cpu_vs_fp32 << ")");
  CHECK(vs_cpu < (loose ? 2e-3 : 1e-3));
  if (!loose) CHECK(vs_cpu < vs_fp32 / 3);
  CHECK(vs_fp32 > 5e-4);  // the operands really went through bf16
  CHECK(vs_fp32 < 1e-2);
}
}  // namespace test
