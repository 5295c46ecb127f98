// Plugins: the parts of replica that pull in a GPU stack (the CUDA backend, libreplica_cuda.so;
// the NCCL process groups, libreplica_nccl.so) are shared libraries beside libreplica_engine.so,
// loaded on first use. A program that never touches a GPU never loads cuBLAS, cuDNN or NCCL
// (hundreds of MB and most of a second at start-up), and a build for a machine without a GPU
// need not compile them at all.
//
// A plugin exports one C function, replica_<name>_plugin(int abi), that returns a table of
// function pointers when `abi` matches what it was built for, and null otherwise.
#pragma once
#include <string>

namespace replica {

class Plugin {
 public:
  // The plugin lib<name>.so, loaded at most once per process (thread-safe). Searched in
  // $REPLICA_PLUGIN_DIR, beside libreplica_engine.so, in the program's ../lib and beside the
  // program. Never throws: a plugin that is absent or fails to load reports why in problem().
  static const Plugin& get(const std::string& name);

  bool loaded() const { return handle_ != nullptr; }
  bool found() const { return !path_.empty(); }  // a file exists (it may still fail to load)
  const std::string& path() const { return path_; }
  // Empty when loaded; else one line: "is not built (...)" or "cannot be loaded: <dlerror>".
  const std::string& problem() const { return problem_; }
  // The entry point's table for `abi`; null when the plugin is not loaded or was built for
  // another abi (a stale build), and then *why says which.
  const void* table(int abi, std::string* why = nullptr) const;

 private:
  explicit Plugin(const std::string& name);
  std::string name_, path_, problem_;
  void* handle_ = nullptr;
};

}  // namespace replica
