#include "engine/context.h"

#include <thread>

#include "engine/cudart.h"
#include "engine/error.h"
#include "engine/ops.h"

namespace replica {

DeviceContext::DeviceContext(Device device, ContextOptions options)
    : device_(device), options_(options) {
  if (device.is_cpu()) {
    threads_ = options.threads > 0 ? options.threads : cpu_cores();
    arena_ = std::make_unique<tbb::task_arena>(threads_);
    allocator_ = std::make_unique<Allocator>(Allocator::Kind::Host, device);
    backend_ = make_cpu_backend();
  } else {
    REPLICA_USAGE_CHECK(device.index < cuda_device_count(), "GPU {} does not exist{}",
                        device.index, cuda_backend_note());
    threads_ = 1;
    cudart::set_device(device.index);
    allocator_ = std::make_unique<Allocator>(Allocator::Kind::CudaDevice, device);
    cuda_ = std::unique_ptr<CudaState, void (*)(CudaState*)>(
        cudart::create_state(device, options.deterministic), cudart::destroy_state);
    backend_ = cudart::make_backend();
  }
}

DeviceContext::~DeviceContext() {
  if (cuda_) {
    try {
      cudart::synchronize(cuda_.get());
    } catch (...) {
    }
  }
  backend_.reset();
}

void DeviceContext::activate() const {
  if (device_.is_cuda()) cudart::set_device(device_.index);
}

StreamEvent::~StreamEvent() { cudart::event_destroy(event_); }

void StreamEvent::record(DeviceContext& ctx) {
  if (!ctx.is_cuda()) return;
  if (!event_) event_ = cudart::event_create();
  cudart::event_record(ctx.cuda(), event_);
  recorded_ = true;
}

void StreamEvent::wait(DeviceContext& other) {
  if (!other.is_cuda() || !recorded_) return;
  cudart::stream_wait_event(other.cuda(), event_);
}

void StreamEvent::host_wait() {
  if (recorded_) cudart::event_synchronize(event_);
}

void DeviceContext::synchronize() {
  if (cuda_) cudart::synchronize(cuda_.get());
}

}  // namespace replica
