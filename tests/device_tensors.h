// Host values to and from a device, for the suites that hold one backend's numbers to
// another's: a tensor made from floats in any dtype and layout (converted on the CPU, then
// copied over), and any tensor read back as floats in NCHW order.
#pragma once
#include <algorithm>
#include <vector>

#include "engine/context.h"
#include "engine/ops.h"

namespace test {

using namespace replica;

// A CPU context for the conversions (one per test program).
inline DeviceContext& host_context() {
  static DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  return ctx;
}

// `values` (NCHW order) as a tensor of ctx: `dtype` (BF16: each value rounded), laid out NHWC
// where channels_last (engine/tensor.h).
inline Tensor put(DeviceContext& ctx, const Shape& shape, const std::vector<float>& values,
                  DType dtype = DType::F32, bool channels_last = false) {
  DeviceContext& host = host_context();
  Tensor f = host.alloc(shape);
  std::copy(values.begin(), values.end(), f.f32());
  Tensor h = Tensor::empty(host_allocator(), shape, dtype, channels_last);
  host.ops().copy(host, h, f);  // the CPU's conversion: dtype and layout
  Tensor d = ctx.alloc(shape, dtype, channels_last);
  ctx.ops().copy(ctx, d, h);
  return d;
}

// t's values in NCHW order, as floats.
inline std::vector<float> get(DeviceContext& ctx, const Tensor& t) {
  DeviceContext& host = host_context();
  Tensor h = Tensor::empty(host_allocator(), t.shape(), t.dtype(), t.channels_last());
  ctx.ops().copy(ctx, h, t);
  ctx.synchronize();
  Tensor f = host.alloc(t.shape());
  host.ops().copy(host, f, h);
  return std::vector<float>(f.f32(), f.f32() + f.numel());
}

}  // namespace test
