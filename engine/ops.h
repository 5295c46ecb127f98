// Backend: the kernels one kind of device provides. Layers call ctx.ops().X(ctx, ...) and never
// know which device they run on. The ops, and what each promises, are listed once in
// engine/backend_ops.inc (tensors contiguous, row-major, NCHW for images, F32 unless said
// otherwise, on the context's device; undefined = "not wanted"; enqueued, never a host sync).
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "engine/error.h"
#include "engine/host_device.h"
#include "engine/tensor.h"

namespace replica {

class DeviceContext;

struct Conv2dParams {
  int stride = 1;
  int padding = 0;
};

// What a backward op does with the input gradient it is given: writes it, or adds to what is
// there (a residual block's first convolution adds onto the shortcut's gradient: the sum costs
// no pass of its own; on CUDA it is cuDNN's beta).
enum class InputGrad { Overwrite, Accumulate };

struct Pool2dParams {
  int kernel = 2;
  int stride = 2;
  int padding = 0;
};

struct SgdConfig {
  float lr = 0.01f, momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
};

struct AdamConfig {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
};

// The per-step numbers sgd_step and adam_step read from their `scalars` tensor (two F32 on the
// device, backend_ops.inc), computed on the host: Adam's bias corrections in double, rounded to
// float, and the step size lr / (1 - beta1^t) in float, as every backend once computed them.
using StepScalars = std::array<float, 2>;
inline StepScalars sgd_step_scalars(const SgdConfig& c, bool first_step) {
  return {c.lr, first_step ? 1.f : 0.f};
}
inline StepScalars adam_step_scalars(const AdamConfig& c, int64_t step) {
  REPLICA_CHECK(step >= 1, "adam_step: step {} must count from 1", step);
  const float bc1 = float(1.0 - std::pow(double(c.beta1), double(step)));
  const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(double(c.beta2), double(step))));
  return {c.lr / bc1, bc2_sqrt};
}

// Output size of a convolution or pooling window along one axis.
inline int64_t window_out(int64_t in, int kernel, int stride, int padding) {
  return (in + 2 * padding - kernel) / stride + 1;
}

// Each op of the list by name, for what is said of ops one by one (takes_bf16); kCount: how
// many there are.
enum class OpId {
#define REPLICA_OP(name, params, args) name,
#include "engine/backend_ops.inc"
#undef REPLICA_OP
  kCount
};

class Backend {
 public:
  virtual ~Backend() = default;
#define REPLICA_OP(name, params, args) virtual void name params = 0;
#include "engine/backend_ops.inc"
#undef REPLICA_OP
  // Whether `op` takes BF16 tensors where the list says F32 (activations and their gradients
  // in bf16: engine/bf16_storage.h). The others are given F32 copies of them, and their
  // BF16 outputs get their F32 results rounded, by the layer every context puts around its
  // backend; copy and fill take BF16 in every backend. An op that takes BF16 takes it as the
  // layers give it, in --precision bf16: the CUDA pooling, ReLU and BatchNorm kernels want an
  // op's activations and their gradients all in one dtype and refuse other mixes with an error
  // (F32 copies would have served); convolutions and linear layers stage each operand by its own.
  virtual bool takes_bf16(OpId op) const { return op == OpId::copy || op == OpId::fill; }
  // Which channels_last tensors (engine/tensor.h) `op` takes as they are. None: the layer every
  // context puts around its backend gives it NCHW copies of them and copies its results back
  // (engine/bf16_storage.h). Uniform: taken where every tensor of the call of two or more
  // dimensions has one layout (the flat kernels: an element's neighbours do not matter; a 4-D
  // tensor both layouts lay out alike fits either), else NCHW copies. Any: each tensor as it is laid out (copy, which converts layouts;
  // convolutions, which stage each operand as their kernels need it). copy must be Any on every
  // backend.
  enum class Layouts { None, Uniform, Any };
  virtual Layouts layouts(OpId op) const {
    return op == OpId::copy ? Layouts::Any : Layouts::None;
  }
};

// gather_rows' shapes, checked alike by every backend: returns the elements in one row.
inline int64_t gather_row_numel(const Tensor& dst, const Tensor& table, const Tensor& rows) {
  REPLICA_CHECK(dst.defined() && table.defined() && rows.defined(),
                "gather_rows: undefined tensor");
  REPLICA_CHECK(rows.dtype() == DType::I32 && rows.shape().size() == 1,
                "gather_rows: rows must be I32 [n], got {} {}", dtype_name(rows.dtype()),
                shape_str(rows.shape()));
  REPLICA_CHECK(dst.dtype() == table.dtype(), "gather_rows: dst is {}, table {}",
                dtype_name(dst.dtype()), dtype_name(table.dtype()));
  REPLICA_CHECK(!table.shape().empty() && !dst.shape().empty() && dst.dim(0) == rows.dim(0),
                "gather_rows: dst {} for {} rows of table {}", shape_str(dst.shape()),
                rows.dim(0), shape_str(table.shape()));
  const int64_t row = table.dim(0) ? table.numel() / table.dim(0) : 0;
  REPLICA_CHECK(dst.numel() == rows.dim(0) * row, "gather_rows: dst {} for {} rows of table {}",
                shape_str(dst.shape()), rows.dim(0), shape_str(table.shape()));
  return row;
}

std::unique_ptr<Backend> make_cpu_backend();  // the CUDA one: cudart::make_backend()

// The ReLU of every backend, PyTorch's: a value passes unless it is <= 0, so a NaN passes
// (clamp_min keeps it), and so does the gradient where the output is NaN (threshold_backward).
// A NaN made 0 hid a diverged run: its weights went NaN while its loss stayed finite. Negatives
// and -0 become +0. Batch norm's fused ReLU and its mask keep the same rule (the CPU's lanes in
// vectors: engine/cpu/norm_lanes.cpp).
REPLICA_HOST_DEVICE bool relu_passes(float v) { return !(v <= 0.f); }
REPLICA_HOST_DEVICE float relu_value(float v) { return relu_passes(v) ? v : 0.f; }

// The dropout hash shared by every backend: uniform in [0, 1) from (seed, index).
REPLICA_HOST_DEVICE float dropout_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// Where a row's label stands among its logits, 0 for the first: the logits above it, and those
// equal to it at a lower index (ties go to the lower index, as argmax's first maximum). A label
// out of [0, C) or a NaN logit has no place (INT64_MAX): never among the top k, whatever k.
// count_correct's rule on every backend.
REPLICA_HOST_DEVICE int64_t label_place(const float* row, int64_t C, int32_t label) {
  if (label < 0 || label >= C) return INT64_MAX;
  const float mine = row[label];
  if (mine != mine) return INT64_MAX;
  int64_t place = 0;
  for (int64_t j = 0; j < C; ++j) place += row[j] > mine || (j < label && row[j] == mine);
  return place;
}

// bf16 is the upper half of an fp32 number: 8 exponent bits as fp32, 7 mantissa bits. Rounded to
// nearest, ties to even, as tensor cores and PyTorch round; a NaN stays a (quiet) NaN and what is
// beyond bf16's largest finite value becomes infinity. Every backend rounds through these, so
// the CPU's bf16 products and the GPU's conversions round alike, bit for bit.
REPLICA_HOST_DEVICE uint16_t bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
REPLICA_HOST_DEVICE float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
REPLICA_HOST_DEVICE float bf16_round(float f) { return bf16_value(bf16_bits(f)); }

// Elements as tensors store them: F32 as float, BF16 as uint16_t (its bit pattern; engine/
// bf16_storage.h). Kernels of every backend compute on floats: widen() reads an element,
// narrow<T>() makes one, rounding through bf16_bits.
REPLICA_HOST_DEVICE float widen(float v) { return v; }
REPLICA_HOST_DEVICE float widen(uint16_t bits) { return bf16_value(bits); }
template <class T>
REPLICA_HOST_DEVICE T narrow(float v) {
  if constexpr (std::is_same_v<T, uint16_t>)
    return bf16_bits(v);
  else
    return v;
}

// A tensor's elements as type T (float: F32, uint16_t: BF16); null for an undefined one (an
// optional tensor: "not wanted" or "none needed").
template <class T>
T* elements(const Tensor& t) {
  if (!t.defined()) return nullptr;
  if constexpr (std::is_same_v<T, uint16_t>)
    return t.bf16();
  else
    return t.f32();
}

// Calls f(T()) with T the storage type of `dtype`: float for F32, uint16_t for BF16.
template <class F>
void with_storage(DType dtype, F&& f) {
  if (dtype == DType::BF16)
    f(uint16_t());
  else
    f(float());
}

// Whether a copy converts layouts (one side's memory NHWC, engine/tensor.h, the other's not),
// checked alike by every backend: then both are one 4-D shape, of F32 or BF16 elements (either
// way round: the conversion converts the dtype too).
inline bool copy_relayouts(const Tensor& dst, const Tensor& src) {
  if (dst.nhwc_memory() == src.nhwc_memory()) return false;
  const auto float_type = [](DType t) { return t == DType::F32 || t == DType::BF16; };
  REPLICA_CHECK(dst.shape() == src.shape() && float_type(dst.dtype()) && float_type(src.dtype()),
                "copy: {} {} into {} {} across layouts (NCHW <-> channels_last)",
                dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dst.dtype()),
                shape_str(dst.shape()));
  return true;
}

// copy between dtypes: whether it narrows (F32 into BF16) or widens (BF16 into F32); any other
// pair of dtypes is refused, by every backend alike.
inline bool copy_narrows(const Tensor& dst, const Tensor& src) {
  const bool narrows = dst.dtype() == DType::BF16 && src.dtype() == DType::F32;
  REPLICA_CHECK(narrows || (dst.dtype() == DType::F32 && src.dtype() == DType::BF16),
                "copy: {} into {} is no conversion replica makes (F32 <-> BF16)",
                dtype_name(src.dtype()), dtype_name(dst.dtype()));
  return narrows;
}

}  // namespace replica
