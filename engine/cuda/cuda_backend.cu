// CUDA backend: construction, the checks every kernel file shares, scratch memory. The ops are in
// files named by what they compute, as the CPU backend's are: elementwise, dense, conv, norm,
// pool, loss_optim.
#include "engine/cuda/cuda_backend.h"

#include <algorithm>

namespace replica {

std::unique_ptr<Backend> cuda::make_backend() { return std::make_unique<CudaBackend>(); }

CudaBackend::~CudaBackend() { destroy_conv_plans(); }

namespace {

template <class T>
__global__ void fill_kernel(T* p, int64_t n, T v) {
  REPLICA_GRID_STRIDE(i, n)
    p[i] = v;
}

}  // namespace

bool CudaBackend::takes_bf16(OpId op) const {
  switch (op) {
    case OpId::copy:
    case OpId::fill:
    case OpId::conv2d_forward:
    case OpId::conv2d_backward:
    case OpId::batchnorm_forward_train:
    case OpId::batchnorm_forward_eval:
    case OpId::batchnorm_backward:
    case OpId::relu_forward:
    case OpId::relu_backward:
    case OpId::maxpool2d_forward:
    case OpId::maxpool2d_backward:
    case OpId::adaptive_avgpool2d_forward:
    case OpId::adaptive_avgpool2d_backward:
    case OpId::linear_forward:
    case OpId::linear_backward:
      return true;
    default:
      return false;
  }
}

Backend::Layouts CudaBackend::layouts(OpId op) const {
  switch (op) {
    case OpId::copy:
    case OpId::conv2d_forward:
    case OpId::conv2d_backward:
      return Layouts::Any;
    case OpId::fill:
    case OpId::add:
    case OpId::scale:
    case OpId::mul:
    case OpId::relu_forward:
    case OpId::relu_backward:
    case OpId::batchnorm_forward_train:
    case OpId::batchnorm_forward_eval:
    case OpId::batchnorm_backward:
    case OpId::maxpool2d_forward:
    case OpId::maxpool2d_backward:
      return Layouts::Uniform;
    default:
      return Layouts::None;
  }
}

namespace cuda {

template <class T>
void fill_async(T* p, int64_t n, T v, cudaStream_t stream) {
  fill_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, n, v);
  REPLICA_LAUNCH_CHECK();
}
template void fill_async<float>(float*, int64_t, float, cudaStream_t);
template void fill_async<int32_t>(int32_t*, int64_t, int32_t, cudaStream_t);
template void fill_async<uint16_t>(uint16_t*, int64_t, uint16_t, cudaStream_t);

void expect_device(const DeviceContext& ctx, const Tensor& t, const char* op, const char* what) {
  REPLICA_CHECK(t.defined(), "{}: {} is undefined", op, what);
  REPLICA_CHECK(t.on_cuda() && t.device().index == ctx.device().index,
                "{}: {} must be in the memory of {} (it is on {}{})", op, what,
                ctx.device().str(), t.device().str(), t.on_host() ? ", host memory" : "");
}

DType activations_dtype(const char* op, std::initializer_list<const Tensor*> tensors) {
  REPLICA_CHECK((*tensors.begin())->defined(), "{}: its first activation is undefined", op);
  const DType dt = (*tensors.begin())->dtype();
  for (const Tensor* t : tensors)
    REPLICA_CHECK(!t->defined() || t->dtype() == dt,
                  "{}: activations of different dtypes ({} and {}): give them one", op,
                  dtype_name(dt), dtype_name(t->dtype()));
  REPLICA_CHECK(dt == DType::F32 || dt == DType::BF16, "{}: activations are {}, not F32 or BF16",
                op, dtype_name(dt));
  return dt;
}

void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what) {
  REPLICA_CHECK(t.numel() == numel, "{}: {} has shape {} ({} elements), expected {} elements", op,
                what, shape_str(t.shape()), t.numel(), numel);
}

void expect_shape(const Tensor& t, const Shape& shape, const char* op, const char* what) {
  REPLICA_CHECK(t.shape() == shape, "{}: {} has shape {}, expected {}", op, what,
                shape_str(t.shape()), shape_str(shape));
}

void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what) {
  REPLICA_CHECK(t.dtype() == dtype, "{}: {} is {}, expected {}", op, what, dtype_name(t.dtype()),
                dtype_name(dtype));
}

}  // namespace cuda

Tensor CudaBackend::scratch(DeviceContext& ctx, int64_t floats) {
  return ctx.alloc({std::max<int64_t>(floats, 1)});
}

Tensor CudaBackend::workspace(DeviceContext& ctx, size_t bytes) {
  if (bytes == 0) return Tensor();
  return ctx.alloc({int64_t((bytes + sizeof(float) - 1) / sizeof(float))});
}

}  // namespace replica
