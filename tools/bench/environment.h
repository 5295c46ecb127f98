// The environment a benchmark row was measured in: machine, build, commit, library versions.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace replica::bench {

// "abc1234" or "abc1234-dirty" (git describe of the source tree at run time), else the commit
// the build was configured at, else "unknown".
std::string git_commit();

// cores, CPU model, load average, GPUs, build type, commit, versions of OpenBLAS, oneTBB, Gloo,
// NCCL and CUDA (those this build has), and the variables below.
nlohmann::json environment();

// The environment variables set for this run that change what replica runs or how fast:
// replica's own switches (REPLICA_PAD_CHANNELS=0, ...), NCCL's, Gloo's, OpenBLAS's, OpenMP's
// and cuDNN's, CUDA's that change what runs (CUDA_VISIBLE_DEVICES, CUDA_LAUNCH_BLOCKING, ...)
// and NVIDIA_TF32_OVERRIDE, as an object of name -> value. Two rows of one model measured with
// and without a switch then say which was which. REPLICA_COMMIT is the commit, recorded as such.
nlohmann::json tuning_variables();
// "NCCL_ALGO=Ring, REPLICA_PAD_CHANNELS=0", or "" when none is set.
std::string variables_text(const nlohmann::json& variables);
// Prints "replica-bench: environment: ..." where any variable is set, so a suite's log says
// what its rows were measured under.
void announce_variables(const nlohmann::json& variables);

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
