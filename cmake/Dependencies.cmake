# Finds every dependency and makes one imported target per library.
# Required: TBB, OpenBLAS (pthread variant, one thread per call), zlib, libjpeg (libjpeg-turbo),
# libpng, CLI11, nlohmann-json, fmt, doctest.
# Optional: CUDA toolkit + cuBLAS + cuDNN (the CUDA backend plugin), NCCL (its plugin), Gloo.

find_package(Threads REQUIRED)
find_package(TBB REQUIRED)
find_package(ZLIB REQUIRED)
find_package(JPEG REQUIRED)  # image-folder datasets: JPEG and PNG files
find_package(PNG REQUIRED)
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
    # cuDNN and NCCL: from the CUDA toolkit or the system (Debian, NVIDIA's repositories), from
    # CUDNN_ROOT / NCCL_ROOT (CMake variables or environment), or from PyTorch's pip wheels
    # (site-packages/nvidia/cudnn, nvidia/nccl), which on a PyTorch workstation are often the
    # only copies. Wheels ship versioned libraries only (libcudnn.so.9, libnccl.so.2).
    set(replica_wheel_dirs "")
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c
          "import site, sys; print(';'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))"
        OUTPUT_VARIABLE replica_site_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      foreach(d ${replica_site_dirs})
        if(IS_DIRECTORY "${d}/nvidia")
          list(APPEND replica_wheel_dirs "${d}/nvidia")
        endif()
      endforeach()
    endif()
    macro(replica_find_cuda_lib var header lib soversion root_var wheel)
      set(_hints ${${root_var}} $ENV{${root_var}} ${CUDAToolkit_LIBRARY_ROOT})
      foreach(w ${replica_wheel_dirs})
        list(APPEND _hints "${w}/${wheel}")
      endforeach()
      find_path(${var}_INCLUDE_DIR ${header} HINTS ${_hints} ${CUDAToolkit_INCLUDE_DIRS}
                PATH_SUFFIXES include)
      # NAMES_PER_DIR: the first directory with either name wins, so the library comes from
      # where the header came from (a ROOT's versioned-only copy before the toolkit's).
      find_library(${var}_LIBRARY NAMES ${lib} lib${lib}.so.${soversion} NAMES_PER_DIR
                   HINTS ${_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
    endmacro()
    replica_find_cuda_lib(CUDNN cudnn.h cudnn 9 CUDNN_ROOT cudnn)
    if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY)
      add_library(replica_cudnn_lib INTERFACE IMPORTED)
      target_include_directories(replica_cudnn_lib INTERFACE ${CUDNN_INCLUDE_DIR})
      target_link_libraries(replica_cudnn_lib INTERFACE ${CUDNN_LIBRARY})
      set(REPLICA_HAVE_CUDNN ON)
      set(REPLICA_HAVE_CUDA ON)
    else()
      message(WARNING "nvcc found but cuDNN is missing: building without the CUDA backend "
                      "(set CUDNN_ROOT to cuDNN's directory)")
    endif()
    replica_find_cuda_lib(NCCL nccl.h nccl 2 NCCL_ROOT nccl)
    if(REPLICA_HAVE_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      add_library(replica_nccl_lib INTERFACE IMPORTED)
      target_include_directories(replica_nccl_lib INTERFACE ${NCCL_INCLUDE_DIR})
      target_link_libraries(replica_nccl_lib INTERFACE ${NCCL_LIBRARY})
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
