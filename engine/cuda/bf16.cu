// Staged operands of products on CUDA devices. In bf16 (Precision::Bf16) fp32 tensors are
// rounded into bf16 copies for cuDNN's and cuBLAS's bf16 tensor-core paths (fp32 accumulation),
// and their bf16 results brought into the output tensors: widened into F32 ones, or, in bf16
// storage (engine/bf16_storage.h), copied into BF16 ones. A BF16 operand needs no copy unless
// it must be transposed, and is read where it is.
// Rounding goes through bf16_bits (engine/ops.h), the function the CPU's bf16 uses, so both
// round an operand to the same bf16 number. A convolution with ctx.channels_last() has its
// copies laid out NHWC (weights KRSC) in the same pass, fp32 or bf16: a tiled transpose, read
// and written a row of 32 elements at a time. The copies live in one scratch block per call,
// which the ProductIo holds until the op has enqueued its last use. A tensor that is already
// what the product reads or writes (a BF16 activation; a channels_last one, engine/tensor.h, of
// an NHWC convolution) is used where it is: no copy, and its result written in place.
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/index_math.h"

namespace replica {

namespace {

// Elements of In (float or uint16_t: F32 or BF16) to Out: widened, then rounded if Out is BF16.
template <class In, class Out>
__global__ void convert_kernel(const In* src, Out* dst, int64_t n) {
  REPLICA_GRID_STRIDE(i, n)
    dst[i] = narrow<Out>(widen(src[i]));
}

// Groups of kVec elements (cuda::Pack: four at a time where the arrays allow, so that a BF16
// copy moves 8 bytes a load rather than 2).
template <int kVec, class In, class Out>
__global__ void unstage_flat_kernel(const In* src, Out* dst, int64_t groups, bool accumulate) {
  REPLICA_GRID_STRIDE(g, groups) {
    cuda::Pack<kVec> v;
    v.load(src, g);
    if (accumulate) {
      cuda::Pack<kVec> o;
      o.load(dst, g);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v.v[e] = o.v[e] + v.v[e];
    }
    v.store(dst, g);
  }
}

// A tensor seen as [n][c][hw] (NCHW; weights: [K][C][R*S]); its NHWC form is [n][hw][c].
struct Planes {
  int64_t n, c, hw;
};

constexpr int kTile = 32, kTileRows = 8;  // a 32x32 tile per block of 32x8 threads

// The tile loop shared by both directions: tile t covers image b, channels [c0, c0+32) and
// positions [p0, p0+32); t is split by the dividers of the tile counts (engine/cuda/
// index_math.h), since every thread of a tile works its place out for itself.
template <class Div>
struct TileDividers {
  Div by_pt, by_ct;  // position tiles per plane, channel tiles per image
};

struct TileIndex {
  int64_t b, c0, p0;
  template <class Div>
  __device__ TileIndex(const TileDividers<Div>& tiles, int64_t t) {
    using Index = typename Div::Index;
    Index pt, ct;
    const Index rest = cuda::split(tiles.by_pt, Index(t), &pt);
    b = int64_t(cuda::split(tiles.by_ct, rest, &ct));
    c0 = int64_t(ct) * kTile;
    p0 = int64_t(pt) * kTile;
  }
};

__host__ __device__ inline int64_t tile_count(const Planes& d) {
  return d.n * ((d.c + kTile - 1) / kTile) * ((d.hw + kTile - 1) / kTile);
}

// dst[b][p][c] = stage(src[b][c][p]): rows of src read along p, rows of dst written along c.
template <class In, class Out, class Div>
__global__ void stage_nhwc_kernel(const In* src, Out* dst, Planes d, TileDividers<Div> tiles) {
  __shared__ float tile[kTile][kTile + 1];  // [c - c0][p - p0]; +1: no bank conflicts
  const int tx = threadIdx.x;
  for (int64_t t = blockIdx.x; t < tile_count(d); t += gridDim.x) {
    const TileIndex at(tiles, t);
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = at.c0 + j, p = at.p0 + tx;
      if (c < d.c && p < d.hw) tile[j][tx] = widen(src[(at.b * d.c + c) * d.hw + p]);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t p = at.p0 + j, c = at.c0 + tx;
      if (p < d.hw && c < d.c) dst[(at.b * d.hw + p) * d.c + c] = narrow<Out>(tile[tx][j]);
    }
    __syncthreads();
  }
}

// dst[b][c][p] (+)= unstage(src[b][p][c]): the reverse of stage_nhwc_kernel.
template <class In, class Out, class Div>
__global__ void unstage_nhwc_kernel(const In* src, Out* dst, Planes d, TileDividers<Div> tiles,
                                    bool accumulate) {
  __shared__ float tile[kTile][kTile + 1];  // [p - p0][c - c0]
  const int tx = threadIdx.x;
  for (int64_t t = blockIdx.x; t < tile_count(d); t += gridDim.x) {
    const TileIndex at(tiles, t);
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t p = at.p0 + j, c = at.c0 + tx;
      if (p < d.hw && c < d.c) tile[j][tx] = widen(src[(at.b * d.hw + p) * d.c + c]);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = at.c0 + j, p = at.p0 + tx;
      if (c < d.c && p < d.hw) {
        Out& o = dst[(at.b * d.c + c) * d.hw + p];
        o = narrow<Out>(accumulate ? widen(o) + tile[tx][j] : tile[tx][j]);
      }
    }
    __syncthreads();
  }
}

// A tensor's planes, and whether its NHWC form is a transpose at all (one channel, or one
// position per channel, lays out alike either way).
Planes planes_of(const Tensor& t) {
  const int64_t n = t.dim(0), c = t.ndim() > 1 ? t.dim(1) : 1;
  return {n, c, n * c > 0 ? t.numel() / (n * c) : 0};
}
bool transposes(const Planes& d) { return d.c > 1 && d.hw > 1; }

unsigned tile_blocks(const Planes& d) {
  const int64_t tiles = tile_count(d), cap = int64_t(1) << 20;
  return static_cast<unsigned>(tiles < cap ? tiles : cap);
}

// Calls launch(tile dividers) for d's tiles: FastDivmod below 2^31 tiles, else WideDivmod.
template <class F>
void with_tiles(const Planes& d, F&& launch) {
  const int64_t pt = (d.hw + kTile - 1) / kTile, ct = (d.c + kTile - 1) / kTile;
  if (cuda::fast_index(tile_count(d)))
    launch(TileDividers<cuda::FastDivmod>{cuda::FastDivmod(pt), cuda::FastDivmod(ct)});
  else
    launch(TileDividers<cuda::WideDivmod>{cuda::WideDivmod(pt), cuda::WideDivmod(ct)});
}

// d's elements from src, laid out NHWC where from_nhwc, into dst, laid out NHWC where to_nhwc,
// converted from In to Out (F32 or BF16) and added onto dst where accumulate: a flat pass where
// the layouts agree (or lay d out alike), else a tiled transpose.
template <class In, class Out>
void move_elements(const In* src, bool from_nhwc, Out* dst, bool to_nhwc, const Planes& d,
                   bool accumulate, cudaStream_t stream) {
  const int64_t n = d.n * d.c * d.hw;
  if (n == 0) return;
  if (from_nhwc == to_nhwc || !transposes(d)) {
    cuda::with_width(n % 4 == 0 && cuda::aligned16({src, dst}), [&](auto width) {
      constexpr int kVec = decltype(width)::value;
      unstage_flat_kernel<kVec><<<cuda::grid_for(n / kVec), cuda::kThreads, 0, stream>>>(
          src, dst, n / kVec, accumulate);
    });
  } else if (to_nhwc) {
    // No product adds an NCHW result into a channels_last tensor (conv.cu keeps them apart).
    REPLICA_CHECK(!accumulate, "adding an NCHW result into a channels_last tensor");
    with_tiles(d, [&](auto tiles) {
      stage_nhwc_kernel<<<tile_blocks(d), dim3(kTile, kTileRows), 0, stream>>>(src, dst, d,
                                                                              tiles);
    });
  } else {
    with_tiles(d, [&](auto tiles) {
      unstage_nhwc_kernel<<<tile_blocks(d), dim3(kTile, kTileRows), 0, stream>>>(
          src, dst, d, tiles, accumulate);
    });
  }
  REPLICA_LAUNCH_CHECK();
}

// Hands out consecutive staged arrays (bf16 or fp32 elements, 256-byte aligned) of one scratch
// block; floats(n) is what one takes, copy_floats(t) what tensor t takes as an operand or a
// result. A tensor already stored and laid out as the product reads and writes (bf16 storage,
// a channels_last activation of an NHWC convolution) is used where it is and takes nothing.
class Carve {
 public:
  Carve(bool bf16, bool nhwc) : bf16_(bf16), nhwc_(nhwc) {}
  int64_t floats(int64_t n) const { return ((bf16_ ? (n + 1) / 2 : n) + 63) / 64 * 64; }
  DType dtype() const { return bf16_ ? DType::BF16 : DType::F32; }  // the staged arrays'
  bool in_place(const Tensor& t) const {
    return t.dtype() == dtype() && (t.channels_last() == nhwc_ || !transposes(planes_of(t)));
  }
  int64_t copy_floats(const Tensor& t) const { return in_place(t) ? 0 : floats(t.numel()); }
  void start(float* base) { next_ = base; }
  void* take(int64_t n) {
    void* out = next_;
    next_ += floats(n);
    return out;
  }
  const void* staged(const Tensor& t, cudaStream_t stream) {
    if (in_place(t)) return t.raw();
    void* out = take(t.numel());
    with_storage(t.dtype(), [&](auto in) {
      with_storage(dtype(), [&](auto st) {
        move_elements(elements<decltype(in)>(t), t.channels_last(),
                      static_cast<decltype(st)*>(out), nhwc_, planes_of(t), false, stream);
      });
    });
    return out;
  }
  // Where a result for `t` is written: t itself, or a staged array finish() brings into it.
  void* result(Tensor& t) { return in_place(t) ? t.raw() : take(t.numel()); }

 private:
  bool bf16_, nhwc_;
  float* next_ = nullptr;
};

}  // namespace

template <class In, class Out>
void cuda::convert_async(const In* src, Out* dst, int64_t n, cudaStream_t stream) {
  convert_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(src, dst, n);
  REPLICA_LAUNCH_CHECK();
}
template void cuda::convert_async(const float*, float*, int64_t, cudaStream_t);
template void cuda::convert_async(const float*, uint16_t*, int64_t, cudaStream_t);
template void cuda::convert_async(const uint16_t*, float*, int64_t, cudaStream_t);
template void cuda::convert_async(const uint16_t*, uint16_t*, int64_t, cudaStream_t);

void cuda::copy_relayout(Tensor& dst, const Tensor& src, cudaStream_t stream) {
  with_storage(src.dtype(), [&](auto in) {
    with_storage(dst.dtype(), [&](auto out) {
      move_elements(elements<decltype(in)>(src), src.channels_last(),
                    elements<decltype(out)>(dst), dst.channels_last(), planes_of(dst), false,
                    stream);
    });
  });
}

Tensor cuda::nchw_copy(DeviceContext& ctx, const Tensor& t) {
  Tensor out = ctx.alloc(t.shape(), t.dtype());
  copy_relayout(out, t, cuda_state(ctx).stream);
  return out;
}

void ProductIo::finish(const void* result, Tensor& out, bool accumulate,
                       cudaStream_t stream) const {
  if (result == out.raw() || out.numel() == 0) return;  // written in place
  with_storage(bf16 ? DType::BF16 : DType::F32, [&](auto st) {
    with_storage(out.dtype(), [&](auto tag) {
      move_elements(static_cast<const decltype(st)*>(result), nhwc, elements<decltype(tag)>(out),
                    out.channels_last(), planes_of(out), accumulate, stream);
    });
  });
}

ProductIo CudaBackend::forward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                  Tensor& y, bool nhwc) {
  // BF16 tensors only in bf16 (else f32() refuses them: an fp32 product cannot read them).
  const bool bf16 = ctx.precision() == Precision::Bf16;
  ProductIo io{bf16, nhwc, bf16 ? x.raw() : x.f32(), w.f32(), nullptr, bf16 ? y.raw() : y.f32()};
  if (!io.staged()) return io;
  const cudaStream_t stream = cuda_state(ctx).stream;
  Carve carve(io.bf16, io.nhwc);
  io.held = scratch(ctx, carve.copy_floats(x) + carve.copy_floats(w) + carve.copy_floats(y));
  carve.start(io.held.f32());
  io.x = carve.staged(x, stream);
  io.w = carve.staged(w, stream);
  io.y = carve.result(y);
  return io;
}

ProductIo CudaBackend::backward_io(DeviceContext& ctx, const Tensor& x, const Tensor& w,
                                   const Tensor& dy, Tensor* dx, Tensor* dw, bool nhwc,
                                   bool dx_adds) {
  const bool bf16 = ctx.precision() == Precision::Bf16;  // BF16 tensors only then, as forward
  ProductIo io{bf16, nhwc, bf16 ? x.raw() : x.f32(), w.f32(), bf16 ? dy.raw() : dy.f32()};
  io.dx = dx ? (bf16 ? dx->raw() : dx->f32()) : nullptr;
  io.dw = dw ? dw->f32() : nullptr;
  if (!io.staged() || (!dx && !dw)) return io;
  const cudaStream_t stream = cuda_state(ctx).stream;
  // dx = f(w, dy) wants w and its result, dw = g(x, dy) x and its result.
  Carve carve(io.bf16, io.nhwc);
  // A bf16 dx that the call adds onto is staged all the same and added as it is brought back:
  // the product's result is rounded to bf16, then the sum is, as PyTorch's autocast does (a bf16
  // input gradient, then autograd's bf16 add) and as the CPU's bf16 does (cpu/conv.cpp). cuDNN's
  // beta 1 would round once: other bits, and a second way to the same sum.
  const bool dx_staged = dx && io.bf16 && dx_adds;
  const int64_t for_dx =
      dx ? carve.copy_floats(w) + (dx_staged ? carve.floats(dx->numel()) : carve.copy_floats(*dx))
         : 0;
  const int64_t for_dw = dw ? carve.copy_floats(x) + carve.copy_floats(*dw) : 0;
  io.held = scratch(ctx, carve.copy_floats(dy) + for_dx + for_dw);
  carve.start(io.held.f32());
  io.dy = carve.staged(dy, stream);
  if (dx) {
    io.w = carve.staged(w, stream);
    io.dx = dx_staged ? carve.take(dx->numel()) : carve.result(*dx);
  }
  if (dw) {
    io.x = carve.staged(x, stream);
    io.dw = carve.result(*dw);
  }
  return io;
}

}  // namespace replica
