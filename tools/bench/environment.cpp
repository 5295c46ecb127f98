#include "tools/bench/environment.h"

#include <stdlib.h>

#include <cblas.h>
#include <cstdio>
#include <fstream>

#include <fmt/format.h>
#include <tbb/version.h>

#include "engine/cuda/cudart.h"
#include "engine/device.h"

#ifdef REPLICA_WITH_GLOO
#include <gloo/config.h>
#endif
#ifdef REPLICA_WITH_NCCL
#include <nccl.h>
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

std::string git_commit() {
  const std::string dir = REPLICA_SOURCE_DIR;
  if (!dir.empty()) {
    std::string c = first_line_of_command("git -C '" + dir +
                                          "' describe --always --dirty --abbrev=10 2>/dev/null");
    if (!c.empty()) return c;
  }
  return REPLICA_GIT_COMMIT;
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
#ifdef REPLICA_WITH_NCCL
  int nccl = 0;
  ncclGetVersion(&nccl);
  versions["nccl"] = fmt::format("{}.{}.{}", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
#else
  versions["nccl"] = "not built";
#endif
  versions["cuda"] = cudart::versions();
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
  };
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
  return fmt::format(
      "{} cores ({}){}, load {:.2f}; build {}, commit {}; {}, oneTBB {}, Gloo {}, NCCL {}, "
      "CUDA: {}",
      env.value("cores", 0), str(env, "cpu"), gpus.empty() ? ", no GPU" : ", GPUs: " + gpus,
      env.value("load_avg_1m", 0.0), str(env, "build_type"), str(env, "commit"),
      str(v, "openblas"), str(v, "onetbb"), str(v, "gloo"), str(v, "nccl"), str(v, "cuda"));
}

}  // namespace replica::bench
