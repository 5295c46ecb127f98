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
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

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
  void clear();

 private:
  const bool by_shape_;
  mutable std::mutex mutex_;
  std::map<std::string, OpStats> ops_;
};

// A Backend that forwards every call to `inner` and times it into `profile`.
std::unique_ptr<Backend> make_profiling_backend(Backend& inner, OpProfile& profile);

}  // namespace replica
