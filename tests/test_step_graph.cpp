// Steps captured once and replayed (engine/step_graph.h, CapturedStep): the allocator's private
// pools, the capture's rules (ops recorded, not run; no host sync; the context left as it was
// whichever way a capture ends), and training with captured steps ending in the bits of
// training without them: SGD with momentum, a learning rate changed every step, Adam, BatchNorm
// statistics, an epoch's short last batch in between. On CPU devices the capture records ops on
// the CPU backend, so the rules a CUDA Graph imposes are checked without a GPU;
// test_cuda_training runs the same on a GPU.
#include <doctest/doctest.h>

#include <cstring>

#include "dp_reference.h"
#include "engine/step_graph.h"
#include "layers/layers.h"
#include "parallel/engines/dp_engine.h"
#include "parallel/engines/captured_step.h"

using namespace replica;

namespace {

const Device kCpu{DeviceType::CPU, 0, 0};

float value_of(const Tensor& t) { return t.f32()[0]; }

}  // namespace

TEST_CASE("a private pool's blocks serve only that pool, and stay out of empty_cache") {
  Allocator a(Allocator::Kind::Host, kCpu);
  auto shared = a.allocate(4096);
  a.release(shared);  // a free shared block
  const int pool = a.new_pool();
  CHECK(pool > 0);
  a.use_pool(pool);
  auto mine = a.allocate(4096);
  CHECK(mine.ptr != shared.ptr);  // not the shared pool's free block
  a.release(mine);
  auto again = a.allocate(4096);
  CHECK(again.ptr == mine.ptr);  // the pool's own free block
  a.release(again);
  a.use_pool(0);
  auto other = a.allocate(4096);
  CHECK(other.ptr == shared.ptr);  // the shared pool never takes the private block
  const size_t held = a.bytes_held();
  a.empty_cache();  // the private segment is all free, but a graph may still write there
  CHECK(a.bytes_held() == held);
  a.release(other);
  a.close_pool(pool);
  a.empty_cache();
  CHECK(a.bytes_held() == 0);  // closed: its segment went back like any other
  CHECK_THROWS(a.use_pool(pool + 1));
}

TEST_CASE("a captured step records its ops, runs them only when replayed, in order") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  Tensor t = ctx.alloc({1});
  ctx.ops().fill(ctx, t, 1.f);
  Tensor made;
  StepGraph graph(ctx, [&] {
    CHECK(ctx.capturing());
    ctx.ops().scale(ctx, t, 3.f);
    made = ctx.alloc({1});
    ctx.ops().fill(ctx, made, 2.f);
    ctx.ops().add(ctx, t, made, 1.f);
  });
  CHECK(!ctx.capturing());
  CHECK(ctx.steps_captured() == 1);
  CHECK(graph.nodes() == 3);
  CHECK(value_of(t) == 1.f);  // nothing ran
  graph.replay();
  CHECK(value_of(t) == 5.f);  // 1 * 3 + 2
  graph.replay();
  CHECK(value_of(t) == 17.f);
  CHECK(value_of(made) == 2.f);
}

TEST_CASE("a capture that syncs with the host or throws leaves the context as it was") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  Tensor t = ctx.alloc({1});
  ctx.ops().fill(ctx, t, 1.f);
  CHECK_THROWS_WITH(StepGraph(ctx, [&] {
                      ctx.ops().scale(ctx, t, 3.f);
                      ctx.synchronize();
                    }),
                    doctest::Contains("a host sync inside a captured step"));
  CHECK(!ctx.capturing());
  CHECK(ctx.steps_captured() == 0);
  CHECK(value_of(t) == 1.f);  // the recorded op never ran
  ctx.ops().scale(ctx, t, 3.f);  // ops run again at once
  CHECK(value_of(t) == 3.f);
  ctx.synchronize();
  // The allocator is back on its shared pool: a block freed now is handed out again.
  auto block = ctx.allocator().allocate(1 << 12);
  ctx.allocator().release(block);
  const auto again = ctx.allocator().allocate(1 << 12);
  CHECK(again.ptr == block.ptr);
  ctx.allocator().release(again);  // else its segment outlives the allocator (a leak)
}

namespace {

// Trains two single-device engines, one capturing its steps, on the same batches; `between`
// runs on both before each step (e.g. a learning-rate schedule). Returns the captured one's
// CapturedStep counters after checking the parameters and the last loss agree bit for bit.
int64_t check_same_training(EngineOptions o, const std::vector<Batch>& batches,
                            const std::function<void(TrainEngine&, size_t)>& between = {},
                            bool dp = false) {
  o.threads_per_device = 1;
  auto eager = make_single_device_engine(kCpu, o);
  o.cuda_graphs = true;
  auto captured = dp ? make_dp_engine({kCpu}, o, DpOptions{}) : make_single_device_engine(kCpu, o);
  // An evaluation between replays, on a larger batch than training's (on a GPU its scratch
  // blocks are larger than the graph's, which must stay the graph's own).
  const Batch eval = test::make_batches(o.input_shape, 3 * batches[0].size(), 1, 21)[0];
  test::train_side_by_side(*eager, *captured, batches, eval, between, [&](size_t) {
    CHECK(eager->last_loss() == captured->last_loss());
  });
  const CapturedStep* step = captured->captured_step();
  REQUIRE(step != nullptr);
  CHECK(step->captured());
  CHECK(step->nodes() > 10);
  MESSAGE(o.model << ": " << step->nodes() << " ops recorded in a step");
  CHECK(step->replays() > 0);
  CHECK(eager->captured_step()->replays() == 0);
  CHECK(captured->mode() == (dp ? "dp" : "single"));
  const auto a = test::params_of(*eager), b = test::params_of(*captured);
  REQUIRE(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  // The model's buffers too (BatchNorm's running statistics), one flat tensor.
  const auto c = test::host_values(*eager, eager->model().flat_buffers());
  const auto d = test::host_values(*captured, captured->model().flat_buffers());
  REQUIRE(c.size() == d.size());
  // (None for the CNN: memcmp must not see their null data.)
  CHECK((c.empty() || std::memcmp(c.data(), d.data(), c.size() * sizeof(float)) == 0));
  return step->replays();
}

}  // namespace

TEST_CASE("captured steps train as eager ones: CNN, SGD with momentum, lr set every step") {
  EngineOptions o = test::sgd_options("cnn", {1, 28, 28});
  auto batches = test::make_batches({1, 28, 28}, 16, 7, 3);
  // An epoch's short last batch between replays: it runs eagerly, the graph goes on after it.
  batches.insert(batches.begin() + 4, test::make_batches({1, 28, 28}, 5, 1, 4)[0]);
  const int64_t replays = check_same_training(o, batches, [](TrainEngine& e, size_t k) {
    e.optimizer().set_lr(LrSchedule("cosine").at(0.05f, int64_t(k), 8));
  });
  CHECK(replays == 5);  // steps 3, 4, 6, 7, 8: two eager first, the short batch eager
}

TEST_CASE("the step captured is a full batch's, even when the third batch is short") {
  EngineOptions o = test::sgd_options("cnn", {1, 28, 28});
  auto batches = test::make_batches({1, 28, 28}, 16, 7, 3);
  batches.insert(batches.begin() + 2, test::make_batches({1, 28, 28}, 5, 1, 4)[0]);
  // Steps 1-2 eager, 3 the short batch eager, 4 eager (its shape had not just run), 5 captured
  // and replayed, 6-8 replayed.
  CHECK(check_same_training(o, batches) == 4);
}

TEST_CASE("captured steps train as eager ones: ResNet-18 with BatchNorm, Adam") {
  EngineOptions o = test::sgd_options("resnet18", {3, 16, 16});
  o.optimizer.name = "adam";
  o.optimizer.lr = 1e-3f;
  check_same_training(o, test::make_batches({3, 16, 16}, 4, 5, 8));
}

TEST_CASE("DP on one device captures the single-device step, with prefetched batches") {
  EngineOptions o = test::sgd_options("resnet18", {3, 16, 16});
  o.prefetch_on_cpu = true;
  const auto batches = test::make_batches({3, 16, 16}, 4, 5, 9);
  check_same_training(o, batches, {}, /*dp=*/true);
  // Every staged part was taken by its step.
  o.cuda_graphs = true;
  o.threads_per_device = 1;
  auto dp = make_dp_engine({kCpu}, o, DpOptions{});
  test::train_prefetching(*dp, test::make_batches({3, 16, 16}, 4, 4, 9));
  CHECK(dp->captured_step()->replays() == 2);
}

TEST_CASE("a step with dropout is not captured: its mask changes every step") {
  DeviceContext ctx(kCpu, ContextOptions{1});
  Dropout drop(0.5f, 7);
  Tensor x = ctx.alloc({64});
  ctx.ops().fill(ctx, x, 1.f);
  CHECK_THROWS_WITH(StepGraph(ctx, [&] { drop.forward(ctx, x); }),
                    doctest::Contains("cannot be captured"));
  CHECK(!ctx.capturing());
  drop.forward(ctx, x);  // eagerly, as before
}
