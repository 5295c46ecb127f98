// The names the CUDA backend gives the parts of its ops in an op profile (engine/op_profile.h),
// the way engine/cpu/cpu_backend.h names the CPU's: host-only, so that replica-bench's op list
// and the GPU tests, which check which way a call went, read the same names the kernels time.
#pragma once

namespace replica::cuda {

// A convolution's staging: operands rounded to bf16 and/or laid out NHWC, results brought back;
// and a first layer's operands padded with zero channels to 8 and its gradients brought back
// without them (conv_padded.cu).
inline constexpr const char* kCopiesPart = "operand copies (bf16, layout)";
inline constexpr const char* kPaddingPart = "operand copies (channels padded to 8)";
// The plane matrix's own kernels: M written from the weights, its gradient folded onto them
// (conv_plane_matrix.cu); its GEMMs are the linear layer's.
inline constexpr const char* kPlaneMatrixPart = "plane matrix (built, folded)";
// BatchNorm's block per channel (norm_block.cu), where a channel's values are one slice: so a
// profile shows which way a shape took.
inline constexpr const char* kNormOneBlockPart = "batch norm, a block per channel";

}  // namespace replica::cuda
