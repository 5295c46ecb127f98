#include "engine/conv_geometry.h"

#include "engine/error.h"

namespace replica {

ConvGeometry conv_geometry(const Tensor& x, const Tensor& w, const Conv2dParams& prm) {
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

}  // namespace replica
