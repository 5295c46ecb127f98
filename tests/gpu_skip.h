// The GPU suites without a GPU: each case prints the line ctest's SKIP_REGULAR_EXPRESSION
// looks for (tests/CMakeLists.txt), so the suite is listed as skipped, and returns.
#pragma once
#include <doctest/doctest.h>

#include <cstdio>

#include "engine/cudart.h"
#include "engine/device.h"

namespace test {

inline bool have_gpu() {
  if (replica::cuda_device_count() > 0) return true;
  std::printf("SKIPPED: no CUDA GPU found (cuda_device_count() == 0)\n");
  MESSAGE("SKIPPED: no CUDA GPU found");
  return false;
}

// A GPU with compute capability 8.0 or later: TF32 and bf16 tensor cores, which `what` (the
// cases that need them) use; else says they are skipped and why.
inline bool have_tensor_cores(const char* what) {
  if (!have_gpu()) return false;
  if (replica::cudart::compute_capability(0) >= 80) return true;
  MESSAGE(what << " skipped: GPU 0 has compute capability "
               << replica::cudart::compute_capability(0) / 10.0 << ", no TF32/bf16 tensor cores");
  return false;
}

}  // namespace test
