// Convolution plans through cuDNN's graph API (conv_graph.h): the graph of one direction and
// running its plan. The graph: tensor descriptors for x, w and y (unique ids 1, 2, 3, 16-byte
// aligned), a convolution descriptor (fp32 accumulation, cross-correlation as PyTorch), the
// direction's operation and a one-operation graph. Which engine runs it: conv_engines.cu.
#include <cstdint>

#include "engine/cuda/conv_graph_desc.h"

namespace replica {

namespace {

constexpr int64_t kAlignment = 16;  // bytes; ConvGraph::aligned() checks the buffers against it
constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3;

// A tensor of logical dims (n, c, h, w), NCHW or NHWC in memory.
BackendDesc tensor(int64_t uid, int64_t n, int64_t c, int64_t h, int64_t w, bool nhwc, bool bf16) {
  BackendDesc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t dims[4] = {n, c, h, w};
  const int64_t nchw_strides[4] = {c * h * w, h * w, w, 1};
  const int64_t nhwc_strides[4] = {h * w * c, 1, w * c, c};
  const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const int64_t alignment = kAlignment;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, nhwc ? nhwc_strides : nchw_strides);
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  t.finalize("tensor descriptor");
  return t;
}

BackendDesc convolution(const ConvGraphSpec& s) {
  BackendDesc c(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t accumulate = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t dims = 2, stride[2] = {s.stride, s.stride}, pad[2] = {s.padding, s.padding};
  const int64_t dilation[2] = {1, 1};
  c.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &accumulate);
  c.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  c.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
  c.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation);
  c.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  c.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.finalize("convolution descriptor");
  return c;
}

// The direction's operation on x, w, y: (descriptor type, then attributes x, w, y, conv, alpha,
// beta, in the order of the enum's names).
BackendDesc operation(const ConvGraphSpec& s, const BackendDesc& x, const BackendDesc& w,
                      const BackendDesc& y, const BackendDesc& conv) {
  struct Names {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
  };
  static const Names kForward = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
  static const Names kData = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
  static const Names kFilter = {
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  const Names& n = s.direction == ConvDirection::Forward        ? kForward
                   : s.direction == ConvDirection::BackwardData ? kData
                                                                : kFilter;
  BackendDesc op(n.type);
  const float alpha = 1.f, beta = s.beta;  // fp32 accumulation: float scaling factors
  op.set(n.x, x);
  op.set(n.w, w);
  op.set(n.y, y);
  op.set(n.conv, conv);
  op.set(n.alpha, CUDNN_TYPE_FLOAT, 1, &alpha);
  op.set(n.beta, CUDNN_TYPE_FLOAT, 1, &beta);
  op.finalize("convolution operation");
  return op;
}

}  // namespace

ConvGraphDescs describe_conv_graph(const ConvGraphSpec& spec, cudnnHandle_t handle) {
  ConvGraphDescs d;
  d.x = tensor(kUidX, spec.N, spec.C, spec.H, spec.W, spec.nhwc, spec.bf16);
  d.w = tensor(kUidW, spec.K, spec.C, spec.R, spec.R, spec.nhwc, spec.bf16);
  d.y = tensor(kUidY, spec.N, spec.K, spec.P, spec.Q, spec.nhwc, spec.bf16);
  d.conv = convolution(spec);
  d.op = operation(spec, d.x, d.w, d.y, d.conv);
  d.graph = BackendDesc(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  if (handle) d.graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  d.graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, d.op);
  d.graph.finalize("operation graph");
  return d;
}

cudnnStatus_t execute_conv_plan(cudnnHandle_t handle, cudnnBackendDescriptor_t plan,
                                const ConvBuffers& b, void* workspace) {
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* pointers[3] = {const_cast<void*>(b.x), const_cast<void*>(b.w), const_cast<void*>(b.y)};
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  const cudnnStatus_t status = cudnnBackendExecute(handle, plan, pack.get());
  // A refused launch may leave a CUDA error set: no later kernel check may take it for its own.
  if (status != CUDNN_STATUS_SUCCESS) (void)cudaGetLastError();
  return status;
}

const char* conv_direction_name(ConvDirection d) {
  switch (d) {
    case ConvDirection::Forward: return "forward";
    case ConvDirection::BackwardData: return "backward data";
    case ConvDirection::BackwardFilter: return "backward filter";
  }
  return "?";
}

void ConvGraph::check(const ConvGraphSpec& spec) { describe_conv_graph(spec, nullptr); }

ConvGraph::~ConvGraph() {
  if (plan_) cudnnBackendDestroyDescriptor(plan_);
}

bool ConvGraph::aligned(const ConvBuffers& b) {
  for (const void* p : {b.x, b.w, b.y})
    if (reinterpret_cast<uintptr_t>(p) % kAlignment != 0) return false;
  return true;
}

void ConvGraph::run(cudnnHandle_t handle, const ConvBuffers& b, void* workspace) const {
  const cudnnStatus_t s = execute_conv_plan(handle, plan_, b, workspace);
  REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: executing a convolution plan failed: {}",
                cudnnGetErrorString(s));
}

}  // namespace replica
