// The CPU backend's factory; its kernels live in files named by what they compute, as the CUDA
// backend's do: elementwise, dense (GEMM, linear), conv, norm, pool, loss_optim.
#include "engine/cpu/cpu_backend.h"

namespace replica {

bool CpuBackend::takes_bf16(OpId op) const {
  switch (op) {
    case OpId::copy:
    case OpId::fill:
    case OpId::add:
    case OpId::conv2d_forward:
    case OpId::conv2d_backward:
    case OpId::linear_forward:
    case OpId::linear_backward:
      return true;
    default:
      return false;
  }
}

std::unique_ptr<Backend> make_cpu_backend() {
  cpu::pin_blas_to_one_thread();
  return std::make_unique<CpuBackend>();
}

}  // namespace replica
