// The pieces of a convolution's graph-API plan shared by conv_graph.cu (what the graph is, and
// running a plan) and conv_engines.cu (which engine runs it). Private to engine/cuda.
#pragma once
#include <utility>

#include "engine/cuda/conv_graph.h"
#include "engine/error.h"

namespace replica {

// One backend descriptor (or none), destroyed with its owner.
class BackendDesc {
 public:
  BackendDesc() = default;
  explicit BackendDesc(cudnnBackendDescriptorType_t type) {
    REPLICA_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~BackendDesc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  BackendDesc(BackendDesc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  BackendDesc& operator=(BackendDesc&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  BackendDesc(const BackendDesc&) = delete;
  BackendDesc& operator=(const BackendDesc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  cudnnBackendDescriptor_t release() { return std::exchange(d_, nullptr); }
  // Throws naming the attribute: a rejected attribute is a bug here, not a missing engine.
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    const cudnnStatus_t s = cudnnBackendSetAttribute(d_, name, type, count, values);
    REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: setting attribute {} failed: {}",
                  int(name), cudnnGetErrorString(s));
  }
  void set(cudnnBackendAttributeName_t name, const BackendDesc& other) {
    cudnnBackendDescriptor_t d = other.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d);
  }
  void finalize(const char* what) {
    const cudnnStatus_t s = cudnnBackendFinalize(d_);
    REPLICA_CHECK(s == CUDNN_STATUS_SUCCESS, "cuDNN graph: {} not accepted: {}", what,
                  cudnnGetErrorString(s));
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// The finalized operation graph of one convolution direction and the descriptors it was made
// of (they must outlive the graph's use). Without a handle cuDNN still checks every descriptor
// (shapes, strides, types), which needs no GPU.
struct ConvGraphDescs {
  BackendDesc x, w, y, conv, op, graph;
};
ConvGraphDescs describe_conv_graph(const ConvGraphSpec& spec, cudnnHandle_t handle);

// Runs a finalized plan on a call's buffers (a variant pack made for the call).
cudnnStatus_t execute_conv_plan(cudnnHandle_t handle, cudnnBackendDescriptor_t plan,
                                const ConvBuffers& b, void* workspace);

}  // namespace replica
