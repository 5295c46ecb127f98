#include "engine/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "engine/cudart.h"
#include "engine/error.h"

namespace replica {

namespace {

// MemAvailable + SwapFree from /proc/meminfo (0: unknown). Host memory is committed lazily, so a
// block the machine cannot hold is handed out and the kernel's OOM killer ends the process
// later, with no message; large host blocks are checked against it first.
size_t available_host_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0, available = 0, swap = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) available = kb;
    if (std::sscanf(line, "SwapFree: %llu kB", &kb) == 1) swap = kb;
  }
  std::fclose(f);
  return available == 0 ? 0 : size_t(available + swap) * 1024;
}

void check_host_room(size_t bytes) {
  if (bytes < (size_t(256) << 20)) return;  // small blocks: not worth reading /proc
  const size_t room = available_host_bytes();
  if (room != 0 && bytes > room)
    throw Error(fmt::format("out of host memory: a block of {:.1f} GiB is asked for and {:.1f} "
                            "GiB is available (a smaller --batch-size?)",
                            double(bytes) / (1 << 30), double(room) / (1 << 30)));
}

}  // namespace

Allocator::Allocator(Kind kind, Device device) : kind_(kind), device_(device) {}

Allocator::~Allocator() { empty_cache(); }

size_t Allocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  // Past 2^50 bytes the rounding could overflow; no machine holds that much.
  REPLICA_CHECK(bytes <= (size_t(1) << 50), "cannot allocate {} bytes: more memory than any "
                "machine has", bytes);
  return (bytes + 511) & ~size_t(511);
}

void* Allocator::system_alloc(size_t bytes) {
  void* p = nullptr;
  switch (kind_) {
    case Kind::Host:
      p = std::aligned_alloc(64, bytes);
      if (!p) throw Error(fmt::format("out of host memory allocating {} bytes", bytes));
      break;
    case Kind::PinnedHost:
      if (cuda_device_count() > 0) p = cudart::malloc_pinned(bytes);
      else p = std::aligned_alloc(64, bytes);
      if (!p) throw Error(fmt::format("out of host memory allocating {} bytes", bytes));
      break;
    case Kind::CudaDevice:
      p = cudart::malloc_device(device_.index, bytes);
      break;
  }
  ++system_allocs_;
  held_ += bytes;
  peak_held_ = std::max(peak_held_, held_);
  return p;
}

void Allocator::system_free(void* ptr) {
  switch (kind_) {
    case Kind::Host: std::free(ptr); break;
    case Kind::PinnedHost:
      if (cuda_device_count() > 0) cudart::free_pinned(ptr);
      else std::free(ptr);
      break;
    case Kind::CudaDevice: cudart::free_device(device_.index, ptr); break;
  }
}

Allocator::Allocation Allocator::allocate(size_t bytes) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  Allocation block{nullptr, size};
  // Best fit: the smallest cached block that holds the request and wastes at most 1/8 of it.
  auto it = free_.lower_bound(size);
  if (it != free_.end() && it->first - size <= size / 8) {
    block = {it->second.back(), it->first};
    it->second.pop_back();
    if (it->second.empty()) free_.erase(it);
  } else {
    // Host memory: the bytes asked for must fit (the rounded block's tail is never touched).
    auto fresh = [&] {
      if (kind_ != Kind::CudaDevice) check_host_room(bytes);
      return system_alloc(size);
    };
    try {
      block.ptr = fresh();
    } catch (const Error&) {
      // Out of memory: give the cache back and try once more before failing.
      free_cached_locked();
      block.ptr = fresh();
    }
  }
  in_use_ += block.bytes;
  peak_ = std::max(peak_, in_use_);
  return block;
}

void Allocator::release(Allocation block) {
  if (!block.ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= block.bytes;
  free_[block.bytes].push_back(block.ptr);
}

void Allocator::free_cached_locked() {
  for (auto& [size, blocks] : free_)
    for (void* b : blocks) {
      system_free(b);
      held_ -= size;
    }
  free_.clear();
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  free_cached_locked();
}

size_t Allocator::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_use_;
}
size_t Allocator::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}
size_t Allocator::bytes_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}
size_t Allocator::peak_held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_held_;
}
size_t Allocator::system_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return system_allocs_;
}

Allocator& host_allocator() {
  static Allocator a(Allocator::Kind::Host, Device{DeviceType::CPU, 0, 0});
  return a;
}
Allocator& pinned_allocator() {
  static Allocator a(Allocator::Kind::PinnedHost, Device{DeviceType::CPU, 0, 0});
  return a;
}

}  // namespace replica
