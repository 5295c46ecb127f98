// Tensor: a contiguous, row-major view (shape, dtype, device) into a block from an Allocator.
// Views share the block, so a model's parameters can all be views of one flat buffer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/device.h"

namespace replica {

// BF16: bfloat16, the upper half of an fp32 number (bf16_bits/bf16_value, engine/ops.h): how
// activations and their gradients are stored in bf16 (Precision::Bf16, engine/context.h).
enum class DType { F32, I32, BF16 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "F32", "I32", "BF16" (safetensors spelling)

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

// Owns memory obtained from an Allocator; returns it to the cache when the last view dies.
struct Block {
  Allocator* owner = nullptr;
  void* ptr = nullptr;
  size_t bytes = 0;  // the allocator's block: at least the n asked for
  Block(Allocator* a, size_t n);
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
};

// A 4-D tensor's shape is always [N, C, H, W]; `channels_last` says its memory holds it NHWC
// (element (n, c, h, w) at ((n * H + h) * W + w) * C + c), as PyTorch's channels_last memory
// format: convolutions' tensor-core kernels read and write that layout, so activations kept in it
// need no transposes around each convolution (ctx.channels_last(), engine/context.h). An op that
// has no kernel for it is given NCHW copies (engine/bf16_storage.h, Backend::layouts).
class Tensor {
 public:
  Tensor() = default;  // undefined tensor (an absent optional argument)
  static Tensor empty(Allocator& alloc, const Shape& shape, DType dtype = DType::F32,
                      bool channels_last = false);

  bool defined() const { return block_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t bytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  const Device& device() const { return device_; }
  bool on_cuda() const { return device_.is_cuda() && !host_; }
  bool on_host() const { return host_; }
  bool channels_last() const { return channels_last_; }
  // Whether NCHW and NHWC lay this shape out alike (one channel, or one position per plane).
  bool layout_free() const;
  // A defined channels_last tensor whose memory NCHW would lay out otherwise.
  bool nhwc_memory() const { return defined() && channels_last_ && !layout_free(); }

  void* raw() const;
  float* f32() const;
  int32_t* i32() const;
  uint16_t* bf16() const;  // a BF16 tensor's elements, as bf16 bit patterns

  // A view of `shape` starting `offset` elements in. Must fit inside this tensor. Of a
  // channels_last tensor only where its layout is NCHW's too (layout_free); the view is NCHW.
  Tensor view(int64_t offset, const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;  // same numel; as view
  // Rows [begin, end) of the first dimension (samples: a channels_last tensor's stay so).
  Tensor slice_rows(int64_t begin, int64_t end) const;

  const std::shared_ptr<Block>& block() const { return block_; }

 private:
  std::shared_ptr<Block> block_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_;
  bool host_ = true;  // memory is host-addressable (CPU device or pinned host)
  bool channels_last_ = false;
};

}  // namespace replica
