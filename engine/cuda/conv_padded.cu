// A first layer's few input channels padded to 8 (CudaBackend::padded_conv2d_forward and
// _backward), so that in a channels_last context its convolution runs on cuDNN's NHWC
// tensor-core kernels like the others.
//
// Those kernels take channel counts that are multiples of 8. A ResNet stem's 3 channels (the
// seed recipe's 1) had stayed NCHW, and on NCHW bf16 cuDNN's filter gradient for the stem of
// ResNet-50 at batch 256 took 11.3 ms and its forward 2.4, 21% of a 66.6 ms step (H200,
// bench/results/2026-11-27-h200-nhwc.md). PyTorch's cuDNN pads such an input to NHWC itself.
// Here the operands are padded before the convolution sees them: x and w gain zero channels up
// to 8 (each image's C planes followed by 8 - C zero planes: a 2-D copy and a 2-D memset), the
// convolution runs on those, and the gradients come back without the padding. A zero channel
// adds exact zeros to every sum, so the results are the unpadded convolution's up to the order
// of its sums.
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

bool pads_channels(const DeviceContext& ctx, int64_t C, int64_t K) {
  return ctx.channels_last() && C > 0 && C < kPadded && K > 0 && K % kPadded == 0;
}

// t (activations, or weights and their gradients: [K, C, R, S]) as NCHW with zero channels
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
    xp = padded_channels(ctx, x);
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
    xp = padded_channels(ctx, x);
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
