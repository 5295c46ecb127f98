#include "engine/op_profile.h"

#include <chrono>
#include <string_view>
#include <type_traits>

#include "engine/context.h"

namespace replica {

void OpProfile::add(const std::string& key, double seconds, double tensor_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpStats& s = ops_[key];
  ++s.calls;
  s.seconds += seconds;
  s.tensor_bytes += tensor_bytes;
}

std::map<std::string, OpStats> OpProfile::ops() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ops_;
}

void OpProfile::add_part(const std::string& key, const std::string& part, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpStats& s = parts_[key][part];
  ++s.calls;
  s.seconds += seconds;
}

std::map<std::string, std::map<std::string, OpStats>> OpProfile::parts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return parts_;
}

void OpProfile::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_.clear();
  parts_.clear();
}

namespace {

// The op a ProfilingBackend is timing on this thread (DP's workers each run their own), for
// the parts the backend under it times (op_part).
struct RunningOp {
  OpProfile* profile = nullptr;
  const std::string* key = nullptr;
};
thread_local RunningOp running_op;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

OpPartTimer::OpPartTimer(DeviceContext& ctx, const char* part) : ctx_(ctx), part_(part) {
  if (!running_op.profile) return;
  ctx_.synchronize();
  running_ = true;
  start_ = now_seconds();
}

void OpPartTimer::stop() {
  if (!running_) return;
  running_ = false;
  ctx_.synchronize();
  running_op.profile->add_part(*running_op.key, part_, now_seconds() - start_);
}

namespace {

// The shapes of a call's tensor arguments in order ("-" for an undefined one); the other
// arguments (the context, scalars, window parameters) are left out.
template <class... Args>
std::string tensor_shapes(const Args&... args) {
  std::string s;
  auto one = [&s](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, Tensor>)
      s += (s.empty() ? "" : " ") + (a.defined() ? shape_str(a.shape()) : std::string("-"));
  };
  (one(args), ...);
  return s;
}

// The bytes of one argument of a call: a tensor's (undefined: none), anything else's none.
template <class A>
double argument_bytes(const A& a) {
  if constexpr (std::is_same_v<A, Tensor>)
    return a.defined() ? double(a.bytes()) : 0.0;
  else
    return 0.0;
}

// The bytes of a call's tensor arguments, each argument counted once. A gather (gather_rows:
// ctx, destination, table, row indices) reads only the rows it names: its destination twice
// (the rows read, then written) and the indices, not the whole table.
template <bool kGather, class... Args>
double tensor_bytes(const Args&... args) {
  const double each[] = {argument_bytes(args)...};
  if constexpr (kGather) return 2 * each[1] + each[3];
  double bytes = 0;
  for (double b : each) bytes += b;
  return bytes;
}

class ProfilingBackend final : public Backend {
 public:
  ProfilingBackend(Backend& inner, OpProfile& profile) : inner_(inner), profile_(profile) {}

  // Each op: synchronise, call the inner backend, synchronise, record (under its shapes too
  // when the profile is by shape; they are formatted before the clock starts).
#define REPLICA_OP(name, params, args)                                              \
  void name params override {                                                       \
    constexpr bool kGather = std::string_view(#name) == "gather_rows";             \
    timed(ctx, profile_.by_shape() ? #name " " + tensor_shapes args : #name,        \
          [](const auto&... a) { return tensor_bytes<kGather>(a...); } args,        \
          [&] { inner_.name args; });                                               \
  }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

 private:
  template <class F>
  void timed(DeviceContext& ctx, const std::string& key, double bytes, F&& call) {
    ctx.synchronize();
    const double t0 = now_seconds();
    {
      // The parts the inner backend times (op_part) go under this call's key.
      struct Scope {
        RunningOp saved;
        ~Scope() { running_op = saved; }
      } scope{running_op};
      running_op = {&profile_, &key};
      call();
    }
    ctx.synchronize();
    profile_.add(key, now_seconds() - t0, bytes);
  }

  Backend& inner_;
  OpProfile& profile_;
};

}  // namespace

std::unique_ptr<Backend> make_profiling_backend(Backend& inner, OpProfile& profile) {
  return std::make_unique<ProfilingBackend>(inner, profile);
}

}  // namespace replica
