// CPU device contexts: every thread asked for is given, a host block larger than the memory
// is an error at once (not an OOM kill), and the op profile counts and times every call and
// every part of one while it is set.
#include <doctest/doctest.h>

#include <tbb/parallel_for.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/op_profile.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

TEST_CASE("an op profile counts and times every call while set, and none after") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  Tensor a = ctx.alloc({1 << 16}), b = ctx.alloc({1 << 16});
  OpProfile profile;
  ctx.set_op_profile(&profile);
  ctx.ops().fill(ctx, a, 1.f);
  ctx.ops().fill(ctx, b, 2.f);
  ctx.ops().add(ctx, a, b, 0.5f);
  // A gather reads only the rows it names: its destination twice (read, written), the indices.
  Tensor table = ctx.alloc({64, 1024}), dst = ctx.alloc({3, 1024});
  Tensor rows = ctx.alloc({3}, DType::I32);
  for (int i = 0; i < 3; ++i) rows.i32()[i] = 5 * i;
  ctx.ops().gather_rows(ctx, dst, table, rows);
  ctx.set_op_profile(nullptr);
  ctx.ops().add(ctx, a, b, 0.5f);
  CHECK(a.f32()[7] == 3.f);  // the profiled calls did their work
  const auto ops = profile.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops.at("fill").calls == 2);
  CHECK(ops.at("add").calls == 1);
  CHECK(ops.at("fill").seconds > 0);
  // Each call's tensor arguments, each once: fill one tensor twice, add two tensors once.
  CHECK(ops.at("fill").tensor_bytes == 2.0 * (1 << 16) * 4);
  CHECK(ops.at("add").tensor_bytes == 2.0 * (1 << 16) * 4);
  CHECK(ops.at("gather_rows").tensor_bytes == 2.0 * 3 * 1024 * 4 + 3 * 4);
}


TEST_CASE("an op's parts are timed under its key (the bf16 layer's copies); none outside one") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1, false, Precision::Bf16});
  // relu_backward has no BF16 kernel on the CPU: the storage layer runs it on F32 copies.
  Tensor y = ctx.alloc({4096}, DType::BF16), dy = ctx.alloc({4096}, DType::BF16);
  Tensor dx = ctx.alloc({4096}, DType::BF16), a = ctx.alloc({4096}), b = ctx.alloc({4096});
  ctx.ops().fill(ctx, y, 1.f);
  ctx.ops().fill(ctx, dy, 2.f);
  OpProfile profile;
  ctx.set_op_profile(&profile);
  ctx.ops().relu_backward(ctx, y, dy, dx);
  ctx.ops().add(ctx, a, b, 1.f);  // F32: no copies, no parts
  ctx.set_op_profile(nullptr);
  const auto parts = profile.parts();
  REQUIRE(parts.count("relu_backward") == 1);
  CHECK(parts.count("add") == 0);
  const OpStats copies = parts.at("relu_backward").at("F32 copies of BF16 tensors");
  CHECK(copies.calls == 2);  // the widening before the op, the rounding back after it
  CHECK(copies.seconds > 0);
  CHECK(copies.seconds <= profile.ops().at("relu_backward").seconds);
  // Outside a profiled op a part only runs its work, and hands back what it returns.
  int ran = 0;
  op_part(ctx, "alone", [&] { ++ran; });
  CHECK(ran == 1);
  CHECK(op_part(ctx, "alone", [] { return 7; }) == 7);
  CHECK(profile.parts().size() == 1);
}


TEST_CASE("a context gets every thread it asks for, more than the cores included") {
  // Two contexts of cores + 2 threads each: TBB's default limit (the cores) would lend each
  // arena fewer threads than it holds. Every one of a context's threads must join one loop at
  // once: each iteration waits until all have arrived (or gives up after 10 s), so no thread
  // can take a second iteration before every iteration has a thread of its own.
  const int threads = int(std::thread::hardware_concurrency()) + 2;
  DeviceContext a(Device{DeviceType::CPU, 0, 0}, ContextOptions{threads});
  DeviceContext b(Device{DeviceType::CPU, 1, 0}, ContextOptions{threads});
  for (DeviceContext* ctx : {&a, &b}) {
    std::atomic<int> arrived{0};
    std::atomic<bool> gave_up{false};
    ctx->run([&] {
      tbb::parallel_for(0, threads, [&](int) {
        arrived.fetch_add(1);
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (arrived.load() < threads && std::chrono::steady_clock::now() < give_up)
          std::this_thread::yield();
        if (arrived.load() < threads) gave_up = true;
      }, tbb::simple_partitioner());
    });
    CHECK_FALSE(gave_up.load());
  }
}


TEST_CASE("a host block larger than the memory available is an error at once, not an OOM kill") {
  // MemAvailable + SwapFree + 512 MiB, below MemTotal: the kernel's overcommit would hand it out
  // (the pages are only committed when touched), and touching them would bring the OOM killer.
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t value = 0, total = 0, available = 0, swap = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemTotal:") total = value * 1024;
    if (key == "MemAvailable:") available = value * 1024;
    if (key == "SwapFree:") swap = value * 1024;
  }
  const size_t ask = available + swap + (size_t(512) << 20);
  if (available == 0 || ask >= total) {
    MESSAGE("skipped: /proc/meminfo leaves no room between MemAvailable and MemTotal");
    return;
  }
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0}, ContextOptions{1});
  std::string what;
  try {
    ctx.allocator().allocate(ask);
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("out of host memory: a block of") != std::string::npos, what);
  CHECK(what.find("GiB is available") != std::string::npos);
}
