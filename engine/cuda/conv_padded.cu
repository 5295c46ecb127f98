// A first layer's few input channels padded to 8 (CudaBackend::padded_conv2d_forward and
// _backward), so that in a channels_last context its convolution runs on cuDNN's NHWC
// tensor-core kernels like the others.
//
// Those kernels take channel counts that are multiples of 8. A ResNet stem's 3 channels (the
// seed recipe's 1) had stayed NCHW, and on NCHW bf16 cuDNN's filter gradient for the stem of
// ResNet-50 at batch 256 took 11.3 ms and its forward 2.4, 21% of a 66.6 ms step (H200,
// bench/results/2026-11-27-h200-nhwc.md). PyTorch's cuDNN pads such an input to NHWC itself.
// Here the operands are padded before the convolution sees them: x becomes NHWC with zero
// channels after its own up to 8, in the convolution's data type (bf16 in --precision bf16), in
// one pass that the convolution then reads where it is; w (and a gradient added onto) gains
// zero planes (a 2-D copy and a 2-D memset) and is staged as any filter bank. The convolution
// runs on those, and the gradients come back without the padding. A zero channel adds exact
// zeros to every sum, so the results are the unpadded convolution's up to the order of its
// sums. Padding x in NCHW first and letting the convolution stage it had moved 1.2 GB a pass at
// ResNet-50's batch 256 (x, its fp32 8-channel copy, the bf16 NHWC one); one pass moves 0.36.
//
// Off unless REPLICA_PAD_CHANNELS=1 (engine/env_switch.h). On an H200 (2026-11-29) it took
// ResNet-50 bf16 at batch 256 from 4,137 to 5,350 samples/s, and its forward matched NCHW's stage
// by stage on random weights and input; but one SGD step of ResNet-50 bf16 at 3x32x32 in
// test_cuda_channels_last gave a loss of 2.533 against NCHW's 2.397 (2.397 exactly with the
// padding off). That step is chaotic from the default init: on the CPU an ulp at 14 of the stem's
// outputs moved its loss by 2.7% (bench/results/2026-11-30-cpu.md). Until the checks built since
// (the walk on that step's weights and batch, the step with its residual branches damped) pass
// on a GPU, the stem runs NCHW as before.
#include <algorithm>

#include "engine/cuda/cuda_backend.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

constexpr int64_t kPadded = 8;  // the channel multiple cuDNN's NHWC kernels take

// Copies `rows` rows of `row` bytes between arrays whose rows are `from_pitch` and `to_pitch`
// bytes apart (a tensor's images, or a filter bank's filters, with or without the padding).
void copy_rows(void* to, size_t to_pitch, const void* from, size_t from_pitch, size_t row,
               int64_t rows, cudaStream_t stream) {
  REPLICA_CUDA_CHECK(cudaMemcpy2DAsync(to, to_pitch, from, from_pitch, row, size_t(rows),
                                       cudaMemcpyDeviceToDevice, stream));
}

// Where DeviceContext::nhwc_convolution runs a layer of few channels NHWC.
bool pads_channels(const DeviceContext& ctx, int64_t C, int64_t K) {
  return C > 0 && C < kPadded && K > 0 && ctx.nhwc_convolution(C, K);
}

// x's own channels then zeros, NHWC, a thread per pixel (its kPadded channels stored at once:
// 16 or 32 bytes). Images along the grid's y: no division by the plane. The values are x's,
// rounded where Out is BF16 as the convolution's staging rounds them.
template <class In, class Out>
__global__ void pad_nhwc_kernel(const In* x, Out* out, int64_t images, int64_t hw, int C,
                                bool x_nhwc) {
  for (int64_t n = blockIdx.y; n < images; n += gridDim.y)
    for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < hw;
         s += int64_t(gridDim.x) * blockDim.x) {
      union {
        Out v[kPadded];
        uint4 raw[kPadded * sizeof(Out) / 16];
      } pixel;
      for (int c = 0; c < kPadded; ++c)
        pixel.v[c] = narrow<Out>(c >= C  ? 0.f
                                 : x_nhwc ? widen(x[(n * hw + s) * C + c])
                                          : widen(x[(n * C + c) * hw + s]));
      uint4* to = reinterpret_cast<uint4*>(out + (n * hw + s) * kPadded);
      for (size_t k = 0; k < sizeof(pixel.raw) / 16; ++k) to[k] = pixel.raw[k];
    }
}

// x as the padded convolution reads it (pad_nhwc_kernel), from ctx's allocator on its stream.
Tensor padded_input(DeviceContext& ctx, const Tensor& x) {
  const DType dtype = ctx.precision() == Precision::Bf16 ? DType::BF16 : x.dtype();
  Shape shape = x.shape();
  shape[1] = kPadded;
  Tensor out = ctx.alloc(shape, dtype, true);
  const int64_t images = x.dim(0), hw = x.dim(2) * x.dim(3);
  const dim3 grid(unsigned(std::min<int64_t>((hw + cuda::kThreads - 1) / cuda::kThreads, 4096)),
                  unsigned(std::min<int64_t>(images, 65535)));
  with_storage(x.dtype(), [&](auto in) {
    with_storage(dtype, [&](auto to) {
      pad_nhwc_kernel<<<grid, cuda::kThreads, 0, cuda_state(ctx).stream>>>(
          elements<decltype(in)>(x), elements<decltype(to)>(out), images, hw, int(x.dim(1)),
          x.nhwc_memory());
    });
  });
  REPLICA_LAUNCH_CHECK();
  return out;
}

// t (weights and their gradients: [K, C, R, S], or an input gradient) as NCHW with zero channels
// after its own, up to 8, from ctx's allocator on its stream.
Tensor padded_channels(DeviceContext& ctx, const Tensor& t) {
  const cudaStream_t stream = cuda_state(ctx).stream;
  const Tensor src = t.nhwc_memory() ? cuda::nchw_copy(ctx, t) : t;
  Shape shape = t.shape();
  shape[1] = kPadded;
  Tensor out = ctx.alloc(shape, t.dtype());
  const int64_t rows = t.dim(0);
  const size_t row = src.bytes() / rows, pitch = out.bytes() / rows;
  copy_rows(out.raw(), pitch, src.raw(), row, row, rows, stream);
  // Zeros in each row's padding only: a memset of the whole tensor would be one more pass.
  REPLICA_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(out.raw()) + row, pitch, 0,
                                       pitch - row, size_t(rows), stream));
  return out;
}

// t's own channels back from `padded` into t, in t's layout.
void unpad_channels(DeviceContext& ctx, Tensor& t, const Tensor& padded) {
  const cudaStream_t stream = cuda_state(ctx).stream;
  Tensor dst = t.nhwc_memory() ? ctx.alloc(t.shape(), t.dtype()) : t;
  const int64_t rows = t.dim(0);
  copy_rows(dst.raw(), t.bytes() / rows, padded.raw(), padded.bytes() / rows, t.bytes() / rows,
            rows, stream);
  if (t.nhwc_memory()) cuda::copy_relayout(t, dst, stream);
}

}  // namespace

bool CudaBackend::padded_conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                        const Tensor& b, Tensor& y, const Conv2dParams& p) {
  if (x.numel() == 0 || !pads_channels(ctx, x.dim(1), w.dim(0))) return false;
  Tensor xp, wp;
  op_part(ctx, cuda::kPaddingPart, [&] {
    xp = padded_input(ctx, x);
    wp = padded_channels(ctx, w);
  });
  conv2d_forward(ctx, xp, wp, b, y, p);
  return true;
}

bool CudaBackend::padded_conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                         const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                                         const Conv2dParams& p, InputGrad dx_mode) {
  if (x.numel() == 0 || !pads_channels(ctx, x.dim(1), w.dim(0))) return false;
  const bool want_dx = dx.defined() && dx.numel() > 0;
  Tensor xp, wp, dxp, dwp;
  op_part(ctx, cuda::kPaddingPart, [&] {
    xp = padded_input(ctx, x);
    wp = padded_channels(ctx, w);
    // dw, and a dx added onto, bring their sums so far; the padding's gradients are dropped.
    if (dw.defined()) dwp = padded_channels(ctx, dw);
    if (want_dx)
      dxp = dx_mode == InputGrad::Accumulate ? padded_channels(ctx, dx)
                                             : ctx.alloc(xp.shape(), dx.dtype());
  });
  conv2d_backward(ctx, xp, wp, dy, dxp, dwp, db, p, dx_mode);
  op_part(ctx, cuda::kPaddingPart, [&] {
    if (dw.defined()) unpad_channels(ctx, dw, dwp);
    if (want_dx) unpad_channels(ctx, dx, dxp);
  });
  return true;
}

}  // namespace replica
