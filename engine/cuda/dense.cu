// CUDA backend: fully connected layer through cuBLAS SGEMM (plain FP32, no TF32).
//
// cuBLAS is column-major. A row-major [R, C] matrix is the same memory as a column-major
// [C, R] one, i.e. its transpose, so each row-major product below is written for the transposes:
//   y  = x w^T     ->  y^T  (out x N)  = w^T(col-major [in,out], op T) . x^T(col-major [in,N])
//   dx = dy w      ->  dx^T (in x N)   = w^T(col-major [in,out])       . dy^T(col-major [out,N])
//   dw += dy^T x   ->  dw^T (in x out) = x^T(col-major [in,N])         . dy(col-major [out,N], op T)
#include "engine/cuda/cuda_backend.h"

namespace replica {

namespace {

// y[n, j] += b[j] over y [rows, cols]
__global__ void add_row_bias_kernel(float* y, const float* b, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  REPLICA_GRID_STRIDE(i, total)
    y[i] += b[i % cols];
}

// db[j] += sum_n dy[n, j]: one thread per column, rows summed in order (deterministic and
// coalesced: neighbouring threads read neighbouring columns).
__global__ void column_sum_accumulate_kernel(const float* dy, float* db, int64_t rows,
                                             int64_t cols) {
  REPLICA_GRID_STRIDE(j, cols) {
    float s = 0.f;
    for (int64_t n = 0; n < rows; ++n) s += dy[n * cols + j];
    db[j] += s;
  }
}

int to_int(int64_t v, const char* what) {
  REPLICA_CHECK(v <= INT32_MAX, "linear: {} = {} exceeds cuBLAS's 32-bit sizes", what, v);
  return static_cast<int>(v);
}

// Checks that x [N, in] and w [out, in] fit and returns their sizes.
struct LinearDims {
  int64_t N, in, out;
};

LinearDims linear_dims(const Tensor& x, const Tensor& w, const char* op) {
  REPLICA_CHECK(x.ndim() == 2 && w.ndim() == 2, "{}: x {} and w {} must be 2-D", op,
                shape_str(x.shape()), shape_str(w.shape()));
  REPLICA_CHECK(w.dim(1) == x.dim(1), "{}: x {} does not match w {}", op, shape_str(x.shape()),
                shape_str(w.shape()));
  return {x.dim(0), x.dim(1), w.dim(0)};
}

}  // namespace

void CudaBackend::linear_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                 const Tensor& b, Tensor& y) {
  const char* op = "linear_forward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, w, op, "w");
  cuda::expect_device(ctx, y, op, "y");
  const auto [N, in, out] = linear_dims(x, w, op);
  cuda::expect_numel(y, N * out, op, "y");
  if (b.defined()) {
    cuda::expect_device(ctx, b, op, "b");
    cuda::expect_numel(b, out, op, "b");
  }
  if (N == 0 || out == 0) return;
  CudaState& s = cuda_state(ctx);
  if (in == 0) {
    REPLICA_CUDA_CHECK(cudaMemsetAsync(y.raw(), 0, y.bytes(), s.stream));
  } else {
    const float one = 1.f, zero = 0.f;
    REPLICA_CUBLAS_CHECK(cublasSgemm(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, to_int(out, "out"),
                                     to_int(N, "N"), to_int(in, "in"), &one, w.f32(),
                                     to_int(in, "in"), x.f32(), to_int(in, "in"), &zero, y.f32(),
                                     to_int(out, "out")));
  }
  if (b.defined()) {
    add_row_bias_kernel<<<cuda::grid_for(N * out), cuda::kThreads, 0, s.stream>>>(
        y.f32(), b.f32(), N, out);
    REPLICA_LAUNCH_CHECK();
  }
}

void CudaBackend::linear_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db) {
  const char* op = "linear_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, w, op, "w");
  cuda::expect_device(ctx, dy, op, "dy");
  const auto [N, in, out] = linear_dims(x, w, op);
  cuda::expect_numel(dy, N * out, op, "dy");
  CudaState& s = cuda_state(ctx);
  const float one = 1.f, zero = 0.f;

  if (dx.defined()) {
    cuda::expect_device(ctx, dx, op, "dx");
    cuda::expect_numel(dx, N * in, op, "dx");
    if (N > 0 && in > 0) {
      if (out == 0) {
        REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), s.stream));
      } else {
        REPLICA_CUBLAS_CHECK(cublasSgemm(s.cublas, CUBLAS_OP_N, CUBLAS_OP_N, to_int(in, "in"),
                                         to_int(N, "N"), to_int(out, "out"), &one, w.f32(),
                                         to_int(in, "in"), dy.f32(), to_int(out, "out"), &zero,
                                         dx.f32(), to_int(in, "in")));
      }
    }
  }
  if (dw.defined()) {
    cuda::expect_device(ctx, dw, op, "dw");
    cuda::expect_numel(dw, out * in, op, "dw");
    if (N > 0 && in > 0 && out > 0) {
      REPLICA_CUBLAS_CHECK(cublasSgemm(s.cublas, CUBLAS_OP_N, CUBLAS_OP_T, to_int(in, "in"),
                                       to_int(out, "out"), to_int(N, "N"), &one, x.f32(),
                                       to_int(in, "in"), dy.f32(), to_int(out, "out"), &one,
                                       dw.f32(), to_int(in, "in")));
    }
  }
  if (db.defined()) {
    cuda::expect_device(ctx, db, op, "db");
    cuda::expect_numel(db, out, op, "db");
    if (N > 0 && out > 0) {
      column_sum_accumulate_kernel<<<cuda::grid_for(out), cuda::kThreads, 0, s.stream>>>(
          dy.f32(), db.f32(), N, out);
      REPLICA_LAUNCH_CHECK();
    }
  }
}

}  // namespace replica
