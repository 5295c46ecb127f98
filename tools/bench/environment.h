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

// The kernels OpenBLAS runs here and who chose them: "Haswell kernels (set by
// OPENBLAS_CORETYPE)" or "SkylakeX kernels (OpenBLAS's choice for this CPU)". The sgemm ceiling
// and every CPU figure depend on them: on an AVX-512 CPU told to use Haswell's AVX2 kernels the
// ceiling is about half.
std::string blas_kernels();

// CPU time of the whole machine (from /proc/stat: every CPU's non-idle time) and of this
// process with its waited-for descendants (the DDP ranks), at one moment.
struct CpuSnapshot {
  double machine_busy_s = 0, own_s = 0, wall_s = 0;
};
CpuSnapshot cpu_snapshot();
// The share of the machine's CPU time between two snapshots that other processes used
// (0: the run had the machine to itself; 0.5: others took half of all cores).
double others_cpu_share(const CpuSnapshot& from, const CpuSnapshot& to, int cores);

// One line for report headers: "2 cores (Intel ...), build Release, commit abc1234, ...".
std::string environment_line(const nlohmann::json& env);

}  // namespace replica::bench
