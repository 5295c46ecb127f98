#include "engine/op_profile.h"

#include <chrono>

#include "engine/context.h"

namespace replica {

void OpProfile::add(const char* op, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpStats& s = ops_[op];
  ++s.calls;
  s.seconds += seconds;
}

std::map<std::string, OpStats> OpProfile::ops() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ops_;
}

void OpProfile::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_.clear();
}

namespace {

class ProfilingBackend final : public Backend {
 public:
  ProfilingBackend(Backend& inner, OpProfile& profile) : inner_(inner), profile_(profile) {}

  // Each op: synchronise, call the inner backend, synchronise, record.
#define REPLICA_OP(name, params, args) \
  void name params override { timed(ctx, #name, [&] { inner_.name args; }); }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

 private:
  template <class F>
  void timed(DeviceContext& ctx, const char* op, F&& call) {
    ctx.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    call();
    ctx.synchronize();
    profile_.add(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  Backend& inner_;
  OpProfile& profile_;
};

}  // namespace

std::unique_ptr<Backend> make_profiling_backend(Backend& inner, OpProfile& profile) {
  return std::make_unique<ProfilingBackend>(inner, profile);
}

}  // namespace replica
