// Caching allocators: blocks are kept on free lists by rounded size and handed out again, so the
// training iteration does no cudaMalloc/cudaFree (and no malloc on CPU) after its first step.
// Thread-safe: a tensor may be released on a thread other than its device's.
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/device.h"

namespace replica {

class Allocator {
 public:
  enum class Kind { Host, PinnedHost, CudaDevice };
  Allocator(Kind kind, Device device);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  void* allocate(size_t bytes);   // never returns null; throws replica::Error when out of memory
  void release(void* ptr, size_t bytes);  // back to the cache (bytes as passed to allocate)
  void empty_cache();             // return cached blocks to the system

  Kind kind() const { return kind_; }
  const Device& device() const { return device_; }
  size_t bytes_in_use() const;
  size_t peak_bytes() const;      // high-water mark of bytes_in_use
  size_t system_allocations() const;  // calls to the underlying allocator so far

  static size_t round_size(size_t bytes);

 private:
  void* system_alloc(size_t bytes);
  void system_free(void* ptr);
  void free_cached_locked();  // every cached block back to the system; mutex_ held

  Kind kind_;
  Device device_;
  mutable std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;  // rounded size -> cached blocks
  size_t in_use_ = 0, peak_ = 0, system_allocs_ = 0;
};

// Process-wide host allocators (pinned is page-locked when a GPU is present, else plain host).
Allocator& host_allocator();
Allocator& pinned_allocator();

}  // namespace replica
