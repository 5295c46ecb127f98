// Caching allocators: memory is taken from the system in segments and cut into blocks, and freed
// blocks are kept and handed out again, so the training iteration does no cudaMalloc/cudaFree
// (and no malloc on CPU) after its first step. This is PyTorch's caching allocator's scheme:
//   - a block is the request rounded up to 512 bytes, so the bytes a step holds in use are the
//     bytes its tensors need (rounding to 1/8 of a power of two made ResNet-50's peak 12% larger);
//   - a request takes the smallest free block that holds it (best fit) and splits off the rest,
//     which stays free; a freed block merges with free neighbours of its segment;
//   - requests under 1 MiB share 2 MiB segments, so small long-lived tensors do not pin pieces
//     of the large segments; a larger request gets a segment of its own size (on a GPU rounded
//     to 2 MiB, the page size its memory is mapped in) when no free block holds it.
// Splitting lowers what the allocator holds (in use plus free blocks): when every block had a
// segment of its own, a 12 MB request could not use a free 25 MB one. ResNet-50 3x224x224 at
// batch 64 on a CPU held 6.66 GB for a peak of 5.81 GB in use; with splitting, 6.29 GB.
// Segments go back to the system only whole (empty_cache(), or when the system runs out).
// Under AddressSanitizer host blocks are poisoned while free and past the bytes asked for, so a
// kernel that reads past its tensor or a freed one is reported as with malloc.
// Private pools: a captured step (engine/step_graph.h) replays its kernels into the addresses
// it was captured with, so the blocks it used, freed or not, must not be handed to anything
// else while the graph lives. While a private pool is in use, requests are served from its own
// segments only; its blocks, freed, serve only it, and are never given back to the system; when
// the graph dies the pool is closed and its blocks join the shared one (PyTorch's graph pools).
// Thread-safe: a tensor may be released on a thread other than its device's.
#pragma once
#include <cstddef>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "engine/device.h"

namespace replica {

class Allocator {
 public:
  enum class Kind { Host, PinnedHost, CudaDevice };
  Allocator(Kind kind, Device device);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  struct Allocation {
    void* ptr;
    size_t bytes;  // the block's size: the bytes asked for rounded up to 512
  };
  // Never returns a null block; throws replica::Error when out of memory.
  Allocation allocate(size_t bytes);
  void release(Allocation block);  // back to the free blocks
  void empty_cache();              // segments with nothing in use back to the system

  // A new private pool (ids > 0; 0 is the shared pool). Requests between use_pool(id) and
  // use_pool(0) are served from it, whichever thread makes them: a device's work is enqueued
  // by one thread at a time. close_pool(id): its blocks join the shared pool, free ones at once,
  // the others when released.
  int new_pool();
  void use_pool(int id);
  void close_pool(int id);

  Kind kind() const { return kind_; }
  const Device& device() const { return device_; }
  size_t bytes_in_use() const;
  size_t peak_bytes() const;      // high-water mark of bytes_in_use
  // Bytes taken from the system and not given back: in use plus free blocks (PyTorch's
  // memory_reserved; what nvidia-smi shows of this allocator), and its high-water mark.
  size_t bytes_held() const;
  size_t peak_held_bytes() const;
  size_t system_allocations() const;  // segments taken from the system so far

  static size_t round_size(size_t bytes);     // the block a request of `bytes` gets
  // The segment a fresh block of that size is cut from.
  static size_t segment_size(Kind kind, size_t block);

 private:
  // A piece of a segment; prev and next are its neighbours in the segment (null at the ends).
  struct Block {
    char* ptr;
    size_t size;
    bool small;  // in a 2 MiB segment of small blocks
    bool free;
    Block *prev, *next;
    int pool;  // 0: shared; else the private pool whose segment this is
  };
  // (pool, size, address): a pool's blocks together, best fit first within it.
  using FreeBlocks = std::set<std::tuple<int, size_t, char*>>;

  FreeBlocks& free_set(const Block& b) { return b.small ? free_small_ : free_large_; }
  static std::tuple<int, size_t, char*> key(const Block& b) { return {b.pool, b.size, b.ptr}; }
  Block& new_segment(size_t block_size);  // throws when the system has no room
  void make_free(Block& b);               // mark free, merge with free neighbours, index
  void free_cached_locked();              // whole free segments back; mutex_ held
  void* system_alloc(size_t bytes);
  void system_free(void* ptr);
  void poison(const void* p, size_t bytes, bool on) const;  // AddressSanitizer, host kinds
  size_t read(const size_t& counter) const;                  // one of the counters, locked

  Kind kind_;
  Device device_;
  mutable std::mutex mutex_;
  std::unordered_map<char*, Block> blocks_;  // every block, by address (free and in use)
  FreeBlocks free_small_, free_large_;
  size_t in_use_ = 0, peak_ = 0, held_ = 0, peak_held_ = 0, system_allocs_ = 0;
  int active_pool_ = 0, pools_made_ = 0;
};

// Process-wide host allocators (pinned is page-locked when a GPU is present, else plain host).
Allocator& host_allocator();
Allocator& pinned_allocator();

// Whether this machine can hold `bytes` more of host memory (MemAvailable + SwapFree, from
// /proc/meminfo, put in `room`). Host memory is committed lazily, so a block the machine cannot
// hold is handed out and the kernel's OOM killer ends the process later, with no message: large
// host blocks, and what will grow as large (a sampler's order), are checked here first. Under
// 256 MiB, or where the machine does not say, the answer is yes.
bool host_can_hold(size_t bytes, size_t* room);

}  // namespace replica
