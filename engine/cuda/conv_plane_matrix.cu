// Convolutions on planes smaller than their kernel as one GEMM over the batch with their plane
// matrix (engine/conv_geometry.h): CudaBackend::plane_matrix_conv2d_forward and _backward
// (REPLICA_CUDA_PLANE_MATRIX=0 leaves these layers to cuDNN).
//
// The seed recipe (ResNet-101 at 28x28) runs 22 of its 3x3 convolutions on 2x2 planes, where an
// implicit-GEMM convolution multiplies 9 taps per output pixel and 5 of them fall on padding,
// and three on 1x1 planes (8 of 9 on padding). Here a kernel writes M from the weights, the
// products are the linear layer's cuBLAS calls on the NCHW tensors seen as [n, c*h*w] (fp32,
// tf32 as the handle's math mode says), and a second kernel folds M's gradient back onto the
// taps. On an H200 (2026-11-29) the seed recipe's fp32 step ran 1.53x faster than on cuDNN's
// kernels (11,530 against 7,512 samples/s). fp32 and tf32 only: in bf16 the weight gradient
// would be rounded per entry of M before the fold rather than once per weight as cuDNN's and
// the CPU's are, and a dx added onto would need the staged add; bf16 runs channels_last, where
// cuDNN's tensor-core kernels take these layers anyway. NHWC operands keep cuDNN (a sample is
// then not M's row).
#include <optional>

#include "engine/conv_geometry.h"
#include "engine/cuda/channel_pass.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

// m[k*pq, c*hw] = the plane matrix of w[k, c, r, r]: a thread an entry.
__global__ void build_plane_matrix(const float* w, float* m, ConvGeometry g) {
  REPLICA_GRID_STRIDE(e, g.k * g.pq() * g.c * g.hw()) m[e] = plane_matrix_entry(w, g, e);
}

// dw[k, c, r, r] += its gradient from M's gradient dm: a thread a weight.
__global__ void fold_plane_matrix(const float* dm, float* dw, ConvGeometry g) {
  REPLICA_GRID_STRIDE(e, g.k * g.c * g.r * g.r) dw[e] += plane_matrix_weight_grad(dm, g, e);
}

// The convolution's geometry where it runs through M: switched on, fp32 or tf32, every tensor
// F32 and NCHW, and M cheaper than the taps; else none.
std::optional<ConvGeometry> plane_matrix_geometry(const DeviceContext& ctx, const Tensor& x,
                                                  const Tensor& w, const Conv2dParams& p,
                                                  std::initializer_list<const Tensor*> tensors) {
  if (!switches::kCudaPlaneMatrix.on() || ctx.precision() == Precision::Bf16) return {};
  for (const Tensor* t : tensors)
    if (t->defined() && (t->dtype() != DType::F32 || t->nhwc_memory())) return {};
  const ConvGeometry g = conv_geometry(x, w, p);
  if (!plane_matrix_pays(g)) return {};
  return g;
}

}  // namespace

bool CudaBackend::plane_matrix_conv2d_forward(DeviceContext& ctx, const Tensor& x,
                                              const Tensor& w, const Tensor& b, Tensor& y,
                                              const Conv2dParams& p) {
  const std::optional<ConvGeometry> taken = plane_matrix_geometry(ctx, x, w, p, {&x, &w, &y});
  if (!taken) return false;
  const ConvGeometry& g = *taken;
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int64_t rows = g.k * g.pq(), cols = g.c * g.hw();
  Tensor m = ctx.alloc({rows, cols});
  op_part(ctx, cuda::kPlaneMatrixPart, [&] {
    build_plane_matrix<<<cuda::grid_for(rows * cols), cuda::kThreads, 0, stream>>>(
        w.f32(), m.f32(), g);
    REPLICA_LAUNCH_CHECK();
  });
  Tensor ys = y.reshape({g.n, rows});
  linear_forward(ctx, x.reshape({g.n, cols}), m, Tensor(), ys);
  if (b.defined()) cuda::add_channel_bias({g.n, g.k, g.pq()}, y, b, stream);
  return true;
}

bool CudaBackend::plane_matrix_conv2d_backward(DeviceContext& ctx, const Tensor& x,
                                               const Tensor& w, const Tensor& dy, Tensor& dx,
                                               Tensor& dw, Tensor& db, const Conv2dParams& p,
                                               InputGrad dx_mode) {
  const std::optional<ConvGeometry> taken =
      plane_matrix_geometry(ctx, x, w, p, {&x, &w, &dy, &dx, &dw});
  if (!taken) return false;
  const ConvGeometry& g = *taken;
  const cuda::ChannelDims bias{g.n, g.k, g.pq()};
  const int bias_slices = db.defined() ? cuda::channel_slices(bias, "conv2d_backward") : 0;
  const cudaStream_t stream = cuda_state(ctx).stream;
  const int64_t rows = g.k * g.pq(), cols = g.c * g.hw();
  const bool want_dx = dx.defined() && dx.numel() > 0;
  // M for dx; M's gradient, from zero (the linear layer's dw adds onto what it holds).
  Tensor m, dm;
  op_part(ctx, cuda::kPlaneMatrixPart, [&] {
    if (want_dx) {
      m = ctx.alloc({rows, cols});
      build_plane_matrix<<<cuda::grid_for(rows * cols), cuda::kThreads, 0, stream>>>(
          w.f32(), m.f32(), g);
      REPLICA_LAUNCH_CHECK();
    }
    if (dw.defined()) {
      dm = ctx.alloc({rows, cols});
      REPLICA_CUDA_CHECK(cudaMemsetAsync(dm.raw(), 0, dm.bytes(), stream));
    }
  });
  if (want_dx || dw.defined()) {
    // dx added onto: this call's gradient in a buffer of its own, then added.
    const bool adds = want_dx && dx_mode == InputGrad::Accumulate;
    Tensor own = adds ? ctx.alloc(dx.shape(), dx.dtype()) : dx;
    Tensor dx_rows = want_dx ? own.reshape({g.n, cols}) : Tensor(), no_db;
    // Without dx, M's gradient stands in for M: the linear layer reads its weights for dx only.
    linear_backward(ctx, x.reshape({g.n, cols}), want_dx ? m : dm, dy.reshape({g.n, rows}),
                    dx_rows, dm, no_db);
    if (adds) add(ctx, dx, own, 1.f);
  }
  if (dw.defined())
    op_part(ctx, cuda::kPlaneMatrixPart, [&] {
      fold_plane_matrix<<<cuda::grid_for(dw.numel()), cuda::kThreads, 0, stream>>>(
          dm.f32(), dw.f32(), g);
      REPLICA_LAUNCH_CHECK();
    });
  if (db.defined())
    cuda::accumulate_bias_grad(bias, bias_slices, dy,
                               scratch(ctx, cuda::channel_sum_scratch(bias, bias_slices)), db,
                               stream);
  return true;
}

}  // namespace replica
