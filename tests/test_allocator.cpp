// The caching allocator: what a block costs, when a cached block is handed out again, and the
// peaks it reports (replica-bench's "peak dev0", compared with PyTorch's max_memory_allocated,
// and the bytes held, compared with its max_memory_reserved).
#include <doctest/doctest.h>

#include "engine/allocator.h"
#include "engine/error.h"
#include "engine/tensor.h"

using namespace replica;

namespace {
Allocator host() { return Allocator(Allocator::Kind::Host, Device{DeviceType::CPU, 0, 0}); }
}  // namespace

TEST_CASE("a block is the request rounded up to 512 bytes, as PyTorch's allocator rounds") {
  CHECK(Allocator::round_size(0) == 512);
  CHECK(Allocator::round_size(1) == 512);
  CHECK(Allocator::round_size(512) == 512);
  CHECK(Allocator::round_size(513) == 1024);
  // A ResNet-50 stem activation at batch 64: 64x64x112x112 floats, a multiple of 512 already.
  CHECK(Allocator::round_size(size_t(64) * 64 * 112 * 112 * 4) == size_t(64) * 64 * 112 * 112 * 4);
  CHECK(Allocator::round_size(1000001) == 1000448);
  CHECK_THROWS_AS(Allocator::round_size(size_t(1) << 51), Error);
}

TEST_CASE("bytes in use and the peak count blocks, and a released block goes back to the cache") {
  Allocator a = host();
  auto x = a.allocate(1000);
  auto y = a.allocate(3000);
  CHECK(x.bytes == 1024);
  CHECK(y.bytes == 3072);
  CHECK(a.bytes_in_use() == 1024 + 3072);
  a.release(y);
  CHECK(a.bytes_in_use() == 1024);
  CHECK(a.peak_bytes() == 1024 + 3072);
  auto z = a.allocate(3000);  // the cached block again: no system allocation
  CHECK(z.ptr == y.ptr);
  CHECK(a.system_allocations() == 2);
  a.release(x);
  a.release(z);
  CHECK(a.bytes_in_use() == 0);
  CHECK(a.peak_bytes() == 1024 + 3072);
}

TEST_CASE("bytes held are in use plus cached until the cache is emptied, as PyTorch's reserved") {
  Allocator a = host();
  auto x = a.allocate(1000);
  auto y = a.allocate(3000);
  CHECK(a.bytes_held() == 1024 + 3072);
  a.release(y);
  CHECK(a.bytes_in_use() == 1024);
  CHECK(a.bytes_held() == 1024 + 3072);  // y's block is cached, still taken from the system
  auto z = a.allocate(8000);             // too large for y's block: a fresh one
  CHECK(a.bytes_held() == 1024 + 3072 + 8192);
  CHECK(a.peak_bytes() == 1024 + 8192);  // never all three in use at once
  CHECK(a.peak_held_bytes() == 1024 + 3072 + 8192);
  a.release(z);
  a.empty_cache();                       // y's and z's blocks go back; x is still in use
  CHECK(a.bytes_held() == 1024);
  CHECK(a.peak_held_bytes() == 1024 + 3072 + 8192);
  a.release(x);
  CHECK(a.bytes_held() == 1024);
}

TEST_CASE("a request takes the smallest cached block that fits and wastes at most 1/8 of it") {
  Allocator a = host();
  const size_t mb = size_t(1) << 20;
  auto big = a.allocate(8 * mb);
  auto bigger = a.allocate(9 * mb);
  a.release(big);
  a.release(bigger);
  const size_t allocs = a.system_allocations();

  // 7.5 MB: the 8 MB block wastes 1/15 of the request; best fit takes it, not the 9 MB one.
  auto c = a.allocate(7 * mb + mb / 2);
  CHECK(c.ptr == big.ptr);
  CHECK(c.bytes == 8 * mb);
  CHECK(a.bytes_in_use() == 8 * mb);  // the whole block is in use
  CHECK(a.system_allocations() == allocs);

  // 6 MB: the 9 MB block would waste half of it, so a fresh block of 6 MB is made.
  auto d = a.allocate(6 * mb);
  CHECK(d.ptr != bigger.ptr);
  CHECK(d.bytes == 6 * mb);
  CHECK(a.system_allocations() == allocs + 1);

  // A larger request never takes a smaller block.
  auto e = a.allocate(10 * mb);
  CHECK(e.bytes == 10 * mb);
  CHECK(a.system_allocations() == allocs + 2);
  for (auto blk : {c, d, e}) a.release(blk);
  CHECK(a.bytes_in_use() == 0);
}

TEST_CASE("a tensor's block holds its bytes and goes back to its allocator when the last copy goes") {
  Allocator a = host();
  {
    Tensor t = Tensor::empty(a, {3, 5});  // 60 bytes
    CHECK(a.bytes_in_use() == 512);
    Tensor u = t;
    t = Tensor();
    CHECK(a.bytes_in_use() == 512);
    u.f32()[14] = 1.f;  // the last element is inside the block
  }
  CHECK(a.bytes_in_use() == 0);
  Tensor again = Tensor::empty(a, {15});
  CHECK(a.system_allocations() == 1);
}
