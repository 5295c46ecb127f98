// REPLICA_HOST_DEVICE marks a function both backends run: compiled for the GPU as well under
// nvcc, an ordinary inline function elsewhere (the CPU backend, the CPU tests of GPU arithmetic).
#pragma once

#if defined(__CUDACC__)
#define REPLICA_HOST_DEVICE __host__ __device__ inline
#else
#define REPLICA_HOST_DEVICE inline
#endif
