// CUDA-side internals: the per-context CudaState (stream, cuBLAS/cuDNN handles, math settings) and
// the checking macros. Included only by .cu files of the CUDA backend; the rest of the engine sees
// CudaState as an opaque type through engine/cudart.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "engine/context.h"
#include "engine/error.h"

namespace replica {

struct CudaState {
  int ordinal = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cudnnHandle_t cudnn = nullptr;
  bool deterministic = false;
  bool tf32 = false;  // Precision::Tf32: GEMMs and convolutions may use TF32 tensor cores
  bool benchmark = false;  // convolution algorithms picked by timing (cuDNN's Find)
};

namespace cuda_detail {
const char* cublas_status_string(cublasStatus_t s);
[[noreturn]] void throw_cuda(const char* call, int code, const char* what, const char* file,
                             int line);
}  // namespace cuda_detail

// The CUDA state of a context; throws when the context is not a CUDA one.
CudaState& cuda_state(const DeviceContext& ctx);

// Held around every cudaFree of the backend (and cuDNN's timed Find, which allocates and frees
// its own trial buffers) and around each NCCL group launch of DP over distinct GPUs. cudaFree may
// wait for the device to go idle; a group launch half done leaves kernels on one GPU waiting for
// kernels not yet launched on another, and the launching thread can be held up by that cudaFree:
// NCCL's single-process deadlock, which PyTorch prevents with the same lock.
std::mutex& device_free_mutex();

}  // namespace replica

#define REPLICA_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    cudaError_t replica_err_ = (call);                                                    \
    if (replica_err_ != cudaSuccess) {                                                    \
      (void)cudaGetLastError(); /* clear a non-sticky error */                            \
      ::replica::cuda_detail::throw_cuda(#call, static_cast<int>(replica_err_),           \
                                         cudaGetErrorString(replica_err_), __FILE__,      \
                                         __LINE__);                                       \
    }                                                                                     \
  } while (0)

#define REPLICA_CUBLAS_CHECK(call)                                                        \
  do {                                                                                    \
    cublasStatus_t replica_st_ = (call);                                                  \
    if (replica_st_ != CUBLAS_STATUS_SUCCESS)                                             \
      ::replica::cuda_detail::throw_cuda(                                                 \
          #call, static_cast<int>(replica_st_),                                           \
          ::replica::cuda_detail::cublas_status_string(replica_st_), __FILE__, __LINE__); \
  } while (0)

#define REPLICA_CUDNN_CHECK(call)                                                         \
  do {                                                                                    \
    cudnnStatus_t replica_st_ = (call);                                                   \
    if (replica_st_ != CUDNN_STATUS_SUCCESS)                                              \
      ::replica::cuda_detail::throw_cuda(#call, static_cast<int>(replica_st_),            \
                                         cudnnGetErrorString(replica_st_), __FILE__,      \
                                         __LINE__);                                       \
  } while (0)

// After a kernel launch: catches bad launch configurations (and earlier asynchronous errors).
#define REPLICA_LAUNCH_CHECK()                                                            \
  do {                                                                                    \
    cudaError_t replica_err_ = cudaGetLastError();                                        \
    if (replica_err_ != cudaSuccess)                                                      \
      ::replica::cuda_detail::throw_cuda("kernel launch", static_cast<int>(replica_err_), \
                                         cudaGetErrorString(replica_err_), __FILE__,      \
                                         __LINE__);                                       \
  } while (0)
