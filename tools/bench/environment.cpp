#include "tools/bench/environment.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include <cblas.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <fmt/format.h>
#include <tbb/version.h>

#include "engine/cudart.h"
#include "engine/device.h"
#include "parallel/comm/nccl_plugin.h"

#ifdef REPLICA_WITH_GLOO
#include <gloo/config.h>
#endif

#ifndef REPLICA_SOURCE_DIR
#define REPLICA_SOURCE_DIR ""
#endif
#ifndef REPLICA_GIT_COMMIT
#define REPLICA_GIT_COMMIT "unknown"
#endif
#ifndef REPLICA_BUILD_TYPE
#define REPLICA_BUILD_TYPE "unknown"
#endif

namespace replica::bench {

namespace {

std::string first_line_of_command(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (!p) return "";
  char buf[512];
  std::string out;
  if (fgets(buf, sizeof buf, p)) out = buf;
  pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

}  // namespace

CpuSnapshot cpu_snapshot() {
  CpuSnapshot c;
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal &&
      cpu == "cpu")
    c.machine_busy_s = (user + nice + system + irq + softirq + steal) / double(sysconf(_SC_CLK_TCK));
  for (int who : {RUSAGE_SELF, RUSAGE_CHILDREN}) {
    rusage u{};
    getrusage(who, &u);
    c.own_s += double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
               1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  }
  c.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
                 .count();
  return c;
}

double others_cpu_share(const CpuSnapshot& from, const CpuSnapshot& to, int cores) {
  const double wall = to.wall_s - from.wall_s;
  if (wall <= 0 || cores <= 0 || to.machine_busy_s <= 0) return 0.0;
  const double others = (to.machine_busy_s - from.machine_busy_s) - (to.own_s - from.own_s);
  return std::clamp(others / (wall * cores), 0.0, 1.0);
}

// REPLICA_COMMIT names it where the sources carry no git history (a build copied to another
// machine); else git describe in the source tree, else the commit the build was configured at.
std::string git_commit() {
  const char* named = std::getenv("REPLICA_COMMIT");
  if (named && *named) return named;
  const std::string dir = REPLICA_SOURCE_DIR;
  if (!dir.empty()) {
    std::string c = first_line_of_command("git -C '" + dir +
                                          "' describe --always --dirty --abbrev=10 2>/dev/null");
    if (!c.empty()) return c;
  }
  return REPLICA_GIT_COMMIT;
}

nlohmann::json tuning_variables() {
  // Prefixes, and whole names where a prefix would take paths too (CUDA_HOME).
  static const char* const kPrefixes[] = {
      "REPLICA_", "NCCL_", "GLOO_", "OPENBLAS_", "CUDNN_", "OMP_", "NVIDIA_TF32_OVERRIDE",
      "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
      "CUDA_DEVICE_MAX_CONNECTIONS"};
  nlohmann::json set = nlohmann::json::object();
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    const std::string name = entry.substr(0, eq);
    if (eq == std::string::npos || name == "REPLICA_COMMIT") continue;
    for (const char* prefix : kPrefixes)
      if (name.rfind(prefix, 0) == 0) set[name] = entry.substr(eq + 1);
  }
  return set;
}

std::string variables_text(const nlohmann::json& variables) {
  std::string text;
  if (variables.is_object())
    for (const auto& [name, value] : variables.items())
      text += fmt::format("{}{}={}", text.empty() ? "" : ", ", name,
                          value.is_string() ? value.get<std::string>() : value.dump());
  return text;
}

void announce_variables(const nlohmann::json& variables) {
  const std::string text = variables_text(variables);
  if (!text.empty()) std::printf("replica-bench: environment: %s\n", text.c_str());
}

nlohmann::json environment() {
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  nlohmann::json versions = {
      {"openblas", std::string(openblas_get_config())},
      {"onetbb", TBB_VERSION_STRING},
  };
#ifdef REPLICA_WITH_GLOO
  versions["gloo"] = fmt::format("{}.{}.{}", GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR,
                                 GLOO_VERSION_PATCH);
#else
  versions["gloo"] = "not built";
#endif
  // The GPU stack is loaded only where there is a GPU to use it.
  const bool gpu = cuda_device_count() > 0;
  versions["nccl"] = gpu ? nccl_version() : "not loaded (no GPU)";
  versions["cuda"] = gpu ? cudart::versions() : "not loaded (no GPU" + cuda_backend_note() + ")";
  nlohmann::json gpus = nlohmann::json::array();
  for (int i = 0; i < cuda_device_count(); ++i) gpus.push_back(cudart::device_name(i));
  return {
      {"cores", cpu_cores()},
      {"cpu", cpu_model()},
      {"gpus", gpus},
      {"load_avg_1m", load[0]},
      {"build_type", REPLICA_BUILD_TYPE},
      {"commit", git_commit()},
      {"versions", versions},
      {"variables", tuning_variables()},
  };
}

std::string blas_kernels() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  return fmt::format("{} kernels ({})", openblas_get_corename(),
                     forced ? fmt::format("set by OPENBLAS_CORETYPE={}", forced)
                            : std::string("OpenBLAS's choice for this CPU"));
}

std::string environment_line(const nlohmann::json& env) {
  if (!env.is_object()) return "not recorded";
  auto str = [&](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string("?");
  };
  std::string gpus;
  if (env.contains("gpus"))
    for (const auto& g : env["gpus"]) gpus += (gpus.empty() ? "" : ", ") + g.get<std::string>();
  const auto& v = env.contains("versions") ? env["versions"] : nlohmann::json::object();
  const std::string others =
      env.contains("others_cpu_share") && env["others_cpu_share"].is_number()
          ? fmt::format(", other processes used {:.0f}% of its CPU time during the run",
                        100 * env["others_cpu_share"].get<double>())
          : std::string();
  const std::string variables = variables_text(env.value("variables", nlohmann::json()));
  return fmt::format(
      "{} cores ({}){}, load {:.2f} at the start{}; build {}, commit {}; {}, oneTBB {}, Gloo {}, "
      "NCCL {}, CUDA: {}{}",
      env.value("cores", 0), str(env, "cpu"), gpus.empty() ? ", no GPU" : ", GPUs: " + gpus,
      env.value("load_avg_1m", 0.0), others, str(env, "build_type"), str(env, "commit"),
      str(v, "openblas"), str(v, "onetbb"), str(v, "gloo"), str(v, "nccl"), str(v, "cuda"),
      variables.empty() ? "" : "; environment: " + variables);
}

}  // namespace replica::bench
