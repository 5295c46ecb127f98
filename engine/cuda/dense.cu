// CUDA backend: fully connected layer through cuBLAS: SGEMM in fp32 and tf32 (the handle's math
// mode says which, cuda_runtime.cu); in bf16 (Precision::Bf16) GemmEx on bf16 operands (copies
// of F32 ones; BF16 activations as they are) with fp32 compute and a bf16 result, brought into
// the output tensor, F32 or BF16 (bf16.cu).
//
// cuBLAS is column-major. A row-major [R, C] matrix is the same memory as a column-major
// [C, R] one, i.e. its transpose, so each row-major product below is written for the transposes:
//   y  = x w^T     ->  y^T  (out x N)  = w^T(col-major [in,out], op T) . x^T(col-major [in,N])
//   dx = dy w      ->  dx^T (in x N)   = w^T(col-major [in,out])       . dy^T(col-major [out,N])
//   dw += dy^T x   ->  dw^T (in x out) = x^T(col-major [in,N])         . dy(col-major [out,N], op T)
#include "engine/cuda/channel_pass.h"

namespace replica {

namespace {

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

// C = alpha op(A) op(B) + beta C, column-major as cublasSgemm; bf16: A, B and C hold bf16.
void gemm(const CudaState& s, bool bf16, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
          int64_t n, int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb, float beta,
          void* C, int64_t ldc) {
  const float one = 1.f;
  if (!bf16) {
    REPLICA_CUBLAS_CHECK(cublasSgemm(s.cublas, ta, tb, to_int(m, "m"), to_int(n, "n"),
                                     to_int(k, "k"), &one, static_cast<const float*>(A),
                                     to_int(lda, "lda"), static_cast<const float*>(B),
                                     to_int(ldb, "ldb"), &beta, static_cast<float*>(C),
                                     to_int(ldc, "ldc")));
    return;
  }
  REPLICA_CUBLAS_CHECK(cublasGemmEx(s.cublas, ta, tb, to_int(m, "m"), to_int(n, "n"),
                                    to_int(k, "k"), &one, A, CUDA_R_16BF, to_int(lda, "lda"), B,
                                    CUDA_R_16BF, to_int(ldb, "ldb"), &beta, C, CUDA_R_16BF,
                                    to_int(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
    const ProductIo io = forward_io(ctx, x, w, y);
    gemm(s, io.bf16, CUBLAS_OP_T, CUBLAS_OP_N, out, N, in, io.w, in, io.x, in, 0.f, io.y, out);
    io.finish(io.y, y, false, s.stream);
  }
  if (b.defined()) cuda::add_channel_bias({N, out, 1}, y, b, s.stream);
}

void CudaBackend::linear_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db) {
  const char* op = "linear_backward";
  cuda::expect_device(ctx, x, op, "x");
  cuda::expect_device(ctx, w, op, "w");
  cuda::expect_device(ctx, dy, op, "dy");
  const auto [N, in, out] = linear_dims(x, w, op);
  cuda::expect_numel(dy, N * out, op, "dy");
  if (dx.defined()) {
    cuda::expect_device(ctx, dx, op, "dx");
    cuda::expect_numel(dx, N * in, op, "dx");
  }
  if (dw.defined()) {
    cuda::expect_device(ctx, dw, op, "dw");
    cuda::expect_numel(dw, out * in, op, "dw");
  }
  if (db.defined()) {
    cuda::expect_device(ctx, db, op, "db");
    cuda::expect_numel(db, out, op, "db");
  }
  const cuda::ChannelDims bias{N, out, 1};
  const int bias_slices = db.defined() ? cuda::channel_slices(bias, op) : 0;  // before launches
  CudaState& s = cuda_state(ctx);
  const bool product = N > 0 && in > 0 && out > 0;  // else no GEMM has anything to sum
  const bool want_dx = dx.defined() && product, want_dw = dw.defined() && product;
  if (dx.defined() && N > 0 && in > 0 && out == 0)  // a sum over no outputs
    REPLICA_CUDA_CHECK(cudaMemsetAsync(dx.raw(), 0, dx.bytes(), s.stream));
  const ProductIo io = backward_io(ctx, x, w, dy, want_dx ? &dx : nullptr, want_dw ? &dw : nullptr);
  if (want_dx) {
    gemm(s, io.bf16, CUBLAS_OP_N, CUBLAS_OP_N, in, N, out, io.w, in, io.dy, out, 0.f, io.dx, in);
    io.finish(io.dx, dx, false, s.stream);
  }
  if (want_dw) {  // fp32: dw accumulates (beta 1); bf16: this call's part, added after
    gemm(s, io.bf16, CUBLAS_OP_N, CUBLAS_OP_T, in, out, N, io.x, in, io.dy, out,
         io.beta(true, io.dw, dw), io.dw, in);
    io.finish(io.dw, dw, true, s.stream);
  }
  if (db.defined() && N > 0 && out > 0)
    cuda::accumulate_bias_grad(bias, bias_slices, dy,
                               scratch(ctx, cuda::channel_sum_scratch(bias, bias_slices)), db,
                               s.stream);
}

}  // namespace replica
