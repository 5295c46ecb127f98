// The GPU suites without a GPU: each case prints the line ctest's SKIP_REGULAR_EXPRESSION
// looks for (tests/CMakeLists.txt), so the suite is listed as skipped, and returns.
#pragma once
#include <doctest/doctest.h>

#include <cstdio>

#include "engine/device.h"

namespace test {

inline bool have_gpu() {
  if (replica::cuda_device_count() > 0) return true;
  std::printf("SKIPPED: no CUDA GPU found (cuda_device_count() == 0)\n");
  MESSAGE("SKIPPED: no CUDA GPU found");
  return false;
}

}  // namespace test
