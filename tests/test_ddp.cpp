// DDP across real processes under replica-launch (Gloo on CPU): collectives in closed form,
// DDP over N ranks equal to one process on the same global batch (every parameter its own
// bucket, and one bucket), identical parameters on every rank. Faults: test_ddp_faults.cpp.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "engine/context.h"
#include "job_helpers.h"
#include "parallel/comm/process_group.h"
#include "parallel/rendezvous/store.h"
#include "thread_ranks.h"

using test::kTrain;
using test::launch;
using test::run;

TEST_CASE("collectives in closed form on 2, 3 and 4 ranks") {
  if (!replica::gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  for (int n : {2, 3, 4}) {
    auto r = run(launch(n) + test::bin("replica-collectives") + " --check --timeout 60", 120);
    CAPTURE(n);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    size_t oks = 0;
    for (size_t p = r.output.find(": ok"); p != std::string::npos; p = r.output.find(": ok", p + 1))
      ++oks;
    CHECK(oks == size_t(n));
  }
}

// The bench's sums are right at every size (its speed is a measurement, not a test: see
// bench/results/2026-11-25-cpu-user-walkthrough.md).
TEST_CASE("replica-collectives --bench: every size summed right on 2 ranks") {
  if (!replica::gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  auto r = run(launch(2) + test::bin("replica-collectives") +
                   " --bench --min-bytes 1K --max-bytes 64K --iters 3 --timeout 60",
               120);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  int rows = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    long bytes = 0, floats = 0, wrong = -1;
    double us = 0, algbw = 0, busbw = 0;
    if (std::sscanf(line.c_str(), "%ld %ld %lf %lf %lf %ld", &bytes, &floats, &us, &algbw, &busbw,
                    &wrong) != 6)
      continue;
    ++rows;
    CHECK(wrong == 0);
    CHECK(algbw > 0);
  }
  CHECK(rows == 7);  // 1K, 2K, ..., 64K
}

// Gloo's algorithms count in an int: tensors longer than GroupOptions::max_piece_floats go
// through in pieces (an 8 GB all-reduce crashed rank 0 before). Pieces of 1000 floats here, so
// 4097 floats is five pieces, the last one short; as buckets (a slot, summed twice) and as
// one-off tensors, on the 2-rank ring and the 3-rank chunked ring, and broadcast alike.
TEST_CASE("Gloo collectives of a tensor longer than one piece: every value right") {
  if (!replica::gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  for (int n : {2, 3}) {
    CAPTURE(n);
    replica::TcpStoreServer server("127.0.0.1", 0);
    std::vector<int64_t> wrong(size_t(n), -1);
    std::vector<std::thread> ranks;
    for (int r = 0; r < n; ++r)
      ranks.emplace_back([&, r] {
        try {
          auto store = std::make_shared<replica::TcpStoreClient>("127.0.0.1", server.port(),
                                                                 std::chrono::seconds(30));
          replica::DeviceContext ctx(replica::Device{replica::DeviceType::CPU, r, 0});
          replica::GroupOptions o{replica::CommBackend::Gloo, r, n, store, "127.0.0.1",
                                  std::chrono::milliseconds(30000)};
          o.max_piece_floats = 1000;
          auto pg = replica::make_process_group(o, ctx);
          int64_t bad = 0;
          auto count = [&](const replica::Tensor& t, auto expect) {
            for (int64_t i = 0; i < t.numel(); ++i) bad += t.f32()[i] != expect(i);
          };
          // Rank r holds r + i at i: the sum is n*i + n(n-1)/2, so a piece summed at the wrong
          // offset shows.
          replica::Tensor bucket = ctx.alloc({4097}), once = ctx.alloc({4097});
          for (int64_t i = 0; i < 4097; ++i) bucket.f32()[i] = once.f32()[i] = float(r + i);
          const float base = float(n * (n - 1) / 2);
          pg->allreduce_sum(ctx, bucket, /*slot=*/0);
          pg->allreduce_sum(ctx, bucket, /*slot=*/0);
          pg->allreduce_sum(ctx, once);
          pg->synchronize(ctx);
          count(bucket, [&](int64_t i) { return float(n) * (float(n * i) + base); });
          count(once, [&](int64_t i) { return float(n * i) + base; });
          replica::Tensor b = ctx.alloc({2500});
          for (int64_t i = 0; i < 2500; ++i) b.f32()[i] = r == 1 ? float(i) : -1.f;
          pg->broadcast(ctx, b, /*root=*/1);
          pg->synchronize(ctx);
          count(b, [&](int64_t i) { return float(i); });
          test::finish_together(*store, n);
          wrong[size_t(r)] = bad;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());  // wrong[r] stays -1
        }
      });
    for (auto& t : ranks) t.join();
    for (int r = 0; r < n; ++r) CHECK(wrong[size_t(r)] == 0);
  }
}

TEST_CASE("a file:// rendezvous directory serves run after run: a job that ends removes its keys") {
  if (!replica::gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  test::TempDir tmp;
  const std::string job = kTrain + " --synthetic --synthetic-size 64 --batch-size 8 --quiet" +
                          " --no-eval --max-steps 2 --mode ddp --devices cpu*2" +
                          " --threads-per-device 1 --init-method file://" + tmp.str("rdzv");
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    auto r = run(job, 120);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(test::fs::is_empty(tmp.path / "rdzv"));
  }
}

TEST_CASE("DDP on N ranks equals one process on the same global batch") {
  if (!replica::gloo_available()) {
    MESSAGE("SKIPPED: this build has no Gloo");
    return;
  }
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 360, 32);  // 15 steps of 24: no sampler padding
  const std::string common = " --data " + tmp.str("data") +
                             " --model cnn --batch-size 24 --max-steps 5 --optimizer sgd"
                             " --momentum 0.9 --lr 0.05 --seed 5 --no-eval --quiet"
                             " --deterministic --threads-per-device 1";
  auto single = run(kTrain + " --mode single --devices cpu" + common + " --checkpoint " +
                    tmp.str("single"));
  REQUIRE_MESSAGE(single.exit_code == 0, single.output);
  const auto reference = test::checkpoint_params(tmp.str("single/checkpoint.safetensors"));
  for (int n : {2, 3, 4}) {
    // 0.0001 MB: every parameter its own bucket; 1000 MB: one bucket (the CNN is 0.44 MB).
    for (const char* cap : {"0.0001", "1000"}) {
      CAPTURE(n);
      CAPTURE(cap);
      const std::string dir = tmp.str(std::string("ddp") + std::to_string(n) + "-" + cap);
      // The ranks on CPU devices as the reference is: on a machine with a GPU they would
      // otherwise take it, and CPU and GPU round differently.
      auto r = run(launch(n) + kTrain + " --mode ddp --devices cpu*" + std::to_string(n) +
                       " --bucket-cap-mb " + cap + common + " --checkpoint " + dir +
                       " --metrics-json " + dir + ".json",
                   180);
      REQUIRE_MESSAGE(r.exit_code == 0, r.output);
      CHECK(test::max_relative(reference, test::checkpoint_params(dir + "/checkpoint.safetensors")) <= 1e-5);
    }
  }
  // Gradient accumulation: 2 ranks x 5 micro-batches (torch.chunk of 12: 3, 3, 3, 3 and none;
  // no_sync but on the last) is the same math, and its loss is the local batch's: the
  // micro-batches' losses weighted by their sizes.
  const std::string dir = tmp.str("ddp-accumulate");
  auto r = run(launch(2) + kTrain + " --mode ddp --devices cpu*2 --accumulate 5" + common +
                   " --checkpoint " + dir + " --metrics-json " + dir + ".json",
               180);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  CHECK(test::max_relative(reference, test::checkpoint_params(dir + "/checkpoint.safetensors")) <= 1e-5);
  const double whole = test::read_json(tmp.str("ddp2-1000.json"))["final_loss"];
  CHECK(test::read_json(dir + ".json")["final_loss"].get<double>() ==
        doctest::Approx(whole).epsilon(1e-5));
}

TEST_CASE("every rank holds identical parameters after every step") {
  if (!replica::gloo_available()) return;
  test::TempDir tmp;
  test::write_mnist_dir(tmp.path / "data", 256, 32);
  // REPLICA_DDP_CHECK_SYNC makes every rank compare its parameters bit for bit with rank 0's
  // after each step (an error, and a non-zero exit, on the first difference).
  auto r = run("env REPLICA_DDP_CHECK_SYNC=1 " + launch(3) + kTrain +
                   " --mode ddp --data " + tmp.str("data") +
                   " --batch-size 12 --max-steps 6 --optimizer adam --no-eval --quiet"
                   " --threads-per-device 1",
               180);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
}

TEST_CASE("grad-sync experiment: losses differ per rank, the all-reduced gradient is the mean") {
  if (!replica::gloo_available()) return;
  auto r = run(launch(3) + test::bin("replica-grad-sync") + " --image-size 64", 180);
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  std::vector<double> losses, locals, synced;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    int rank;
    double loss, local, after;
    if (std::sscanf(line.c_str(),
                    "rank %d: loss %lf fc.weight.grad[0][0]: local %lf, after all-reduce %lf",
                    &rank, &loss, &local, &after) == 4) {
      losses.push_back(loss);
      locals.push_back(local);
      synced.push_back(after);
    }
  }
  REQUIRE(synced.size() == 3);
  CHECK(synced[0] == synced[1]);
  CHECK(synced[1] == synced[2]);
  CHECK((losses[0] != losses[1] || losses[1] != losses[2]));
  const double mean = (locals[0] + locals[1] + locals[2]) / 3;
  CHECK(std::fabs(mean - synced[0]) <= 1e-5 + 1e-3 * std::fabs(mean));
  // Any model: the classifier's weight is the CNN's fc2 ("model has no fc.weight" before).
  r = run(launch(2) + test::bin("replica-grad-sync") + " --model cnn --image-size 32", 120);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  CHECK(r.output.find("rank 1: loss ") != std::string::npos);
  CHECK(r.output.find("fc2.weight.grad[0][0]: local ") != std::string::npos);
  // A rank's batch is drawn from its share of the data set (3 of 6 images with 2 ranks): one
  // past it is refused before anything is allocated, not cut to the share without a word.
  const std::string small = " --model cnn --image-size 32 --dataset-size 6 --batch-per-rank ";
  r = run(launch(2) + test::bin("replica-grad-sync") + small + "3", 120);
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  r = run(launch(2) + test::bin("replica-grad-sync") + small + "4", 120);
  CHECK(r.exit_code == 2);
  CHECK(r.output == "replica-grad-sync: error: --batch-per-rank 4: a rank draws its batch from "
                    "its share of the --dataset-size 6 images, 3 with 2 ranks; give at most 3, "
                    "or a larger --dataset-size [every rank]\n");
  // A per-rank batch too small for BatchNorm is the user's to change: one line, no source line.
  r = run(launch(2) + test::bin("replica-grad-sync") + " --batch-per-rank 1 --image-size 32", 120);
  CHECK(r.exit_code != 0);
  CHECK(r.output.find("needs more than one value per channel") != std::string::npos);
  CHECK(r.output.find(".cpp:") == std::string::npos);
}
