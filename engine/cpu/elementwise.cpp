// CPU elementwise kernels: fill, copy, gather_rows, add, scale, multiply, ReLU and dropout.
// Parallel in fixed grains (cpu::kGrain; gather_rows by rows); no reductions.
#include <algorithm>
#include <cstring>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

void CpuBackend::fill(DeviceContext&, Tensor& t, float value) {
  cpu::expect_host(t, "fill target");
  if (t.dtype() == DType::I32) {
    int32_t* p = t.i32();
    std::fill(p, p + t.numel(), static_cast<int32_t>(value));
    return;
  }
  if (t.dtype() == DType::BF16) {
    uint16_t* p = t.bf16();
    const uint16_t bits = bf16_bits(value);
    cpu::parallel_range(t.numel(), cpu::kGrain,
                        [&](int64_t b, int64_t e) { std::fill(p + b, p + e, bits); });
    return;
  }
  float* p = t.f32();
  cpu::parallel_range(t.numel(), cpu::kGrain,
                      [&](int64_t b, int64_t e) { std::fill(p + b, p + e, value); });
}

namespace {

// src into dst, one NCHW and the other channels_last (copy_relayouts), converting the dtype as
// copy does: element (n, c, p) is at (n * C + c) * HW + p in NCHW, (n * HW + p) * C + c in NHWC.
void copy_relayout(Tensor& dst, const Tensor& src) {
  const int64_t N = src.dim(0), C = src.dim(1), HW = src.dim(2) * src.dim(3);
  const bool to_nhwc = dst.channels_last();
  with_storage(src.dtype(), [&](auto in) {
    with_storage(dst.dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const In* s = elements<In>(src);
      Out* d = elements<Out>(dst);
      cpu::parallel_range(N, 1, [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n)
          for (int64_t c = 0; c < C; ++c)
            for (int64_t p = 0; p < HW; ++p) {
              const int64_t nchw = (n * C + c) * HW + p, nhwc = (n * HW + p) * C + c;
              d[to_nhwc ? nhwc : nchw] = narrow<Out>(widen(s[to_nhwc ? nchw : nhwc]));
            }
      });
    });
  });
}

}  // namespace

void CpuBackend::copy(DeviceContext&, Tensor& dst, const Tensor& src) {
  cpu::expect_host(dst, "copy destination");
  cpu::expect_host(src, "copy source");
  cpu::expect_same_numel(dst, src, "copy");
  if (copy_relayouts(dst, src)) {
    copy_relayout(dst, src);
    return;
  }
  if (dst.dtype() != src.dtype()) {  // F32 <-> BF16: a conversion (backend_ops.inc)
    cpu::convert(dst, src);
    return;
  }
  if (dst.raw() == src.raw()) return;
  auto* d = static_cast<char*>(dst.raw());
  auto* s = static_cast<const char*>(src.raw());
  cpu::parallel_range(static_cast<int64_t>(dst.bytes()), 1 << 20, [&](int64_t b, int64_t e) {
    std::memcpy(d + b, s + b, e - b);
  });
}

void CpuBackend::gather_rows(DeviceContext&, Tensor& dst, const Tensor& table,
                             const Tensor& rows) {
  cpu::expect_host(dst, "gather_rows destination");
  cpu::expect_host(table, "gather_rows table");
  cpu::expect_host(rows, "gather_rows rows");
  const size_t row_bytes = size_t(gather_row_numel(dst, table, rows)) * dtype_size(dst.dtype());
  auto* d = static_cast<char*>(dst.raw());
  const auto* t = static_cast<const char*>(table.raw());
  const int32_t* r = rows.i32();
  // Rows of a few kB (a 1x28x28 image is 3 kB): grains of about 256 kB.
  const int64_t grain =
      std::max<int64_t>(1, int64_t((256u << 10) / std::max<size_t>(row_bytes, 1)));
  cpu::parallel_range(rows.numel(), grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(d + i * row_bytes, t + r[i] * row_bytes, row_bytes);
  });
}

void CpuBackend::add(DeviceContext&, Tensor& dst, const Tensor& src, float alpha) {
  cpu::expect_same_numel(dst, src, "add");
  // Either side may be BF16 (bf16 storage): widened, added in fp32, a BF16 dst rounded once.
  with_storage(dst.dtype(), [&](auto dst_tag) {
    with_storage(src.dtype(), [&](auto src_tag) {
      using D = decltype(dst_tag);
      using S = decltype(src_tag);
      D* d = elements<D>(dst);
      const S* s = elements<S>(src);
      cpu::parallel_range(dst.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) d[i] = narrow<D>(widen(d[i]) + alpha * widen(s[i]));
      });
    });
  });
}

void CpuBackend::scale(DeviceContext&, Tensor& t, float alpha) {
  float* d = t.f32();
  cpu::parallel_range(t.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] *= alpha;
  });
}

// relu_value and relu_passes: the ReLU's rule on every backend (engine/ops.h).
void CpuBackend::relu_forward(DeviceContext&, const Tensor& x, Tensor& y) {
  cpu::expect_same_numel(x, y, "relu");
  const float* a = x.f32();
  float* o = y.f32();
  cpu::parallel_range(x.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) o[i] = relu_value(a[i]);
  });
}

void CpuBackend::relu_backward(DeviceContext&, const Tensor& y, const Tensor& dy, Tensor& dx) {
  cpu::expect_same_numel(y, dy, "relu_backward");
  const float* out = y.f32();
  const float* g = dy.f32();
  float* d = dx.f32();
  // g[i] is read whatever the sign: a select of two loaded values vectorises, where reading g
  // only where out[i] passes made a branch per element, mispredicted on half of them (the backward
  // pass was 25x the forward's time per call before).
  cpu::parallel_range(y.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float gi = g[i];
      d[i] = relu_passes(out[i]) ? gi : 0.f;
    }
  });
}

void CpuBackend::dropout_forward(DeviceContext&, const Tensor& x, Tensor& y, Tensor& mask,
                                 float p, uint64_t seed) {
  cpu::expect_same_numel(x, y, "dropout");
  const float keep_scale = p < 1.f ? 1.f / (1.f - p) : 0.f;
  const float* a = x.f32();
  float* o = y.f32();
  float* m = mask.f32();
  cpu::parallel_range(x.numel(), cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      m[i] = dropout_uniform(seed, static_cast<uint64_t>(i)) >= p ? keep_scale : 0.f;
      o[i] = a[i] * m[i];
    }
  });
}

void CpuBackend::mul(DeviceContext&, const Tensor& a, const Tensor& b, Tensor& out) {
  cpu::expect_same_numel(a, b, "mul");
  const float* x = a.f32();
  const float* z = b.f32();
  float* o = out.f32();
  cpu::parallel_range(a.numel(), cpu::kGrain, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) o[i] = x[i] * z[i];
  });
}

}  // namespace replica
