// The CPU backend: OpenBLAS (one thread per call, one call per worker thread) for GEMM and im2col
// convolutions, TBB for everything else. All parallel loops run inside the calling device's
// arena (DeviceContext::run), so virtual CPU devices do not oversubscribe cores.
// Deterministic: every reduction is split into chunks fixed by the problem size (never by the
// thread count or scheduling) and summed in a fixed order.
#pragma once
#include <functional>

#include "engine/error.h"
#include "engine/ops.h"

namespace replica {

class CpuBackend final : public Backend {
 public:
#define REPLICA_OP(name, params, args) void name params override;
#include "engine/backend_ops.inc"
#undef REPLICA_OP
  // Convolutions, linear layers (bf16.cpp) and add read and write BF16 activations themselves;
  // every other op runs on the storage layer's F32 copies (engine/bf16_storage.h).
  bool takes_bf16(OpId op) const override;
};

namespace cpu {
// Elementwise loops run in parallel in grains of this many elements (fixed, so results and
// chunking never depend on the thread count).
constexpr int64_t kGrain = 16384;

template <class F>
void parallel_range(int64_t n, int64_t grain, F&& f);  // f(begin, end)

// The ways a convolution runs (engine/cpu/conv.cpp), as the op profile's parts of
// conv2d_forward and conv2d_backward: replica-bench --suite ops prints them under the op.
inline constexpr const char* kConvPlaneMatrixPart = "plane matrix";
inline constexpr const char* kConvDirectPart = "direct convolution";
inline constexpr const char* kConvBatchedPart = "im2col + GEMM over the batch";
inline constexpr const char* kConvPerSamplePart = "im2col + GEMM per sample";

// Argument checks the kernels share.
inline void expect_host(const Tensor& t, const char* what) {
  REPLICA_CHECK(t.on_host(), "CPU backend: {} is in GPU memory", what);
}
inline void expect_same_numel(const Tensor& a, const Tensor& b, const char* op) {
  REPLICA_CHECK(a.numel() == b.numel(), "{}: {} vs {} elements", op, shape_str(a.shape()),
                shape_str(b.shape()));
}

// dst <- src between F32 and BF16 (either way; same numel, host memory): BF16 to F32 is exact,
// F32 to BF16 rounds through bf16_bits (engine/ops.h). copy's conversion (bf16.cpp).
void convert(Tensor& dst, const Tensor& src);

// OpenBLAS runs one thread per call (the TBB worker's); called once per process.
void pin_blas_to_one_thread();

// Row-major single-precision GEMM through OpenBLAS (one thread per call):
// C[M,N] = alpha * op(A) op(B) + beta * C
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc);

// sgemm as GEMM calls run in parallel, over blocks of C's larger dimension fixed by the shape (an
// eighth of it, at least 32): every element of C is the same sum whatever the thread count. Each
// call packs the whole operand the split does not cut (all of B for a block of rows, all of A
// for a block of columns), so cutting the larger dimension repacks the smaller operand: at batch
// 256, ResNet-101's row blocks spent a third as long repacking columns as multiplying them.
void parallel_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                    float* C, int64_t ldc);

// Precision::Bf16 around an fp32 product (bf16.cpp). `product` computes without a bias, on F32
// tensors: forward y = f(x, w); backward dx = ... (overwritten, skipped if undefined) and
// dw += .... x, dy, y and dx may be BF16 (bf16 storage); w, dw and the bias are F32.
// Forward adds the bias in fp32 after rounding (`inner`: elements per output channel per
// sample); backward leaves the bias gradient to the caller's fp32 code, summed from dy's own
// values, which it returns in F32 (dy itself, or its widening).
using ProductForward = std::function<void(const Tensor& x, const Tensor& w, Tensor& y)>;
using ProductBackward = std::function<void(const Tensor& x, const Tensor& w, const Tensor& dy,
                                           Tensor& dx, Tensor& dw)>;
void bf16_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                  Tensor& y, int64_t inner, const ProductForward& product);
Tensor bf16_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                     Tensor& dx, Tensor& dw, const ProductBackward& product);
}  // namespace cpu

}  // namespace replica

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

template <class F>
void replica::cpu::parallel_range(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
#ifdef REPLICA_SERIAL_KERNELS
  grain = n;
#endif
  if (n <= grain) {
    f(int64_t(0), n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); },
                    tbb::simple_partitioner());
}
