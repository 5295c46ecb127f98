// OpProfile: where a training step's time goes, kernel by kernel. While a DeviceContext has a
// profile set (DeviceContext::set_op_profile), every Backend call on it is timed alone: the
// device is synchronised before and after the call, so each op's time is its launch and its run
// with nothing overlapping it. The profiled step is slower than a real one (nothing overlaps,
// and each op pays a synchronisation); the shares are what it is for: which ops a step spends
// its time in, to hold against PyTorch's profiler on the same model. On CPU devices the time is
// the call's wall time (CPU kernels are synchronous). A profile made `by_shape` keys each call
// by its op and the shapes of its tensor arguments ("conv2d_backward [64, 256, 56, 56] ..."),
// so an op's time splits by layer: which convolution of a ResNet is the slow one. Each call also
// counts the bytes of its tensor arguments, each once: a floor on the memory it moves, so that
// bytes over time says how far a memory-bound op (BatchNorm, pooling, the elementwise ops) is
// from the device's bandwidth (ops that compute, such as convolutions, are bound elsewhere).
//
// An op's parts: inside a profiled call, a backend may time named parts of its own work
// (op_part): a convolution's cuDNN call apart from the copies that stage its operands, the F32
// copies the bf16 storage layer makes around an op. Each part is recorded under the op's key,
// beside the op's whole time (which includes it): where inside an op its time goes, without
// a profiler. Outside a profiled call op_part only runs its work.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "engine/ops.h"

namespace replica {

struct OpStats {
  int64_t calls = 0;
  double seconds = 0;
  double tensor_bytes = 0;  // the calls' tensor arguments, each counted once per call
};

class OpProfile {
 public:
  explicit OpProfile(bool by_shape = false) : by_shape_(by_shape) {}
  bool by_shape() const { return by_shape_; }
  // Thread-safe (DP's workers share one).
  void add(const std::string& key, double seconds, double tensor_bytes = 0);
  std::map<std::string, OpStats> ops() const;
  // A part of the op recorded under `key` (op_part), its calls and seconds.
  void add_part(const std::string& key, const std::string& part, double seconds);
  // Each op key's parts, by name (ops without parts are absent).
  std::map<std::string, std::map<std::string, OpStats>> parts() const;
  void clear();

 private:
  const bool by_shape_;
  mutable std::mutex mutex_;
  std::map<std::string, OpStats> ops_;
  std::map<std::string, std::map<std::string, OpStats>> parts_;
};

// Times one part of the op being profiled on this thread, if any (the device synchronised
// before and after, as for the op): started on construction, recorded by stop(). One that is
// not stopped (its work threw) records nothing.
class OpPartTimer {
 public:
  OpPartTimer(DeviceContext& ctx, const char* part);
  OpPartTimer(const OpPartTimer&) = delete;
  OpPartTimer& operator=(const OpPartTimer&) = delete;
  void stop();

 private:
  DeviceContext& ctx_;
  const char* part_;
  bool running_ = false;
  double start_ = 0;
};

// Runs f() as the part `part` of the op being profiled (see the top); returns what f returns.
template <class F>
decltype(auto) op_part(DeviceContext& ctx, const char* part, F&& f) {
  OpPartTimer timer(ctx, part);
  if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
    f();
    timer.stop();
  } else {
    decltype(auto) result = f();
    timer.stop();
    return result;
  }
}

// A Backend that forwards every call to `inner` and times it into `profile`.
std::unique_ptr<Backend> make_profiling_backend(Backend& inner, OpProfile& profile);

}  // namespace replica
