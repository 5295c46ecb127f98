#include "engine/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "engine/cudart.h"
#include "engine/error.h"

#if defined(__SANITIZE_ADDRESS__)
#define REPLICA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REPLICA_ASAN 1
#endif
#endif
#ifndef REPLICA_ASAN
#define REPLICA_ASAN 0
#endif
#if REPLICA_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace replica {

namespace {

// Requests under kSmallRequest share segments of kSmallSegment; on a GPU larger segments are
// rounded up to it (PyTorch's kSmallSize, kSmallBuffer and kRoundLarge).
constexpr size_t kSmallRequest = size_t(1) << 20;
constexpr size_t kSmallSegment = size_t(2) << 20;

// MemAvailable + SwapFree from /proc/meminfo (0: unknown).
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
  size_t room = 0;
  if (!host_can_hold(bytes, &room))
    throw Error(fmt::format("out of host memory: a block of {:.1f} GiB is asked for and {:.1f} "
                            "GiB is available (a smaller --batch-size?)",
                            double(bytes) / (1 << 30), double(room) / (1 << 30)));
}

}  // namespace

bool host_can_hold(size_t bytes, size_t* room) {
  *room = 0;
  if (bytes < (size_t(256) << 20)) return true;  // small blocks: not worth reading /proc
  *room = available_host_bytes();
  return *room == 0 || bytes <= *room;
}

Allocator::Allocator(Kind kind, Device device) : kind_(kind), device_(device) {}

Allocator::~Allocator() { empty_cache(); }

size_t Allocator::segment_size(Kind kind, size_t block) {
  if (block < kSmallRequest) return kSmallSegment;
  // A GPU maps its memory in 2 MiB pages: the rounding is used either way, so it is held where
  // later blocks can be cut from it. Host memory is mapped in pages of 4 KiB.
  if (kind == Kind::CudaDevice) return (block + kSmallSegment - 1) / kSmallSegment * kSmallSegment;
  return block;
}

void Allocator::poison(const void* p, size_t bytes, bool on) const {
#if REPLICA_ASAN
  if (kind_ == Kind::CudaDevice) return;
  if (on) ASAN_POISON_MEMORY_REGION(p, bytes);
  else ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p, (void)bytes, (void)on;
#endif
}

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

Allocator::Block& Allocator::new_segment(size_t block_size) {
  const size_t size = segment_size(kind_, block_size);
  auto fresh = [&] {
    // Host memory: the whole segment must fit (it is committed as blocks are written).
    if (kind_ != Kind::CudaDevice) check_host_room(size);
    return static_cast<char*>(system_alloc(size));
  };
  char* ptr = nullptr;
  try {
    ptr = fresh();
  } catch (const Error&) {
    // Out of memory: give the free segments back and try once more before failing; not while
    // a step is captured into a private pool (cudaFree waits for the device, which breaks the
    // capture: it fails, and the step runs eagerly, with the whole cache to draw on).
    if (active_pool_ != 0) throw;
    free_cached_locked();
    ptr = fresh();
  }
  held_ += size;
  peak_held_ = std::max(peak_held_, held_);
  poison(ptr, size, true);
  return blocks_[ptr] =
             Block{ptr, size, block_size < kSmallRequest, true, nullptr, nullptr, active_pool_};
}

Allocator::Allocation Allocator::allocate(size_t bytes) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  // Best fit: the smallest free block of the pool in use, of the request's kind, that holds it.
  FreeBlocks& candidates = size < kSmallRequest ? free_small_ : free_large_;
  auto it = candidates.lower_bound({active_pool_, size, nullptr});
  Block* b = nullptr;
  if (it != candidates.end() && std::get<0>(*it) == active_pool_) {
    b = &blocks_.at(std::get<2>(*it));
    candidates.erase(it);
  } else {
    b = &new_segment(size);
  }
  if (b->size > size) {  // the rest (a multiple of 512 bytes) stays free, after this block
    char* rest_ptr = b->ptr + size;
    Block& rest = blocks_[rest_ptr] =
        Block{rest_ptr, b->size - size, b->small, true, b, b->next, b->pool};
    if (b->next) b->next->prev = &rest;
    b->next = &rest;
    b->size = size;
    free_set(rest).insert(key(rest));
  }
  b->free = false;
  poison(b->ptr, bytes, false);
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return {b->ptr, size};
}

void Allocator::make_free(Block& block) {
  Block* b = &block;
  b->free = true;
  poison(b->ptr, b->size, true);
  // Merge with a free neighbour: the lower block absorbs the upper one, which is forgotten.
  auto absorb = [&](Block* lower, Block* upper) {
    free_set(*lower).erase(key(*lower));
    free_set(*upper).erase(key(*upper));
    lower->size += upper->size;
    lower->next = upper->next;
    if (upper->next) upper->next->prev = lower;
    blocks_.erase(upper->ptr);
    return lower;
  };
  if (b->prev && b->prev->free) b = absorb(b->prev, b);
  if (b->next && b->next->free) b = absorb(b, b->next);
  free_set(*b).insert(key(*b));
}

void Allocator::release(Allocation allocation) {
  if (!allocation.ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(static_cast<char*>(allocation.ptr));
  REPLICA_CHECK(it != blocks_.end() && !it->second.free && it->second.size == allocation.bytes,
                "allocator: releasing {} bytes at {} that it did not hand out",
                allocation.bytes, allocation.ptr);
  in_use_ -= it->second.size;
  make_free(it->second);
}

void Allocator::free_cached_locked() {
  for (FreeBlocks* free : {&free_small_, &free_large_})
    for (auto it = free->begin(); it != free->end();) {
      Block& b = blocks_.at(std::get<2>(*it));
      // Part of a segment that has blocks in use, or of a captured step's pool (its graph may
      // still write there).
      if (b.prev || b.next || b.pool != 0) {
        ++it;
        continue;
      }
      poison(b.ptr, b.size, false);
      system_free(b.ptr);
      held_ -= b.size;
      blocks_.erase(b.ptr);
      it = free->erase(it);
    }
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  free_cached_locked();
}

int Allocator::new_pool() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ++pools_made_;
}

void Allocator::use_pool(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  REPLICA_CHECK(id >= 0 && id <= pools_made_, "allocator: no pool {}", id);
  active_pool_ = id;
}

void Allocator::close_pool(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  REPLICA_CHECK(id > 0 && id != active_pool_, "allocator: pool {} cannot be closed now", id);
  for (auto& [ptr, b] : blocks_) {
    if (b.pool != id) continue;
    if (b.free) free_set(b).erase(key(b));
    b.pool = 0;
    if (b.free) free_set(b).insert(key(b));
  }
}

size_t Allocator::read(const size_t& counter) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counter;
}
size_t Allocator::bytes_in_use() const { return read(in_use_); }
size_t Allocator::peak_bytes() const { return read(peak_); }
size_t Allocator::bytes_held() const { return read(held_); }
size_t Allocator::peak_held_bytes() const { return read(peak_held_); }
size_t Allocator::system_allocations() const { return read(system_allocs_); }

Allocator& host_allocator() {
  static Allocator a(Allocator::Kind::Host, Device{DeviceType::CPU, 0, 0});
  return a;
}
Allocator& pinned_allocator() {
  static Allocator a(Allocator::Kind::PinnedHost, Device{DeviceType::CPU, 0, 0});
  return a;
}

}  // namespace replica
