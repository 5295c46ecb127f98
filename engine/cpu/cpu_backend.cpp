// The CPU backend's factory; its kernels live in files named by what they compute, as the CUDA
// backend's do: elementwise, dense (GEMM, linear), conv, norm, pool, loss_optim.
#include "engine/cpu/cpu_backend.h"

namespace replica {

std::unique_ptr<Backend> make_cpu_backend() {
  cpu::pin_blas_to_one_thread();
  return std::make_unique<CpuBackend>();
}

}  // namespace replica
