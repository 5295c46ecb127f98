#include "engine/plugin.h"

#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>

namespace replica {

namespace {

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// Where plugins may be, in order: an explicit directory, beside this library (an install, or a
// build's lib/), the program's ../lib (bin/ and lib/ of one build) and beside the program.
std::vector<std::string> search_dirs() {
  std::vector<std::string> dirs;
  if (const char* d = std::getenv("REPLICA_PLUGIN_DIR"); d && *d) dirs.push_back(d);
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&search_dirs), &info) && info.dli_fname)
    dirs.push_back(dir_of(info.dli_fname));
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    const std::string bin = dir_of(std::string(exe, size_t(n)));
    dirs.push_back(bin + "/../lib");
    dirs.push_back(bin);
  }
  return dirs;
}

}  // namespace

Plugin::Plugin(const std::string& name) : name_(name) {
  const std::string file = "lib" + name + ".so";
  for (const auto& dir : search_dirs()) {
    const std::string candidate = dir + "/" + file;
    if (access(candidate.c_str(), F_OK) == 0) {
      path_ = candidate;
      break;
    }
  }
  if (path_.empty()) {
    problem_ = fmt::format("is not built ({} is not beside the replica libraries; build it with "
                           "cmake --build build --target {})",
                           file, name);
    return;
  }
  handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char* err = dlerror();
    problem_ = fmt::format("cannot be loaded: {}", err ? err : path_);
  }
}

const Plugin& Plugin::get(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<Plugin>> plugins;  // never unloaded
  std::lock_guard<std::mutex> lock(mutex);
  auto& p = plugins[name];
  if (!p) p.reset(new Plugin(name));
  return *p;
}

const void* Plugin::table(int abi, std::string* why) const {
  auto fail = [&](std::string text) -> const void* {
    if (why) *why = std::move(text);
    return nullptr;
  };
  if (!handle_) return fail(problem_);
  const std::string entry = fmt::format("replica_{}_plugin", name_.substr(name_.find('_') + 1));
  using Entry = const void* (*)(int);
  auto fn = reinterpret_cast<Entry>(dlsym(handle_, entry.c_str()));
  if (!fn) return fail(fmt::format("{} has no entry point {}", path_, entry));
  const void* t = fn(abi);
  if (!t)
    return fail(fmt::format("{} was built from other sources than this program (rebuild both: "
                            "cmake --build build)",
                            path_));
  return t;
}

}  // namespace replica
