// Precision::Bf16 on CPU devices: the fp32 kernels run on operands rounded to bf16 and their
// results are rounded to bf16, which is what a bf16 tensor core computes (exact products of
// bf16 numbers, summed in fp32, the result stored in bf16) up to the order of the sums. Written
// once for convolutions and linear layers, whose biases act alike in the forward pass: one value
// per output channel, `inner` elements per channel per sample (a convolution's P*Q output
// pixels; 1 for a linear layer); their bias gradients are the fp32 kernels' own. It is for the
// numbers (what bf16 costs a model in accuracy, a reference for the GPU's bf16), not for speed:
// each call adds a rounding pass over its operands.
// Activations and their gradients may be BF16 tensors (bf16 storage): such an operand is widened
// into the F32 copy the rounding would have made (its values are bf16 numbers already), and a
// BF16 result is computed into an F32 buffer and stored rounded, so an operand takes one F32
// copy rather than the storage layer's widening and then this file's rounding.
#include <algorithm>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"

namespace replica {

namespace {

void round_into(float* dst, const float* src, int64_t n) {
  cpu::parallel_range(n, cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = bf16_round(src[i]);
  });
}

// An operand's bf16 values in F32: a BF16 tensor widened (exact), an F32 one rounded.
Tensor operand(DeviceContext& ctx, const Tensor& t) {
  Tensor r = ctx.alloc(t.shape());
  if (t.dtype() == DType::BF16) cpu::convert(r, t);
  else round_into(r.f32(), t.f32(), t.numel());
  return r;
}

// Where a result is computed: `out` itself when F32, else an F32 buffer of its shape, which is
// then stored into it.
Tensor f32_result(DeviceContext& ctx, Tensor& out) {
  return out.dtype() == DType::F32 ? out : ctx.alloc(out.shape());
}
// `result` (f32_result's) into `out`, rounded to bf16 once: a BF16 out rounds it as it stores
// it; an F32 out is `result` itself, rounded in place.
void store_rounded(Tensor& out, Tensor& result) {
  if (out.dtype() == DType::BF16) cpu::convert(out, result);
  else round_into(result.f32(), result.f32(), result.numel());
}

}  // namespace

namespace cpu {

void convert(Tensor& dst, const Tensor& src) {
  if (copy_narrows(dst, src)) {
    uint16_t* d = dst.bf16();
    const float* s = src.f32();
    parallel_range(dst.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) d[i] = bf16_bits(s[i]);
    });
  } else {
    float* d = dst.f32();
    const uint16_t* s = src.bf16();
    parallel_range(dst.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) d[i] = bf16_value(s[i]);
    });
  }
}

void bf16_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                  Tensor& y, int64_t inner, const ProductForward& product) {
  const Tensor xr = operand(ctx, x), wr = operand(ctx, w);
  Tensor out = f32_result(ctx, y);
  product(xr, wr, out);
  if (!b.defined()) return store_rounded(y, out);
  // The product rounded, the bias added in fp32, and a BF16 y's sum rounded as it is stored.
  float* yp = out.f32();
  round_into(yp, yp, out.numel());
  const float* bp = b.f32();
  const int64_t channels = b.numel();
  parallel_range(out.numel() / inner, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < inner; ++i) yp[r * inner + i] += bp[r % channels];
  });
  if (y.dtype() == DType::BF16) convert(y, out);
}

Tensor bf16_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                     Tensor& dx, Tensor& dw, const ProductBackward& product) {
  const Tensor xr = operand(ctx, x), wr = operand(ctx, w), dyr = operand(ctx, dy);
  // This call's weight gradient alone, so that it is rounded before it joins the accumulated one
  // (as PyTorch's bf16 weight gradient is before it is added to the fp32 .grad).
  Tensor step = ctx.alloc(w.shape());
  std::fill(step.f32(), step.f32() + step.numel(), 0.f);
  Tensor dx_out = dx.defined() ? f32_result(ctx, dx) : Tensor();
  product(xr, wr, dyr, dx_out, step);
  if (dx.defined()) store_rounded(dx, dx_out);
  if (dw.defined()) {
    float* d = dw.f32();
    const float* s = step.f32();
    parallel_range(dw.numel(), kGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) d[i] += bf16_round(s[i]);
    });
  }
  // dy's own values in F32, for the bias gradient: a BF16 dy's widening, an F32 dy itself.
  return dy.dtype() == DType::BF16 ? dyr : dy;
}

}  // namespace cpu

}  // namespace replica
