// CPU convolution: im2col + OpenBLAS SGEMM (one thread per call), parallel over
// samples; layers with few output pixels run one GEMM over the whole batch, split over output
// rows. Weight gradients are accumulated per fixed chunk of samples (or in one GEMM over the
// batch), then summed in order, so the result does not depend on the number of threads.
#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/error.h"

namespace replica {

namespace {

// Chunks a weight-gradient reduction is split into: fixed by the batch, not the machine.
constexpr int64_t kMaxWeightChunks = 8;

struct ConvGeometry {
  int64_t n, c, h, w, k, r, p, q;
  int stride, pad;
  int64_t crr() const { return c * r * r; }
  int64_t pq() const { return p * q; }
  bool pointwise() const { return r == 1 && stride == 1 && pad == 0; }
};

ConvGeometry geometry(const Tensor& x, const Tensor& w, const Conv2dParams& prm) {
  REPLICA_CHECK(x.ndim() == 4 && w.ndim() == 4, "conv2d expects 4-d input and weight");
  REPLICA_CHECK(x.dim(1) == w.dim(1), "conv2d: input has {} channels, weight expects {}",
                x.dim(1), w.dim(1));
  REPLICA_CHECK(w.dim(2) == w.dim(3), "conv2d: only square kernels");
  ConvGeometry g{x.dim(0), x.dim(1), x.dim(2), x.dim(3), w.dim(0), w.dim(2), 0, 0,
                 prm.stride, prm.padding};
  g.p = window_out(g.h, int(g.r), prm.stride, prm.padding);
  g.q = window_out(g.w, int(g.r), prm.stride, prm.padding);
  REPLICA_CHECK(g.p > 0 && g.q > 0, "conv2d: input {}x{} too small for kernel {}", g.h, g.w, g.r);
  return g;
}

// Stride 1: the output columns [lo, hi) of kernel column j whose source column ox - pad + j lies
// inside the input; the others read padding.
struct ColumnRange {
  int64_t lo, hi;
};
ColumnRange valid_columns(const ConvGeometry& g, int64_t j) {
  const int64_t lo = std::min(g.q, std::max<int64_t>(0, g.pad - j));
  const int64_t hi = std::min(g.q, g.w + g.pad - j);
  return {lo, std::max(lo, hi)};
}

// Stride-1 rows of at least 8 output columns go through im2col_runs and col2im_runs: each row a
// zero fill, a contiguous run and a zero fill, the run's bounds worked out once per kernel
// column. The CNN's convolutions (rows of 24 and 8 columns) spent 40% of its step in the
// element-by-element loops below. Shorter rows (a ResNet's late stages, 1 to 7 columns) keep
// those loops, and so do strided rows: their runs compile to gathers, which made ResNet-18's
// stride-2 stem 15% slower here.
bool use_runs(const ConvGeometry& g) { return g.q >= 8 && g.stride == 1; }

// Not inlined into im2col: inlined, it made the element loops of ResNet-18's convolutions 10%
// slower here.
__attribute__((noinline)) void im2col_runs(const float* x, const ConvGeometry& g, float* cols,
                                           int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        float* out = cols + ((c * g.r + i) * g.r + j) * ld;
        const float* plane = x + c * g.h * g.w;
        const ColumnRange v = valid_columns(g, j);
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          float* __restrict row = out + oy * g.q;
          if (iy < 0 || iy >= g.h) {
            std::fill(row, row + g.q, 0.f);
            continue;
          }
          const float* __restrict src = plane + iy * g.w + v.lo - g.pad + j;
          for (int64_t ox = 0; ox < v.lo; ++ox) row[ox] = 0.f;
          for (int64_t k = 0; k < v.hi - v.lo; ++k) row[v.lo + k] = src[k];
          for (int64_t ox = v.hi; ox < g.q; ++ox) row[ox] = 0.f;
        }
      }
}

// col2im for the rows use_runs() takes; dx is zeroed by the caller.
__attribute__((noinline)) void col2im_runs(const float* cols, const ConvGeometry& g, float* dx,
                                           int64_t ld) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        const float* in = cols + ((c * g.r + i) * g.r + j) * ld;
        float* plane = dx + c * g.h * g.w;
        const ColumnRange v = valid_columns(g, j);
        for (int64_t oy = 0; oy < g.p; ++oy) {
          const int64_t iy = oy * g.stride - g.pad + i;
          if (iy < 0 || iy >= g.h) continue;
          float* __restrict dst = plane + iy * g.w + v.lo - g.pad + j;
          const float* __restrict src = in + oy * g.q + v.lo;
          for (int64_t k = 0; k < v.hi - v.lo; ++k) dst[k] += src[k];
        }
      }
}

// cols[(c*r + i)*r + j][oy*q + ox] = x[c][oy*s - pad + i][ox*s - pad + j] (0 outside); rows of
// cols are `ld` floats apart (pq for one sample alone, n*pq when the batch sits side by side).
void im2col(const float* x, const ConvGeometry& g, float* cols, int64_t ld) {
  if (use_runs(g)) return im2col_runs(x, g, cols, ld);
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        float* out = cols + ((c * g.r + i) * g.r + j) * ld;
        const float* plane = x + c * g.h * g.w;
        for (int64_t oy = 0; oy < g.p; ++oy) {
          int64_t iy = oy * g.stride - g.pad + i;
          float* orow = out + oy * g.q;
          if (iy < 0 || iy >= g.h) {
            std::fill(orow, orow + g.q, 0.f);
            continue;
          }
          const float* irow = plane + iy * g.w;
          for (int64_t ox = 0; ox < g.q; ++ox) {
            int64_t ix = ox * g.stride - g.pad + j;
            orow[ox] = (ix >= 0 && ix < g.w) ? irow[ix] : 0.f;
          }
        }
      }
}

// The adjoint of im2col: dx (zeroed here) accumulates every column entry at its source pixel.
void col2im(const float* cols, const ConvGeometry& g, float* dx, int64_t ld) {
  std::fill(dx, dx + g.c * g.h * g.w, 0.f);
  if (use_runs(g)) return col2im_runs(cols, g, dx, ld);
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.r; ++i)
      for (int64_t j = 0; j < g.r; ++j) {
        const float* in = cols + ((c * g.r + i) * g.r + j) * ld;
        float* plane = dx + c * g.h * g.w;
        for (int64_t oy = 0; oy < g.p; ++oy) {
          int64_t iy = oy * g.stride - g.pad + i;
          if (iy < 0 || iy >= g.h) continue;
          float* drow = plane + iy * g.w;
          const float* irow = in + oy * g.q;
          for (int64_t ox = 0; ox < g.q; ++ox) {
            int64_t ix = ox * g.stride - g.pad + j;
            if (ix >= 0 && ix < g.w) drow[ix] += irow[ox];
          }
        }
      }
}

// A per-task scratch buffer from the device's caching allocator.
Tensor scratch(DeviceContext& ctx, int64_t n) { return ctx.alloc({std::max<int64_t>(n, 1)}); }

// Sums `chunks` partial buffers of `n` floats (laid out one after another) into dst, in order.
void sum_chunks_into(const float* partial, int64_t chunks, int64_t n, float* dst) {
  cpu::parallel_range(n, cpu::kGrain, [&](int64_t b, int64_t e) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* src = partial + c * n;
      for (int64_t i = b; i < e; ++i) dst[i] += src[i];
    }
  });
}

// db[k] += the sum of dy over samples and pixels (in double, in sample order)
void conv2d_bias_grad(const float* gp, const ConvGeometry& g, Tensor& db) {
  if (!db.defined()) return;
  float* dbp = db.f32();
  cpu::parallel_range(g.k, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      double s = 0.0;
      for (int64_t n = 0; n < g.n; ++n) {
        const float* row = gp + (n * g.k + k) * g.pq();
        float t = 0.f;
        for (int64_t i = 0; i < g.pq(); ++i) t += row[i];
        s += t;
      }
      dbp[k] += float(s);
    }
  });
}

// Layers with few output pixels per sample (a ResNet's later stages: 7x7 down to 1x1 at 28x28
// input) would make one GEMM per sample a thin product (N = pq columns), far below the BLAS's
// speed. Below kBatchedPq output pixels the whole batch's columns sit side by side,
// [crr, n*pq], and each product is one GEMM split over output rows across threads: every
// element is the same sum whatever the thread count.
constexpr int64_t kBatchedPq = 64;

// Rows per GEMM call when a product is split over output rows: an eighth of them, at least 32
// (fixed by the shape, not the machine). Every call packs the whole right-hand matrix again, so
// 32-row calls on layers of 256 to 2,048 rows spent much of their time packing (conv forward
// 3-7% and backward 8-12% slower over ResNet-101 at 28x28); 64-row layers still get two calls.
int64_t row_grain(int64_t rows) { return std::max<int64_t>(32, rows / 8); }

bool use_batched(const ConvGeometry& g) { return g.pq() < kBatchedPq && g.n > 1; }

// cols[:, n*pq ...] = im2col(x_n) for every sample n.
Tensor batch_im2col(DeviceContext& ctx, const float* x, const ConvGeometry& g) {
  const int64_t ld = g.n * g.pq();
  Tensor cols = scratch(ctx, g.crr() * ld);
  float* cp = cols.f32();
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) im2col(x + n * g.c * g.h * g.w, g, cp + n * g.pq(), ld);
  });
  return cols;
}

void conv2d_forward_batched(DeviceContext& ctx, const float* x, const float* w, const float* b,
                            float* y, const ConvGeometry& g) {
  const int64_t ld = g.n * g.pq();
  Tensor cols = batch_im2col(ctx, x, g);
  Tensor out = scratch(ctx, g.k * ld);
  const float* cp = cols.f32();
  float* op = out.f32();
  cpu::parallel_range(g.k, row_grain(g.k), [&](int64_t k0, int64_t k1) {
    cpu::sgemm(false, false, k1 - k0, ld, g.crr(), 1.f, w + k0 * g.crr(), g.crr(), cp, ld, 0.f,
               op + k0 * ld, ld);
  });
  // [k, n*pq] -> y[n][k][pq], plus the bias
  cpu::parallel_range(g.n * g.k, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / g.k, k = i % g.k;
      const float* src = op + k * ld + n * g.pq();
      float* dst = y + i * g.pq();
      const float bias = b ? b[k] : 0.f;
      for (int64_t j = 0; j < g.pq(); ++j) dst[j] = b ? src[j] + bias : src[j];
    }
  });
}

void conv2d_backward_batched(DeviceContext& ctx, const float* x, const float* w,
                             const float* dy, float* dx, float* dw, const ConvGeometry& g) {
  const int64_t ld = g.n * g.pq();
  // dy[n][k][pq] -> gy[k, n*pq]
  Tensor gy_t = scratch(ctx, g.k * ld);
  float* gy = gy_t.f32();
  cpu::parallel_range(g.n * g.k, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / g.k, k = i % g.k;
      std::memcpy(gy + k * ld + n * g.pq(), dy + i * g.pq(), g.pq() * sizeof(float));
    }
  });
  Tensor cols = batch_im2col(ctx, x, g);
  float* cp = cols.f32();
  // dW[k, crr] += gy[k, n*pq] cols[crr, n*pq]^T
  cpu::parallel_range(g.k, row_grain(g.k), [&](int64_t k0, int64_t k1) {
    cpu::sgemm(false, true, k1 - k0, g.crr(), ld, 1.f, gy + k0 * ld, ld, cp, ld, 1.f,
               dw + k0 * g.crr(), g.crr());
  });
  if (!dx) return;
  // dcols[crr, n*pq] = W^T gy (into the cols buffer, whose columns are no longer needed)
  cpu::parallel_range(g.crr(), row_grain(g.crr()), [&](int64_t r0, int64_t r1) {
    cpu::sgemm(true, false, r1 - r0, ld, g.k, 1.f, w + r0, g.crr(), gy, ld, 0.f, cp + r0 * ld,
               ld);
  });
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) col2im(cp + n * g.pq(), g, dx + n * g.c * g.h * g.w, ld);
  });
}

void conv2d_forward_fp32(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                        Tensor& y, const Conv2dParams& prm) {
  const ConvGeometry g = geometry(x, w, prm);
  REPLICA_CHECK(y.numel() == g.n * g.k * g.pq(), "conv2d: output has the wrong size");
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* bp = b.defined() ? b.f32() : nullptr;
  float* yp = y.f32();
  if (use_batched(g)) return conv2d_forward_batched(ctx, xp, wp, bp, yp, g);
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    Tensor cols = g.pointwise() ? Tensor() : scratch(ctx, g.crr() * g.pq());
    for (int64_t n = n0; n < n1; ++n) {
      const float* xn = xp + n * g.c * g.h * g.w;
      float* yn = yp + n * g.k * g.pq();
      const float* src = xn;
      if (!g.pointwise()) {
        im2col(xn, g, cols.f32(), g.pq());
        src = cols.f32();
      }
      if (bp)
        for (int64_t k = 0; k < g.k; ++k) std::fill(yn + k * g.pq(), yn + (k + 1) * g.pq(), bp[k]);
      cpu::sgemm(false, false, g.k, g.pq(), g.crr(), 1.f, wp, g.crr(), src, g.pq(),
                 bp ? 1.f : 0.f, yn, g.pq());
    }
  });
}

void conv2d_backward_fp32(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                          const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                          const Conv2dParams& prm) {
  const ConvGeometry g = geometry(x, w, prm);
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* gp = dy.f32();
  if (use_batched(g)) {
    conv2d_backward_batched(ctx, xp, wp, gp, dx.defined() ? dx.f32() : nullptr, dw.f32(), g);
    conv2d_bias_grad(gp, g, db);
    return;
  }
  const int64_t wsize = g.k * g.crr();
  const int64_t chunks = std::min<int64_t>(g.n, kMaxWeightChunks);
  const int64_t per_chunk = chunks ? (g.n + chunks - 1) / chunks : 0;
  Tensor partial = scratch(ctx, chunks * wsize);
  float* pw = partial.f32();
  float* dxp = dx.defined() ? dx.f32() : nullptr;

  // Each chunk of samples: its weight-gradient partial, and each sample's input gradient.
  cpu::parallel_range(chunks, 1, [&](int64_t c0, int64_t c1) {
    Tensor cols = g.pointwise() ? Tensor() : scratch(ctx, g.crr() * g.pq());
    for (int64_t c = c0; c < c1; ++c) {
      float* pc = pw + c * wsize;
      std::fill(pc, pc + wsize, 0.f);
      for (int64_t n = c * per_chunk; n < std::min(g.n, (c + 1) * per_chunk); ++n) {
        const float* xn = xp + n * g.c * g.h * g.w;
        const float* gn = gp + n * g.k * g.pq();
        const float* src = xn;
        if (!g.pointwise()) {
          im2col(xn, g, cols.f32(), g.pq());
          src = cols.f32();
        }
        // dW[k, crr] += dY_n[k, pq] * cols[crr, pq]^T
        cpu::sgemm(false, true, g.k, g.crr(), g.pq(), 1.f, gn, g.pq(), src, g.pq(), 1.f, pc,
                   g.crr());
        if (dxp) {
          float* dxn = dxp + n * g.c * g.h * g.w;
          if (g.pointwise()) {
            cpu::sgemm(true, false, g.crr(), g.pq(), g.k, 1.f, wp, g.crr(), gn, g.pq(), 0.f, dxn,
                       g.pq());
          } else {
            // dcols = W^T dY_n, reusing the cols buffer after the weight gradient is done
            cpu::sgemm(true, false, g.crr(), g.pq(), g.k, 1.f, wp, g.crr(), gn, g.pq(), 0.f,
                       cols.f32(), g.pq());
            col2im(cols.f32(), g, dxn, g.pq());
          }
        }
      }
    }
  });
  sum_chunks_into(pw, chunks, wsize, dw.f32());
  conv2d_bias_grad(gp, g, db);
}

}  // namespace

void CpuBackend::conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                const Tensor& b, Tensor& y, const Conv2dParams& prm) {
  if (ctx.precision() != Precision::Bf16) return conv2d_forward_fp32(ctx, x, w, b, y, prm);
  const ConvGeometry g = geometry(x, w, prm);
  cpu::bf16_forward(ctx, x, w, b, y, g.pq(), [&](const Tensor& xr, const Tensor& wr, Tensor& out) {
    conv2d_forward_fp32(ctx, xr, wr, Tensor(), out, prm);
  });
}

void CpuBackend::conv2d_backward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                                 const Conv2dParams& prm, InputGrad dx_mode) {
  if (dx_mode == InputGrad::Accumulate && dx.defined()) {
    // The gradient into a buffer of its own, then added: the bits of a backward and an add.
    Tensor own = ctx.alloc(dx.shape());
    conv2d_backward(ctx, x, w, dy, own, dw, db, prm, InputGrad::Overwrite);
    add(ctx, dx, own, 1.f);
    return;
  }
  if (ctx.precision() != Precision::Bf16)
    return conv2d_backward_fp32(ctx, x, w, dy, dx, dw, db, prm);
  const Tensor dy32 = cpu::bf16_backward(
      ctx, x, w, dy, dx, dw,
      [&](const Tensor& xr, const Tensor& wr, const Tensor& dyr, Tensor& dxo, Tensor& dwo) {
        Tensor no_bias;
        conv2d_backward_fp32(ctx, xr, wr, dyr, dxo, dwo, no_bias, prm);
      });
  conv2d_bias_grad(dy32.f32(), geometry(x, w, prm), db);  // from dy's own values, as in fp32
}

}  // namespace replica
