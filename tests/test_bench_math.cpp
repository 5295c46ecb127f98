// replica-bench's arithmetic on fixed inputs with hand-computed results: efficiency, bytes per
// step, algbw/busbw factors, the alpha-beta fit, the projection and its error, declared links,
// medians, phase times and merged rounds; and the engines' byte counts against the formulas.
#include <doctest/doctest.h>

#include <vector>

#include "bench_helpers.h"
#include "engine/error.h"
#include "parallel/engines/dp_engine.h"
#include "tools/bench/harness.h"
#include "tools/bench/link.h"
#include "tools/bench/projection.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"

using namespace replica;
using namespace replica::bench;
using doctest::Approx;
using test::kCnnParams;

TEST_CASE("speed-up and efficiency are against one device of the same mode") {
  CHECK(speedup(1800, 1000) == Approx(1.8));
  CHECK(efficiency(1800, 1000, 2) == Approx(0.9));
  CHECK(efficiency(3000, 1000, 4) == Approx(0.75));
  CHECK(efficiency(1000, 1000, 1) == Approx(1.0));
  CHECK(efficiency(5, 0, 2) == 0.0);  // no baseline: no number, not a division by zero
}

TEST_CASE("bytes per step follow the gradient size") {
  const int64_t s = 4 * kCnnParams;  // 444,400 B
  CHECK(dp_comm_bytes(kCnnParams, 1) == 0);
  CHECK(dp_comm_bytes(kCnnParams, 2) == 444400);
  CHECK(dp_comm_bytes(kCnnParams, 4) == 3 * s);
  CHECK(ddp_comm_bytes(kCnnParams, 1) == 0);
  CHECK(ddp_comm_bytes(kCnnParams, 2) == s);
  CHECK(ddp_comm_bytes(kCnnParams, 8) == s);
  CHECK(ring_wire_bytes(s, 2) == Approx(444400));
  CHECK(ring_wire_bytes(s, 4) == Approx(666600));  // 2 * 3/4 * S
}

TEST_CASE("algbw and busbw use nccl-tests' factors") {
  CHECK(bus_factor(Collective::AllReduce, 2) == Approx(1.0));
  CHECK(bus_factor(Collective::AllReduce, 4) == Approx(1.5));
  CHECK(bus_factor(Collective::AllReduce, 8) == Approx(1.75));
  CHECK(bus_factor(Collective::Reduce, 8) == 1.0);
  CHECK(bus_factor(Collective::Broadcast, 8) == 1.0);
  CHECK(algbw_gbps(444400, 1e-3) == Approx(0.4444));
  CHECK(busbw_gbps(Collective::AllReduce, 4, 444400, 1e-3) == Approx(0.6666));
  CHECK(busbw_gbps(Collective::Reduce, 4, 444400, 1e-3) == Approx(0.4444));
  CHECK(algbw_gbps(1, 0) == 0.0);
}

TEST_CASE("alpha-beta fit") {
  SUBCASE("points on a line give the line back") {
    // t = 100 us + S / (1 GB/s)
    const std::vector<double> bytes = {1e4, 1e5, 1e6};
    std::vector<double> t;
    for (double b : bytes) t.push_back(1e-4 + b / 1e9);
    const AlphaBeta f = fit_alpha_beta(bytes, t);
    CHECK(f.alpha_s == Approx(1e-4).epsilon(1e-9));
    CHECK(f.beta_bytes_per_s == Approx(1e9).epsilon(1e-9));
    CHECK(f.seconds(2e6) == Approx(2.1e-3));
  }
  SUBCASE("a negative intercept is clamped to zero latency") {
    // (1000 B, 0.5 us), (2000 B, 1.5 us): the free line has intercept -0.5 us. Through the
    // origin, weights 1/t^2: c = sum(w S t) / sum(w S^2) = (10/3 e9) / (52/9 e18) = 0.5769e-9.
    const AlphaBeta f = fit_alpha_beta({1000, 2000}, {0.5e-6, 1.5e-6});
    CHECK(f.alpha_s == 0.0);
    CHECK(f.beta_bytes_per_s == Approx(26.0 / 15.0 * 1e9));
  }
  SUBCASE("not enough information is an error") {
    CHECK_THROWS_AS(fit_alpha_beta({1000}, {1e-6}), std::invalid_argument);
    CHECK_THROWS_AS(fit_alpha_beta({1000, 1000}, {1e-6, 2e-6}), std::invalid_argument);
    CHECK_THROWS_AS(fit_alpha_beta({1000, 2000}, {1e-6, 0}), std::invalid_argument);
  }
  SUBCASE("a ring all-reduce splits into per-message latency and per-link bandwidth") {
    const AlphaBeta two = ring_alpha_beta({2e-4, 1e9}, 2);  // 2(n-1) = 2 messages, factor 1
    CHECK(two.alpha_s == Approx(1e-4));
    CHECK(two.beta_bytes_per_s == Approx(1e9));
    const AlphaBeta four = ring_alpha_beta({2e-4, 1e9}, 4);  // 6 messages, factor 1.5
    CHECK(four.alpha_s == Approx(2e-4 / 6));
    CHECK(four.beta_bytes_per_s == Approx(1.5e9));
    CHECK(ring_allreduce_seconds(four, 4, 4e6, 1) == Approx(2e-4 + 4e6 / 1e9));
  }
}

TEST_CASE("projection on fixed inputs") {
  // T1 = 10 ms, Tb = 6 ms, b = 32, S = 4 MB in K = 2 buckets, the last 1 MB: w = 0.75.
  const ComputeInputs compute{10e-3, 6e-3, 32};
  const GradientInputs grad{4e6, 2, 1e6};
  CHECK(overlappable_fraction(grad) == Approx(0.75));

  SUBCASE("DDP: ring all-reduce, partly hidden behind backward") {
    const DdpModel m{compute, grad, {50e-6, 1e9}};
    // n = 8: C = 2*2*7*50 us + (14/8) * 4 MB / 1 GB/s = 1.4 ms + 7 ms = 8.4 ms;
    // hidden = min(0.75 * 8.4, 6) = 6 ms; T = 10 + 8.4 - 6 = 12.4 ms.
    const Projected p8 = project_ddp(m, 8);
    CHECK(p8.comm_s == Approx(8.4e-3));
    CHECK(p8.hidden_s == Approx(6e-3));
    CHECK(p8.step_s == Approx(12.4e-3));
    CHECK(p8.samples_per_sec == Approx(8 * 32 / 12.4e-3));  // 20,645.2
    CHECK(p8.efficiency == Approx(10.0 / 12.4));              // 80.6%
    // n = 2: C = 0.2 + 4 = 4.2 ms, hidden 3.15 ms, T = 11.05 ms.
    CHECK(project_ddp(m, 2).step_s == Approx(11.05e-3));
    CHECK(project_ddp(m, 1).step_s == Approx(10e-3));
    CHECK(project_ddp(m, 1).efficiency == Approx(1.0));
  }
  SUBCASE("DP: reduce into and broadcast out of device 0") {
    const DpModel m{compute, grad, {1e-6, 10e9}, {2e-6, 20e9}};
    // n = 4: R = 3 (2 * 1 us + 0.4 ms) = 1.206 ms, hidden 0.75 R = 0.9045 ms,
    // B = 3 (2 us + 0.2 ms) = 0.606 ms; T = 10 + 1.206 - 0.9045 + 0.606 = 10.9075 ms.
    const Projected p4 = project_dp(m, 4);
    CHECK(p4.hidden_s == Approx(0.9045e-3));
    CHECK(p4.comm_s == Approx(1.812e-3));
    CHECK(p4.step_s == Approx(10.9075e-3));
    CHECK(p4.samples_per_sec == Approx(128 / 10.9075e-3));  // 11,735.0
    CHECK(p4.efficiency == Approx(10.0 / 10.9075));
  }
  SUBCASE("DP on separate GPUs: NCCL's reduce and broadcast pipeline along a chain") {
    DpModel m{compute, grad, {1e-6, 10e9}, {2e-6, 20e9}};
    m.pipelined = true;
    // n = 4: R = 2 * 3 * 1 us + 4 MB / 10 GB/s = 0.406 ms, hidden 0.75 R = 0.3045 ms,
    // B = 3 * 2 us + 4 MB / 20 GB/s = 0.206 ms; T = 10 + 0.406 - 0.3045 + 0.206 = 10.3075 ms.
    const Projected p4 = project_dp(m, 4);
    CHECK(p4.hidden_s == Approx(0.3045e-3));
    CHECK(p4.comm_s == Approx(0.612e-3));
    CHECK(p4.step_s == Approx(10.3075e-3));
    CHECK(project_dp(m, 1).step_s == Approx(10e-3));
  }
  CHECK(relative_error(110, 100) == Approx(0.1));
  CHECK(relative_error(90, 100) == Approx(-0.1));
}

TEST_CASE("declared links: the published figures per direction, or GB/s given by hand") {
  CHECK(parse_link("nvlink4").bytes_per_s == Approx(450e9));
  CHECK(parse_link("NVLink3").bytes_per_s == Approx(300e9));
  CHECK(parse_link("pcie4").bytes_per_s == Approx(31.5e9));
  CHECK(parse_link("pcie5").bytes_per_s == Approx(63e9));
  CHECK(parse_link("pcie5").published.find("128b/130b") != std::string::npos);
  CHECK(parse_link("25").bytes_per_s == Approx(25e9));
  CHECK(parse_link("12.5GB/s").bytes_per_s == Approx(12.5e9));
  CHECK(parse_link("12.5 GB/s").name == "12.5 GB/s");
  for (const char* bad : {"nvlink9", "0", "-3", "fast", "", "1e9", "nan", "25 MB/s"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_link(bad), UsageError);
  }
  try {
    parse_link("nvlink9");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("nvlink4") != std::string::npos);
  }
}

TEST_CASE("median of repeated measurements") {
  CHECK(median({}) == 0);
  CHECK(median({3, 1, 2}) == 2);
  CHECK(median({4, 1, 3, 2}) == Approx(2.5));
}

TEST_CASE("device counts: powers of two and the largest") {
  CHECK(device_counts_up_to(1) == std::vector<int>{1});
  CHECK(device_counts_up_to(2) == std::vector<int>{1, 2});
  CHECK(device_counts_up_to(6) == std::vector<int>{1, 2, 4, 6});
  CHECK(device_counts_up_to(8) == std::vector<int>{1, 2, 4, 8});
}

TEST_CASE("phase times count overlapping spans of one track once") {
  const std::vector<Tracer::Event> events = {
      {"cpu:0", "backward", 0, 10}, {"cpu:0", "backward", 5, 15},  // nested: 15 us
      {"cpu:1", "backward", 20, 30}, {"comm", "reduce", 8, 12}};
  const TrackPhaseMs ms = per_step_ms(events, 1);
  CHECK(ms.at("cpu:0").at("backward") == Approx(0.015));
  CHECK(ms.at("cpu:1").at("backward") == Approx(0.010));
  CHECK(ms.at("*").at("backward") == Approx(0.025));  // wall time some device was in backward
  CHECK(ms.at("comm").at("reduce") == Approx(0.004));
  CHECK(per_step_ms(events, 5).at("cpu:0").at("backward") == Approx(0.003));
}

TEST_CASE("rounds merge: windows add up, phase times average, peaks are the maximum") {
  Measurement a, b;
  a.window_seconds = {1.0};
  a.steps_per_window = b.steps_per_window = 10;
  a.track_ms["cpu:0"]["backward"] = 4.0;
  a.peak_memory = {100, 50};
  b.window_seconds = {3.0};
  b.track_ms["cpu:0"]["backward"] = 6.0;
  b.track_ms["comm"]["reduce"] = 1.0;
  b.peak_memory = {90, 70};
  Measurement total;
  merge(total, a);
  merge(total, b);
  CHECK(total.window_seconds == std::vector<double>{1.0, 3.0});
  CHECK(total.track_ms["cpu:0"]["backward"] == Approx(5.0));
  CHECK(total.track_ms["comm"]["reduce"] == Approx(0.5));  // absent in a round: 0 there
  CHECK(total.peak_memory == std::vector<size_t>{100, 70});
}

TEST_CASE("the engines count the bytes the formulas give") {
  const ModelFacts cnn = model_facts("cnn", {1, 28, 28});
  CHECK(cnn.params == kCnnParams);
  CHECK(cnn.bucket_bytes == std::vector<int64_t>{4 * kCnnParams});  // one bucket below 1 MB
  // torchvision's resnet18 with 10 classes: 11,689,512 - 513,000 + 5,130.
  const ModelFacts r18 = model_facts("resnet18", {3, 224, 224});
  CHECK(r18.params == 11181642);
  CHECK(r18.bucket_bytes.front() <= (1 << 20));
  int64_t sum = 0;
  for (int64_t b : r18.bucket_bytes) sum += b;
  CHECK(sum == 4 * r18.params);

  EngineOptions eo;
  eo.threads_per_device = 1;
  auto dp = make_dp_engine(parse_devices("cpu*2"), eo);
  const Preloaded pre = preload_batches({1, 28, 28}, 4, 0, 1, dp.get());
  CHECK_FALSE(pre.resident);  // CPU devices use host memory in place
  dp->train_step(pre.batches[0]);
  dp->synchronize();
  CHECK(dp->comm_bytes_per_step() == dp_comm_bytes(kCnnParams, 2));
}
