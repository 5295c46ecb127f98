// The column layout CPU convolutions multiply: im2col turns one sample's input into
// cols[(c*r + i)*r + j][oy*q + ox] = x[c][oy*s - pad + i][ox*s - pad + j] (0 outside the input),
// so a convolution is one GEMM with the weights [k, c*r*r]; col2im is its adjoint, summing each
// column entry back at its source pixel.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/conv_geometry.h"

namespace replica::cpu {

// How one sample's input becomes its columns and back, chosen once per convolution and shared
// by every sample: pointwise layers copy channel planes; stride-1 rows of 8+ columns go as runs;
// small outputs (a ResNet's late stages: 7x7 down to 1x1) read through a table of each kernel
// tap's source pixels; the rest (strided layers with large outputs) element by element.
// Rows of cols are `ld` floats apart: pq for one sample alone, n*pq for a batch side by side.
class ColumnLayout {
 public:
  explicit ColumnLayout(const ConvGeometry& g);
  void im2col(const float* x, float* cols, int64_t ld) const;
  void col2im(const float* cols, float* dx, int64_t ld) const;  // dx overwritten

 private:
  enum class Way { Copy, Runs, Taps, Elements };
  ConvGeometry g_;
  Way way_;
  // Taps: for kernel tap (i, j) and output pixel t, the input pixel it reads (iy*w + ix), or -1
  // where it reads padding; [r*r][pq].
  std::vector<int32_t> taps_;
};

}  // namespace replica::cpu
