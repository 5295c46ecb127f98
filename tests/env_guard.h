// Environment variables set by an in-process test and put back as they were, on every way out
// of the test (a failed REQUIRE throws).
#pragma once
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace test {

// Saves `names` and unsets them; the destructor restores each (or unsets it again).
struct EnvGuard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  explicit EnvGuard(std::vector<std::string> names) {
    for (auto& n : names) {
      const char* v = std::getenv(n.c_str());
      saved.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
      unsetenv(n.c_str());
    }
  }
  ~EnvGuard() {
    for (auto& [n, v] : saved)
      v ? (void)setenv(n.c_str(), v->c_str(), 1) : (void)unsetenv(n.c_str());
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;
};

// `name` set to `value` until the end of the scope, then put back as it was.
struct ScopedEnv {
  EnvGuard guard;
  ScopedEnv(const std::string& name, const std::string& value) : guard({name}) {
    setenv(name.c_str(), value.c_str(), 1);
  }
};

// The CUDA kernels' 64-bit index path (engine/cuda/index_math.h), which real shapes take only
// past 2^31 values, for the rest of the scope.
struct WideIndexPath : ScopedEnv {
  WideIndexPath() : ScopedEnv("REPLICA_CUDA_WIDE_INDEX", "1") {}
};

}  // namespace test
