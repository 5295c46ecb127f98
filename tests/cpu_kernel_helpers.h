// The CPU kernel tests' tools: tensors of seeded random values, their values back, and the
// check that an op gives the same bits with 1, 2 and 3 threads.
#pragma once
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "engine/context.h"
#include "seeded_values.h"

namespace test {

using replica::DeviceContext;
using replica::Shape;
using replica::Tensor;

inline Tensor make(DeviceContext& ctx, const Shape& s, const std::vector<float>& v) {
  Tensor t = ctx.alloc(s);
  REQUIRE(int64_t(v.size()) == t.numel());
  if (!v.empty()) std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
  return t;
}
inline Tensor make(DeviceContext& ctx, const Shape& s, uint32_t seed) {
  return make(ctx, s, random_values(replica::shape_numel(s), seed));
}
inline std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// Runs `op` (which returns the tensors it produced, flattened) in contexts with 1, 2 and (on
// machines with the cores for it) 3 threads, inside each context's arena, and requires
// bit-identical results.
template <class Op>
std::vector<float> same_for_all_thread_counts(Op op) {
  std::vector<float> first;
  std::vector<int> counts = {1, 2};
  if (std::thread::hardware_concurrency() >= 3) counts.push_back(3);
  for (int threads : counts) {
    CAPTURE(threads);
    DeviceContext ctx(replica::Device{replica::DeviceType::CPU, 0, 0},
                      replica::ContextOptions{threads});
    REQUIRE(ctx.threads() == threads);
    std::vector<float> out;
    ctx.run([&] { out = op(ctx); });
    if (threads == 1) {
      first = out;
      continue;
    }
    REQUIRE(out.size() == first.size());
    CHECK(std::memcmp(out.data(), first.data(), out.size() * sizeof(float)) == 0);
  }
  return first;
}

inline void append(std::vector<float>& out, const Tensor& t) {
  out.insert(out.end(), t.f32(), t.f32() + t.numel());
}

// t's floats as their bits, after what `out` holds: for checks that two ways agree to the bit,
// where == would take -0 for +0 and fail on every NaN.
inline void append_bits(std::vector<uint32_t>& out, const Tensor& t) {
  const size_t at = out.size();
  out.resize(at + size_t(t.numel()));
  std::memcpy(out.data() + at, t.f32(), size_t(t.numel()) * sizeof(float));
}

}  // namespace test
