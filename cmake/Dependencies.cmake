# Finds every dependency and makes one imported target per library.
# Required: TBB, OpenBLAS (pthread variant, one thread per call), zlib, CLI11, nlohmann-json, fmt, doctest.
# Optional: CUDA toolkit + cuBLAS + cuDNN (CUDA backend), NCCL, Gloo.

find_package(Threads REQUIRED)
find_package(TBB REQUIRED)
find_package(ZLIB REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(fmt REQUIRED)
find_package(doctest REQUIRED)

# OpenBLAS, one thread per call: parallelism comes from TBB (one BLAS call per worker).
# Debian's *serial* variant is built without USE_LOCKING, so concurrent sgemm calls from
# several threads share internal buffers and return corrupted results (measured: ~1 call in
# 130 under contention). The pthread variant locks its buffers; the CPU backend pins it to
# one thread per call with openblas_set_num_threads(1).
find_package(OpenBLAS CONFIG REQUIRED NO_DEFAULT_PATH
  HINTS /usr/lib/x86_64-linux-gnu/openblas-pthread/cmake/openblas
        /usr/lib/aarch64-linux-gnu/openblas-pthread/cmake/openblas)
if(NOT OpenBLAS_LIBRARIES MATCHES "openblas-pthread")
  message(FATAL_ERROR "OpenBLAS must be the pthread variant (thread-safe), found "
                      "${OpenBLAS_LIBRARIES}: delete the build directory and reconfigure")
endif()
add_library(replica_openblas INTERFACE IMPORTED)
target_include_directories(replica_openblas INTERFACE ${OpenBLAS_INCLUDE_DIRS})
target_link_libraries(replica_openblas INTERFACE ${OpenBLAS_LIBRARIES})

set(REPLICA_HAVE_CUDA OFF)
set(REPLICA_HAVE_CUDNN OFF)
set(REPLICA_HAVE_NCCL OFF)
if(REPLICA_CUDA)
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY)
      add_library(replica_cudnn INTERFACE IMPORTED)
      target_include_directories(replica_cudnn INTERFACE ${CUDNN_INCLUDE_DIR})
      target_link_libraries(replica_cudnn INTERFACE ${CUDNN_LIBRARY})
      set(REPLICA_HAVE_CUDNN ON)
      set(REPLICA_HAVE_CUDA ON)
    else()
      message(WARNING "nvcc found but cuDNN is missing: building without the CUDA backend")
    endif()
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(REPLICA_HAVE_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      add_library(replica_nccl INTERFACE IMPORTED)
      target_include_directories(replica_nccl INTERFACE ${NCCL_INCLUDE_DIR})
      target_link_libraries(replica_nccl INTERFACE ${NCCL_LIBRARY})
      set(REPLICA_HAVE_NCCL ON)
    endif()
  else()
    message(STATUS "replica: nvcc not found, CPU-only build")
  endif()
endif()

find_package(Gloo CONFIG QUIET)
if(TARGET gloo)
  set(REPLICA_HAVE_GLOO ON)
else()
  set(REPLICA_HAVE_GLOO OFF)
endif()
