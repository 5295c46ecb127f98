// The caching allocator: what a block costs, how segments are cut into blocks and merged back,
// and the peaks it reports (replica-bench's "peak dev0", compared with PyTorch's
// max_memory_allocated, and the bytes held, compared with its max_memory_reserved).
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

TEST_CASE("a segment is 2 MiB for requests under 1 MiB, else the block (on a GPU rounded to 2 MiB)") {
  const size_t mib = size_t(1) << 20;
  for (auto kind : {Allocator::Kind::Host, Allocator::Kind::PinnedHost,
                    Allocator::Kind::CudaDevice}) {
    CHECK(Allocator::segment_size(kind, 512) == 2 * mib);
    CHECK(Allocator::segment_size(kind, mib - 512) == 2 * mib);
    CHECK(Allocator::segment_size(kind, 2 * mib) == 2 * mib);
  }
  CHECK(Allocator::segment_size(Allocator::Kind::Host, mib) == mib);
  CHECK(Allocator::segment_size(Allocator::Kind::Host, 9 * mib + 512) == 9 * mib + 512);
  CHECK(Allocator::segment_size(Allocator::Kind::CudaDevice, mib) == 2 * mib);
  CHECK(Allocator::segment_size(Allocator::Kind::CudaDevice, 2 * mib + 512) == 4 * mib);
  CHECK(Allocator::segment_size(Allocator::Kind::CudaDevice, 9 * mib) == 10 * mib);
}

TEST_CASE("small requests share a segment; a freed block is handed out again") {
  Allocator a = host();
  auto x = a.allocate(1000);
  auto y = a.allocate(3000);
  CHECK(x.bytes == 1024);
  CHECK(y.bytes == 3072);
  CHECK(static_cast<char*>(y.ptr) == static_cast<char*>(x.ptr) + 1024);  // cut from one segment
  CHECK(a.system_allocations() == 1);
  CHECK(a.bytes_in_use() == 1024 + 3072);
  a.release(y);
  CHECK(a.bytes_in_use() == 1024);
  CHECK(a.peak_bytes() == 1024 + 3072);
  auto z = a.allocate(3000);  // y's place again: no system allocation
  CHECK(z.ptr == y.ptr);
  CHECK(a.system_allocations() == 1);
  a.release(x);
  a.release(z);
  CHECK(a.bytes_in_use() == 0);
  CHECK(a.peak_bytes() == 1024 + 3072);
  CHECK_THROWS_AS(a.release(z), Error);  // twice: refused, nothing corrupted
  CHECK(a.bytes_in_use() == 0);
}

TEST_CASE("a request takes the smallest free block that holds it and splits off the rest") {
  Allocator a = host();
  const size_t mib = size_t(1) << 20;
  auto big = a.allocate(8 * mib);      // a segment of 8 MiB
  auto bigger = a.allocate(10 * mib);  // and one of 10 MiB
  CHECK(a.system_allocations() == 2);
  a.release(big);
  a.release(bigger);

  // 7.5 MiB: best fit is the 8 MiB block, not the 10 MiB one; the last 0.5 MiB stays free.
  auto c = a.allocate(7 * mib + mib / 2);
  CHECK(c.ptr == big.ptr);
  CHECK(c.bytes == 7 * mib + mib / 2);
  CHECK(a.bytes_in_use() == 7 * mib + mib / 2);  // the block, not its segment

  // 6 MiB: too large for the 0.5 MiB left, so cut from the 10 MiB block: no new segment.
  auto d = a.allocate(6 * mib);
  CHECK(d.ptr == bigger.ptr);
  CHECK(a.system_allocations() == 2);

  // 10 MiB: no free block holds it (0.5 and 4 MiB are left): a new segment.
  auto e = a.allocate(10 * mib);
  CHECK(a.system_allocations() == 3);
  CHECK(a.bytes_held() == 28 * mib);
  for (auto blk : {c, d, e}) a.release(blk);
  CHECK(a.bytes_in_use() == 0);
  // Every segment merged back whole, so every one goes back to the system.
  a.empty_cache();
  CHECK(a.bytes_held() == 0);
}

TEST_CASE("a freed block merges with free neighbours; a segment goes back only when all free") {
  Allocator a = host();
  const size_t kib = 1024;
  auto p = a.allocate(64 * kib), q = a.allocate(64 * kib), r = a.allocate(64 * kib);
  CHECK(a.system_allocations() == 1);
  a.release(p);
  a.release(r);       // r merges with the free rest of the segment; q still splits them
  a.empty_cache();    // q is in use: the segment stays
  CHECK(a.bytes_held() == 2 * kib * kib);
  auto s = a.allocate(128 * kib);  // p's 64 KiB is too small: taken from r's merged block
  CHECK(s.ptr == r.ptr);
  a.release(s);
  a.release(q);       // p, q and the rest merge into one free block: the whole segment
  auto t = a.allocate(192 * kib);  // so 192 KiB fits where p began
  CHECK(t.ptr == p.ptr);
  CHECK(a.system_allocations() == 1);
  a.release(t);
  a.empty_cache();
  CHECK(a.bytes_held() == 0);
}

TEST_CASE("small requests never take pieces of a large segment") {
  Allocator a = host();
  const size_t mib = size_t(1) << 20;
  auto large = a.allocate(4 * mib);
  a.release(large);  // a free 4 MiB block, for large requests only
  auto small = a.allocate(4096);
  CHECK(a.system_allocations() == 2);
  CHECK((static_cast<char*>(small.ptr) < static_cast<char*>(large.ptr) ||
         static_cast<char*>(small.ptr) >= static_cast<char*>(large.ptr) + 4 * mib));
  CHECK(a.bytes_held() == 6 * mib);
  a.release(small);
}

TEST_CASE("bytes held are in use plus free blocks until the cache is emptied, as PyTorch's reserved") {
  Allocator a = host();
  const size_t mib = size_t(1) << 20;
  auto x = a.allocate(1000);
  CHECK(a.bytes_held() == 2 * mib);  // the small segment
  auto y = a.allocate(3 * mib);
  CHECK(a.bytes_held() == 5 * mib);  // and a 3 MiB one
  a.release(y);
  CHECK(a.bytes_in_use() == 1024);
  CHECK(a.bytes_held() == 5 * mib);  // y's segment is kept for reuse
  auto z = a.allocate(4 * mib);      // too large for it: a new segment
  CHECK(a.bytes_held() == 9 * mib);
  CHECK(a.peak_bytes() == 1024 + 4 * mib);  // y and z were never in use together
  CHECK(a.peak_held_bytes() == 9 * mib);
  a.release(z);
  a.empty_cache();  // the two large segments go back; x keeps the small one
  CHECK(a.bytes_held() == 2 * mib);
  CHECK(a.peak_held_bytes() == 9 * mib);
  a.release(x);
  CHECK(a.bytes_held() == 2 * mib);
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
