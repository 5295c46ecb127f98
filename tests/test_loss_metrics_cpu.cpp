// The loss and the accuracy counts on CPU: cross_entropy's NaN for a label out of range, and
// count_correct's top-1 ... top-K with ties and NaN ordered as a stable sort orders them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "cpu_kernel_helpers.h"
#include "engine/context.h"
#include "engine/ops.h"

using namespace replica;
using namespace test;

TEST_CASE("cross_entropy: labels out of range give a NaN loss, in range a finite one") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  Tensor logits = make(ctx, {2, 5}, 3), probs = ctx.alloc({2, 5}), loss = ctx.alloc({1});
  Tensor labels = ctx.alloc({2}, DType::I32);
  for (auto [a, b, nan] : {std::tuple<int, int, bool>{0, 4, false}, {0, 5, true}, {-1, 2, true},
                           {1000000, 1, true}}) {
    CAPTURE(a);
    CAPTURE(b);
    labels.i32()[0] = a;
    labels.i32()[1] = b;
    ctx.ops().cross_entropy_forward(ctx, logits, labels, probs, loss);
    CHECK(std::isnan(loss.f32()[0]) == nan);
    double row = 0;  // the softmax is still computed
    for (int j = 0; j < 5; ++j) row += probs.f32()[j];
    CHECK(row == doctest::Approx(1.0));
  }
}


TEST_CASE("count_correct accumulates, with ties going to the first maximum") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  // argmax per row: 1, 0 (tie 0/2 -> first), 2, 1 (tie 1/2 -> first)
  Tensor logits = make(ctx, {4, 3}, {0, 3, 1, 5, 1, 5, -2, -3, -1, 0, 7, 7});
  Tensor labels = ctx.alloc({4}, DType::I32);
  const int32_t lab[4] = {1, 2, 2, 1};  // correct: yes, no (tie picks 0), yes, yes
  std::copy(lab, lab + 4, labels.i32());
  Tensor correct = ctx.alloc({1}, DType::I32);
  correct.i32()[0] = 10;
  ctx.ops().count_correct(ctx, logits, labels, correct);
  CHECK(correct.i32()[0] == 13);
  ctx.ops().count_correct(ctx, logits, labels, correct);
  CHECK(correct.i32()[0] == 16);
}


// correct[k] counts the rows whose label is among the k+1 first of the row's classes ordered by
// logit (largest first, ties by index, NaN last); a NaN label logit or a label out of range is
// never counted. Checked against that order, with K past the number of classes.
TEST_CASE("count_correct with K counts top-1 ... top-K, as a stable sort of each row orders it") {
  DeviceContext ctx(Device{DeviceType::CPU, 0, 0});
  const int64_t N = 400, C = 6, K = 8;
  std::mt19937 rng(11);
  std::vector<float> v(N * C);
  for (auto& e : v) e = float(int(rng() % 5)) - 2.f;  // five values: many ties
  for (int i = 0; i < 40; ++i) v[rng() % v.size()] = std::nanf("");
  Tensor logits = make(ctx, {N, C}, v);
  Tensor labels = ctx.alloc({N}, DType::I32);
  for (int64_t i = 0; i < N; ++i) labels.i32()[i] = int32_t(rng() % (C + 2)) - 1;  // -1 .. C
  Tensor correct = ctx.alloc({K}, DType::I32);
  for (int64_t k = 0; k < K; ++k) correct.i32()[k] = int32_t(k);  // counts are added
  ctx.ops().count_correct(ctx, logits, labels, correct);

  std::vector<int32_t> expect(K);
  for (int64_t k = 0; k < K; ++k) expect[k] = int32_t(k);
  for (int64_t i = 0; i < N; ++i) {
    const float* row = &v[i * C];
    const int32_t y = labels.i32()[i];
    if (y < 0 || y >= C || std::isnan(row[y])) continue;
    std::vector<int64_t> order(C);
    for (int64_t j = 0; j < C; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return row[a] > row[b] || (!std::isnan(row[a]) && std::isnan(row[b]));
    });
    const int64_t place = std::find(order.begin(), order.end(), y) - order.begin();
    for (int64_t k = place; k < K; ++k) ++expect[k];
  }
  for (int64_t k = 0; k < K; ++k) {
    CAPTURE(k);
    CHECK(correct.i32()[k] == expect[k]);
  }
  // The cases are all there: hits at top-1, every countable row within the top C and none
  // after, and rows never counted.
  const auto hits = [&](int64_t k) { return expect[k] - k; };
  CHECK(hits(0) > 20);
  CHECK(hits(K - 1) == hits(C - 1));
  CHECK(hits(C - 2) < hits(C - 1));
  CHECK(hits(C - 1) < N * 4 / 5);
}
