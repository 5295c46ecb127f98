// The "loader" suite: how many samples per second the input pipeline hands out, the rate a
// device's step must not outrun (beyond it, the step waits for data: `data_wait`). The Loader
// (one background thread, pinned buffers, batches prepared ahead) over the synthetic dataset of
// --input-shape, or the training split of an image folder (--data: JPEG/PNG decoding, random
// crops and flips), with the dataset's per-sample work allowed 1 thread and then each count
// of --threads (default: 1 and every core), in one run so the ratio is like with like. Nothing
// trains: every batch is taken and released at once.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <tbb/global_control.h>

#include "engine/data/dataset.h"
#include "engine/data/image_folder.h"
#include "engine/data/loader.h"
#include "engine/device.h"
#include "engine/error.h"
#include "tools/bench/options.h"
#include "tools/bench/report_math.h"
#include "tools/bench/rows.h"

namespace replica::bench {

namespace {

using Clock = std::chrono::steady_clock;

// Samples per second of `batches` batches after `warmup`, sample making limited to `threads`.
double loader_rate(const Dataset& data, int64_t batch, int64_t warmup, int64_t batches,
                   int threads, uint64_t seed) {
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, size_t(threads));
  Loader loader(data, batch, /*drop_last=*/true);
  // Orders of successive epochs, one after another, until every timed batch is covered: a
  // small image folder is read several times (the crops of epoch 0 each time: the same work).
  std::vector<int64_t> order;
  for (int64_t e = 0; int64_t(order.size()) < (warmup + batches) * batch; ++e) {
    const std::vector<int64_t> more = epoch_order(data.size(), seed, e, true);
    order.insert(order.end(), more.begin(), more.end());
  }
  loader.start_epoch(std::move(order), 0);
  for (int64_t i = 0; i < warmup; ++i) loader.next();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < batches; ++i)
    REPLICA_CHECK(loader.next() != nullptr, "loader suite: the epoch ended early");
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return double(batches * batch) / s;
}

}  // namespace

int run_loader_suite(const BenchOptions& o) {
  validate_common(o);
  REPLICA_USAGE_CHECK(!o.cudnn_benchmark,
                      "--suite loader runs no convolutions; --cudnn-benchmark is for dp, ddp and "
                      "ops on GPUs");
  REPLICA_USAGE_CHECK(o.memory_format == "auto",
                      "--suite loader runs no convolutions; --memory-format is for dp, ddp and "
                      "ops on GPUs");
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  std::vector<int64_t> threads = {1};
  if (!o.threads.empty()) threads = parse_positive_list(o.threads, ',', "--threads");
  else if (cores > 1) threads.push_back(cores);
  for (int64_t t : threads) check_cpu_threads("--threads", t);
  const int64_t warmup = o.warmup.value(), batches = o.steps.value();
  std::unique_ptr<Dataset> data;
  if (!o.data.empty()) {
    REPLICA_USAGE_CHECK(is_image_folder(o.data),
                        "--data {}: not an image folder (DIR/train/<class>/*.jpg)", o.data);
    ImageFolderOptions io;
    if (!o.input_shape.empty()) io.sample_shape = resolve_input_shape(o);
    io.seed = o.seed;
    data = open_image_folder(o.data, true, io);
  } else {
    // One epoch covers every timed batch: no epoch boundary inside a window.
    data = make_synthetic((warmup + batches) * o.batch, resolve_input_shape(o), 10, o.seed);
  }
  REPLICA_USAGE_CHECK(o.batch <= data->size(),
                      "--batch {}: the dataset has {} samples; a batch may hold at most that many",
                      o.batch, data->size());
  const Shape shape = data->sample_shape();
  const double mb_per_sample = double(shape_numel(shape)) * 4 / 1e6;
  std::printf("replica-bench: suite loader, %s, batch %lld, %lld batches after %lld, %d cores\n",
              data->describe().c_str(), (long long)o.batch, (long long)batches,
              (long long)warmup, cores);
  std::printf("%8s %12s %10s %12s %8s\n", "threads", "samples/s", "MB/s", "ms/batch", "vs 1");
  std::vector<nlohmann::json> rows;
  double base = 0;
  for (int64_t t : threads) {
    std::vector<double> runs;
    for (int r = 0; r < o.repeat.value(); ++r)
      runs.push_back(loader_rate(*data, o.batch, warmup, batches, int(t), o.seed));
    const double sps = median(runs);
    if (t == threads.front()) base = sps;
    std::printf("%8lld %12.1f %10.1f %12.2f %7.2fx\n", (long long)t, sps, sps * mb_per_sample,
                1e3 * double(o.batch) / sps, sps / base);
    rows.push_back({{"suite", "loader"}, {"dataset", o.data.empty() ? "synthetic" : o.data},
                    {"input_shape", fmt::format("{}", fmt::join(shape, "x"))},
                    {"batch", o.batch}, {"threads", t}, {"samples_per_sec", sps},
                    {"mb_per_sec", sps * mb_per_sample}, {"speedup", sps / base}});
  }
  std::printf("a device step that takes more samples/s than this waits for data (data_wait)\n");
  if (!o.json.empty()) append_rows(o.json, rows);
  return 0;
}

}  // namespace replica::bench
