// CPU convolution: im2col + OpenBLAS SGEMM (one thread per call), parallel over samples; layers
// with few output pixels run one GEMM over the whole batch, split in blocks of its larger
// dimension. Two kinds of layer skip the columns: planes smaller than the kernel multiply their
// plane matrix (engine/conv_geometry.h), and stride-1 layers of few output channels run the
// direct convolution (engine/cpu/direct_conv.h). Weight gradients are accumulated per fixed
// chunk of samples (engine/cpu/weight_chunks.h) or in one GEMM over the batch, then summed in
// order, so the result does not depend on the number of threads.
#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/context.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/direct_conv.h"
#include "engine/cpu/im2col.h"
#include "engine/cpu/plane_matrix.h"
#include "engine/cpu/weight_chunks.h"
#include "engine/env_switch.h"
#include "engine/error.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

using cpu::ColumnLayout;
using cpu::scratch;

// The sum of a row of n floats in a fixed order that vectorises: 16 running sums (sum j takes
// elements j, j + 16, ...), added in order, then the tail. One running sum would wait on each
// add in turn: the bias gradient then took half of the CNN's first backward convolution.
float row_sum(const float* p, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += p[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; i < n; ++i) s += p[i];
  return s;
}

// db[k] += the sum of dy over samples and pixels (each sample's row in float, the rows in
// double, in sample order)
void conv2d_bias_grad(const float* gp, const ConvGeometry& g, Tensor& db) {
  if (!db.defined()) return;
  float* dbp = db.f32();
  cpu::parallel_range(g.k, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      double s = 0.0;
      for (int64_t n = 0; n < g.n; ++n) s += row_sum(gp + (n * g.k + k) * g.pq(), g.pq());
      dbp[k] += float(s);
    }
  });
}

// Layers with few output pixels per sample (a ResNet's later stages: 7x7 down to 1x1 at 28x28
// input) would make one GEMM per sample a thin product (N = pq columns), far below the BLAS's
// speed. Below kBatchedPq output pixels the whole batch's columns sit side by side,
// [crr, n*pq], and each product is one GEMM split across threads (cpu::parallel_sgemm): every
// element is the same sum whatever the thread count.
constexpr int64_t kBatchedPq = 64;

bool use_batched(const ConvGeometry& g) { return g.pq() < kBatchedPq && g.n > 1; }

// The four ways a convolution runs, picked once per call by its geometry and the switches, the
// same for its forward and backward; each is an op part of conv2d_forward and conv2d_backward,
// so replica-bench --suite ops shows under the op which way its layers went.
enum class ConvWay { PlaneMatrix, Direct, Batched, PerSample };

ConvWay conv_way(const ConvGeometry& g) {
  if (plane_matrix_pays(g) && switches::kPlaneMatrix.on()) return ConvWay::PlaneMatrix;
  if (cpu::direct_conv_pays(g) && switches::kDirectConv.on()) return ConvWay::Direct;
  return use_batched(g) ? ConvWay::Batched : ConvWay::PerSample;
}

const char* part_name(ConvWay way) {
  switch (way) {
    case ConvWay::PlaneMatrix: return cpu::kConvPlaneMatrixPart;
    case ConvWay::Direct: return cpu::kConvDirectPart;
    case ConvWay::Batched: return cpu::kConvBatchedPart;
    case ConvWay::PerSample: return cpu::kConvPerSamplePart;
  }
  return "";
}

// cols[:, n*pq ...] = im2col(x_n) for every sample n.
Tensor batch_im2col(DeviceContext& ctx, const float* x, const ConvGeometry& g,
                    const ColumnLayout& layout) {
  const int64_t ld = g.n * g.pq();
  Tensor cols = scratch(ctx, g.crr() * ld);
  float* cp = cols.f32();
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      layout.im2col(x + n * g.c * g.h * g.w, cp + n * g.pq(), ld);
  });
  return cols;
}

void conv2d_forward_batched(DeviceContext& ctx, const float* x, const float* w, const float* b,
                            float* y, const ConvGeometry& g) {
  const int64_t ld = g.n * g.pq();
  Tensor cols = batch_im2col(ctx, x, g, ColumnLayout(g));
  Tensor out = scratch(ctx, g.k * ld);
  const float* cp = cols.f32();
  float* op = out.f32();
  cpu::parallel_sgemm(false, false, g.k, ld, g.crr(), 1.f, w, g.crr(), cp, ld, 0.f, op, ld);
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
  const ColumnLayout layout(g);
  Tensor cols = batch_im2col(ctx, x, g, layout);
  float* cp = cols.f32();
  // dW[k, crr] += gy[k, n*pq] cols[crr, n*pq]^T
  cpu::parallel_sgemm(false, true, g.k, g.crr(), ld, 1.f, gy, ld, cp, ld, 1.f, dw, g.crr());
  if (!dx) return;
  // dcols[crr, n*pq] = W^T gy (into the cols buffer, whose columns are no longer needed)
  cpu::parallel_sgemm(true, false, g.crr(), ld, g.k, 1.f, w, g.crr(), gy, ld, 0.f, cp, ld);
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      layout.col2im(cp + n * g.pq(), dx + n * g.c * g.h * g.w, ld);
  });
}

// One GEMM per sample: W [k, crr] times its columns (or the input itself for pointwise
// layers) [crr, pq], onto the bias.
void conv2d_forward_per_sample(DeviceContext& ctx, const float* xp, const float* wp,
                               const float* bp, float* yp, const ConvGeometry& g) {
  const ColumnLayout layout(g);
  cpu::parallel_range(g.n, 1, [&](int64_t n0, int64_t n1) {
    Tensor cols = g.pointwise() ? Tensor() : scratch(ctx, g.crr() * g.pq());
    for (int64_t n = n0; n < n1; ++n) {
      const float* xn = xp + n * g.c * g.h * g.w;
      float* yn = yp + n * g.k * g.pq();
      const float* src = xn;
      if (!g.pointwise()) {
        layout.im2col(xn, cols.f32(), g.pq());
        src = cols.f32();
      }
      if (bp)
        for (int64_t k = 0; k < g.k; ++k) std::fill(yn + k * g.pq(), yn + (k + 1) * g.pq(), bp[k]);
      cpu::sgemm(false, false, g.k, g.pq(), g.crr(), 1.f, wp, g.crr(), src, g.pq(),
                 bp ? 1.f : 0.f, yn, g.pq());
    }
  });
}

// One GEMM per sample (im2col's columns, or the input itself for pointwise layers): dW per fixed
// chunk of samples, summed in order; dx (may be null) overwritten.
void conv2d_backward_per_sample(DeviceContext& ctx, const float* xp, const float* wp,
                                const float* gp, float* dxp, float* dw, const ConvGeometry& g) {
  const ColumnLayout layout(g);
  cpu::for_weight_chunks(ctx, g.n, g.k * g.crr(), dw, [&](int64_t first, int64_t last, float* pc) {
    Tensor cols = g.pointwise() ? Tensor() : scratch(ctx, g.crr() * g.pq());
    for (int64_t n = first; n < last; ++n) {
      const float* xn = xp + n * g.c * g.h * g.w;
      const float* gn = gp + n * g.k * g.pq();
      const float* src = xn;
      if (!g.pointwise()) {
        layout.im2col(xn, cols.f32(), g.pq());
        src = cols.f32();
      }
      // dW[k, crr] += dY_n[k, pq] * cols[crr, pq]^T
      cpu::sgemm(false, true, g.k, g.crr(), g.pq(), 1.f, gn, g.pq(), src, g.pq(), 1.f, pc,
                 g.crr());
      if (!dxp) continue;
      float* dxn = dxp + n * g.c * g.h * g.w;
      if (g.pointwise()) {
        cpu::sgemm(true, false, g.crr(), g.pq(), g.k, 1.f, wp, g.crr(), gn, g.pq(), 0.f, dxn,
                   g.pq());
      } else {
        // dcols = W^T dY_n, reusing the cols buffer after the weight gradient is done
        cpu::sgemm(true, false, g.crr(), g.pq(), g.k, 1.f, wp, g.crr(), gn, g.pq(), 0.f,
                   cols.f32(), g.pq());
        layout.col2im(cols.f32(), dxn, g.pq());
      }
    }
  });
}

void conv2d_forward_fp32(DeviceContext& ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                        Tensor& y, const Conv2dParams& prm) {
  const ConvGeometry g = conv_geometry(x, w, prm);
  REPLICA_CHECK(y.numel() == g.n * g.k * g.pq(), "conv2d: output has the wrong size");
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* bp = b.defined() ? b.f32() : nullptr;
  float* yp = y.f32();
  const ConvWay way = conv_way(g);
  op_part(ctx, part_name(way), [&] {
    switch (way) {
      case ConvWay::PlaneMatrix: return cpu::plane_matrix_forward(ctx, xp, wp, bp, yp, g);
      case ConvWay::Direct: return cpu::direct_conv_forward(ctx, xp, wp, bp, yp, g);
      case ConvWay::Batched: return conv2d_forward_batched(ctx, xp, wp, bp, yp, g);
      case ConvWay::PerSample: return conv2d_forward_per_sample(ctx, xp, wp, bp, yp, g);
    }
  });
}

void conv2d_backward_fp32(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                          const Tensor& dy, Tensor& dx, Tensor& dw, Tensor& db,
                          const Conv2dParams& prm) {
  const ConvGeometry g = conv_geometry(x, w, prm);
  const float* xp = x.f32();
  const float* wp = w.f32();
  const float* gp = dy.f32();
  float* dxp = dx.defined() ? dx.f32() : nullptr;
  float* dwp = dw.f32();
  const ConvWay way = conv_way(g);
  op_part(ctx, part_name(way), [&] {
    switch (way) {
      case ConvWay::PlaneMatrix: return cpu::plane_matrix_backward(ctx, xp, wp, gp, dxp, dwp, g);
      case ConvWay::Direct: return cpu::direct_conv_backward(ctx, xp, wp, gp, dxp, dwp, g);
      case ConvWay::Batched: return conv2d_backward_batched(ctx, xp, wp, gp, dxp, dwp, g);
      case ConvWay::PerSample: return conv2d_backward_per_sample(ctx, xp, wp, gp, dxp, dwp, g);
    }
  });
  conv2d_bias_grad(gp, g, db);
}

}  // namespace

void CpuBackend::conv2d_forward(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                const Tensor& b, Tensor& y, const Conv2dParams& prm) {
  if (ctx.precision() != Precision::Bf16) return conv2d_forward_fp32(ctx, x, w, b, y, prm);
  const ConvGeometry g = conv_geometry(x, w, prm);
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
  // From dy's own values, as in fp32.
  conv2d_bias_grad(dy32.f32(), conv_geometry(x, w, prm), db);
}

}  // namespace replica
