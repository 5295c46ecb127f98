// bf16 storage. In Precision::Bf16 a model keeps its activations and their gradients in BF16
// tensors, as PyTorch's autocast does: half the bytes of F32 to write, keep for backward and
// read again. Parameters, their gradients, optimizer state, BatchNorm's statistics and the loss
// stay F32. Every op computes in fp32 and rounds what it stores in BF16 (bf16_bits, engine/
// ops.h), so where an op reads and writes decides the numbers, not which device runs it.
//
// A backend's kernel may take BF16 tensors itself (Backend::takes_bf16: loads widen, stores
// round). For the ops whose kernels do not, the layer made here runs them on F32 copies: each
// BF16 argument widened into an F32 tensor (exact), the op called, and the F32 results of its
// BF16 outputs rounded back into them (copy converts, backend_ops.inc). The same numbers as a
// kernel that rounds its stores, at the price of the copies: one mechanism that gives every op,
// on every backend, bf16 storage at once, and a kernel of its own where the copies cost too much.
//
// The same layer gives an op that has no kernel for channels_last tensors (Backend::layouts,
// engine/ops.h; engine/tensor.h) NCHW copies of them, in the same copies: one copy converts
// dtype and layout at once.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/ops.h"

namespace replica {

// What every DeviceContext puts around its backend: an op none of whose tensors is BF16, or one
// the inner backend takes BF16 for, goes straight through.
std::unique_ptr<Backend> make_bf16_storage_backend(std::unique_ptr<Backend> inner);

// How many calls the layer `ops` (a DeviceContext's ops()) has run on F32 copies so far: the
// calls with a BF16 tensor to an op its backend does not take BF16 for. Tests hold it still
// across the ops a backend says it takes BF16 for; throws if `ops` is not the layer.
int64_t calls_on_f32_copies(const Backend& ops);

// The dtype layers store activations (and so their gradients) in: BF16 in Precision::Bf16,
// else F32.
DType activation_dtype(const DeviceContext& ctx);

}  // namespace replica
