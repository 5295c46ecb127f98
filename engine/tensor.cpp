#include "engine/tensor.h"

#include "engine/error.h"

namespace replica {

size_t dtype_size(DType t) { return t == DType::BF16 ? 2 : 4; }
const char* dtype_name(DType t) {
  return t == DType::F32 ? "F32" : t == DType::I32 ? "I32" : "BF16";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Block::Block(Allocator* a, size_t n) : owner(a) {
  const Allocator::Allocation block = a->allocate(n);
  ptr = block.ptr;
  bytes = block.bytes;
}
Block::~Block() { owner->release({ptr, bytes}); }

Tensor Tensor::empty(Allocator& alloc, const Shape& shape, DType dtype, bool channels_last) {
  REPLICA_CHECK(!channels_last || shape.size() == 4,
                "a channels_last tensor is 4-D [N, C, H, W], not {}", shape_str(shape));
  // Checked before shape_numel() multiplies in int64: an overflow there is undefined.
  int64_t elements = 1;
  for (auto d : shape) {
    REPLICA_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
    REPLICA_CHECK(d == 0 || elements <= (int64_t(1) << 48) / d,
                  "a tensor of shape {} is too large to allocate", shape_str(shape));
    elements *= d;
  }
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = alloc.device();
  t.host_ = alloc.kind() != Allocator::Kind::CudaDevice;
  t.channels_last_ = channels_last;
  t.block_ = std::make_shared<Block>(&alloc, std::max<size_t>(t.bytes(), 1));
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  REPLICA_CHECK(i >= 0 && i < n, "dimension {} out of range for shape {}", i, shape_str(shape_));
  return shape_[i];
}

void* Tensor::raw() const {
  REPLICA_CHECK(defined(), "use of an undefined tensor");
  return static_cast<char*>(block_->ptr) + offset_bytes_;
}
float* Tensor::f32() const {
  REPLICA_CHECK(dtype_ == DType::F32, "tensor is {}, expected F32", dtype_name(dtype_));
  return static_cast<float*>(raw());
}
int32_t* Tensor::i32() const {
  REPLICA_CHECK(dtype_ == DType::I32, "tensor is {}, expected I32", dtype_name(dtype_));
  return static_cast<int32_t*>(raw());
}

uint16_t* Tensor::bf16() const {
  REPLICA_CHECK(dtype_ == DType::BF16, "tensor is {}, expected BF16", dtype_name(dtype_));
  return static_cast<uint16_t*>(raw());
}

bool Tensor::layout_free() const {
  return ndim() != 4 || shape_[1] == 1 || shape_[2] * shape_[3] == 1;
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  REPLICA_CHECK(defined(), "view of an undefined tensor");
  REPLICA_CHECK(!channels_last_ || layout_free(),
                "a view of a channels_last tensor {} (copy it into an NCHW one first)",
                shape_str(shape_));
  REPLICA_CHECK(offset >= 0 && offset + shape_numel(shape) <= numel(),
                "view [{}, +{}) outside a tensor of {} elements", offset, shape_numel(shape),
                numel());
  Tensor t = *this;
  t.offset_bytes_ += offset * dtype_size(dtype_);
  t.shape_ = shape;
  t.channels_last_ = false;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  REPLICA_CHECK(shape_numel(shape) == numel(), "cannot reshape {} to {}", shape_str(shape_),
                shape_str(shape));
  return view(0, shape);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  REPLICA_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
                "rows [{}, {}) outside shape {}", begin, end, shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  Tensor t = *this;  // a sample's elements are contiguous in either layout
  t.offset_bytes_ += begin * row * dtype_size(dtype_);
  t.shape_ = s;
  return t;
}

}  // namespace replica
