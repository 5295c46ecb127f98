// CPU GEMM (OpenBLAS, one thread per call) and the linear layer on it.
#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

namespace cpu {

void pin_blas_to_one_thread() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), alpha, A, int(lda), B,
              int(ldb), beta, C, int(ldc));
}

void parallel_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                    float* C, int64_t ldc) {
  const auto grain = [](int64_t extent) { return std::max<int64_t>(32, extent / 8); };
  if (M >= N) {
    parallel_range(M, grain(M), [&](int64_t i0, int64_t i1) {
      sgemm(trans_a, trans_b, i1 - i0, N, K, alpha, trans_a ? A + i0 : A + i0 * lda, lda, B, ldb,
            beta, C + i0 * ldc, ldc);
    });
  } else {
    parallel_range(N, grain(N), [&](int64_t j0, int64_t j1) {
      sgemm(trans_a, trans_b, M, j1 - j0, K, alpha, A, lda, trans_b ? B + j0 * ldb : B + j0, ldb,
            beta, C + j0, ldc);
    });
  }
}

}  // namespace cpu

namespace {

void linear_forward_fp32(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  const int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  REPLICA_CHECK(w.dim(1) == in, "linear: input has {} features, weight expects {}", in, w.dim(1));
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* bp = b.defined() ? b.f32() : nullptr;
  float* yp = y.f32();
  cpu::parallel_range(n, 32, [&](int64_t r0, int64_t r1) {
    if (bp)
      for (int64_t i = r0; i < r1; ++i) std::memcpy(yp + i * out, bp, out * sizeof(float));
    cpu::sgemm(false, true, r1 - r0, out, in, 1.f, xp + r0 * in, in, wp, in, bp ? 1.f : 0.f,
               yp + r0 * out, out);
  });
}

// db[o] += sum_n dy[n, o] (in sample order; skipped if db is undefined)
void linear_bias_grad(const Tensor& dy, Tensor& db) {
  if (!db.defined()) return;
  const int64_t out = db.numel(), n = out ? dy.numel() / out : 0;
  const float* g = dy.f32();
  float* dbp = db.f32();
  for (int64_t o = 0; o < out; ++o) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += g[i * out + o];
    dbp[o] += s;
  }
}

// dx, dw as Backend::linear_backward; no bias gradient.
void linear_backward_fp32(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx,
                          Tensor& dw) {
  const int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* g = dy.f32();
  if (dx.defined()) {
    float* d = dx.f32();
    cpu::parallel_range(n, 32, [&](int64_t r0, int64_t r1) {
      cpu::sgemm(false, false, r1 - r0, in, out, 1.f, g + r0 * out, out, wp, in, 0.f,
                 d + r0 * in, in);
    });
  }
  if (!dw.defined()) return;  // a frozen weight: no gradient wanted
  // dw[o, :] += sum_n dy[n, o] x[n, :], split over output rows (each row summed over n in order)
  float* dwp = dw.f32();
  cpu::parallel_range(out, 8, [&](int64_t o0, int64_t o1) {
    cpu::sgemm(true, false, o1 - o0, in, n, 1.f, g + o0, out, xp, in, 1.f, dwp + o0 * in, in);
  });
}

}  // namespace

void CpuBackend::linear_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                const Tensor& b, Tensor& y) {
  if (ctx.precision() != Precision::Bf16) return linear_forward_fp32(x, w, b, y);
  cpu::bf16_forward(ctx, x, w, b, y, 1, [](const Tensor& xr, const Tensor& wr, Tensor& out) {
    linear_forward_fp32(xr, wr, Tensor(), out);
  });
}

void CpuBackend::linear_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db) {
  if (ctx.precision() != Precision::Bf16) {
    linear_backward_fp32(x, w, dy, dx, dw);
    linear_bias_grad(dy, db);
    return;
  }
  // The bias gradient from dy's own values, as in fp32.
  linear_bias_grad(cpu::bf16_backward(ctx, x, w, dy, dx, dw, linear_backward_fp32), db);
}

}  // namespace replica
