// The environment a benchmark row was measured in: machine, build, commit, library versions.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace replica::bench {

// "abc1234" or "abc1234-dirty" (git describe of the source tree at run time), else the commit
// the build was configured at, else "unknown".
std::string git_commit();

// cores, CPU model, load average, GPUs, build type, commit, versions of OpenBLAS, oneTBB, Gloo,
// NCCL and CUDA (those this build has).
nlohmann::json environment();

// One line for report headers: "2 cores (Intel ...), build Release, commit abc1234, ...".
std::string environment_line(const nlohmann::json& env);

}  // namespace replica::bench
