// How the CPU convolutions that work sample by sample (im2col's per-sample GEMMs, the direct
// convolution) sum their weight gradient over the batch: the samples are cut into at most
// kMaxWeightChunks chunks, fixed by the batch and not by the machine; each chunk adds its
// samples, in order, into a partial of its own, and the partials are added into dw in chunk
// order. The chunks run in parallel, and the bits are the same for any number of threads.
#pragma once
#include <algorithm>
#include <cstdint>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"

namespace replica::cpu {

inline constexpr int64_t kMaxWeightChunks = 8;

// A per-task scratch buffer of n floats (at least one) from the device's caching allocator.
inline Tensor scratch(DeviceContext& ctx, int64_t n) {
  return ctx.alloc({std::max<int64_t>(n, 1)});
}

// dw[0, wsize) += the partials that body(first, last, partial) leaves for the samples
// [first, last) of each chunk, partial zeroed beforehand.
template <class Body>
void for_weight_chunks(DeviceContext& ctx, int64_t n, int64_t wsize, float* dw, Body&& body) {
  const int64_t chunks = std::min<int64_t>(n, kMaxWeightChunks);
  if (chunks <= 0) return;
  const int64_t per_chunk = (n + chunks - 1) / chunks;
  Tensor partial = scratch(ctx, chunks * wsize);
  float* pw = partial.f32();
  parallel_range(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* pc = pw + c * wsize;
      std::fill(pc, pc + wsize, 0.f);
      body(std::min(n, c * per_chunk), std::min(n, (c + 1) * per_chunk), pc);
    }
  });
  parallel_range(wsize, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* src = pw + c * wsize;
      for (int64_t i = b; i < e; ++i) dw[i] += src[i];
    }
  });
}

}  // namespace replica::cpu
