// replica-sampler: prints what DistributedSampler gives each rank, to see padding, drop_last and
// set_epoch at work (the seed article's DistributedSampler experiment; docs/labs/).
//   replica-sampler --size 10 --replicas 2 --batch-size 4     rank tables with their batches
//   replica-sampler --size 5 --replicas 2 --json              {"0": [...], "1": [...]}
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/program.h"
#include <fmt/format.h>

#include "engine/data/dataset.h"
#include "engine/error.h"
#include "parallel/loop/distributed_sampler.h"

using namespace replica;

namespace {

// Big enough for any lab or real data set index listing; keeps a typo from allocating gigabytes.
constexpr int64_t kMaxSize = 100'000'000;
constexpr int kMaxReplicas = 1 << 20;

constexpr const char* kFooter = R"(
Two different drop_last flags (PyTorch has both, and they are easy to confuse):
  --drop-last          DistributedSampler(drop_last=True): when size % replicas != 0, drop the
                       tail of the order instead of padding it. Changes nothing when the size
                       divides evenly (e.g. size 6 or 10 with 2 replicas).
  --loader-drop-last   DataLoader(drop_last=True): each rank drops its own last partial batch.

The seed article's experiment (2 processes, batch 4):
  no sampler, size 8         each process reads everything: --size 8 --replicas 1 --no-shuffle
  size 8, no set_epoch       --size 8 --replicas 2 --batch-size 4 (the same for every epoch)
  size 8, set_epoch(e)       add --epoch e: a new split every epoch
  size 6                     3 per rank, one batch of 3 each; with --loader-drop-last: nothing
  size 5                     padded to 6: the first index of the order is read twice
  size 10                    5 per rank, batches of 4 and 1 (a batch of 1 breaks BatchNorm);
                             with --loader-drop-last only the batches of 4 remain
Orders come from replica's own portable generator, not torch.randperm: the numbers differ from
PyTorch's with the same seed, the structure (padding, truncation, rank::replicas) is the same.
)";

std::string list(const std::vector<int64_t>& v, size_t begin, size_t end) {
  std::string s = "[";
  for (size_t i = begin; i < end; ++i) s += (i > begin ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
std::string list(const std::vector<int64_t>& v) { return list(v, 0, v.size()); }

// Rank r's indices: global_indices()[r::R], which is what DistributedSampler::indices() returns
// for rank r (computing the order once instead of once per rank; the test checks they agree).
std::vector<int64_t> share(const std::vector<int64_t>& all, int r, int replicas) {
  std::vector<int64_t> mine;
  for (size_t i = size_t(r); i < all.size(); i += size_t(replicas)) mine.push_back(all[i]);
  return mine;
}

void print_json(const SamplerOptions& base, int64_t epoch) {
  std::string out = "{";
  DistributedSampler s(base);
  s.set_epoch(epoch);
  const std::vector<int64_t> all = s.global_indices();
  for (int r = 0; r < base.num_replicas; ++r)
    out += fmt::format("{}\"{}\": {}", r ? ", " : "", r, list(share(all, r, base.num_replicas)));
  std::printf("%s}\n", out.c_str());
}

void print_table(const SamplerOptions& base, int64_t epoch, int64_t batch_size,
                 bool loader_drop_last) {
  DistributedSampler first(base);
  first.set_epoch(epoch);
  const int64_t n = base.dataset_size, total = first.total_size();
  std::printf("DistributedSampler: size %lld, replicas %d, epoch %lld, seed %llu, shuffle %s, "
              "drop_last %s\n",
              (long long)n, base.num_replicas, (long long)epoch, (unsigned long long)base.seed,
              base.shuffle ? "on" : "off", base.drop_last ? "on" : "off");
  std::printf("num_samples %lld per rank, total_size %lld\n", (long long)first.num_samples(),
              (long long)total);
  const std::vector<int64_t> all = first.global_indices();
  if (total > n) {
    std::printf("order:  %s\n", list(all, 0, size_t(n)).c_str());
    std::printf("padded: %s  (+%lld repeated from the start of the order)\n", list(all).c_str(),
                (long long)(total - n));
  } else if (total < n) {
    const std::vector<int64_t> order = epoch_order(n, base.seed, epoch, base.shuffle);
    std::printf("order:  %s\n", list(order).c_str());
    std::printf("kept:   %s  (drop_last: %s, the last %lld of the order, read by no rank)\n",
                list(all).c_str(), list(order, size_t(total), order.size()).c_str(),
                (long long)(n - total));
  } else {
    std::printf("order:  %s\n", list(all).c_str());
  }
  if (batch_size > 0)
    std::printf("loader: batch size %lld per rank, DataLoader drop_last %s\n",
                (long long)batch_size, loader_drop_last ? "on" : "off");
  for (int r = 0; r < base.num_replicas; ++r) {
    const std::vector<int64_t> mine = share(all, r, base.num_replicas);
    std::printf("rank %d: %s\n", r, list(mine).c_str());
    if (batch_size <= 0) continue;
    std::string batches;
    int64_t kept = 0;
    for (size_t b = 0; b < mine.size(); b += size_t(batch_size)) {
      const size_t e = std::min(mine.size(), b + size_t(batch_size));
      if (loader_drop_last && int64_t(e - b) < batch_size) {
        batches += fmt::format("{}(dropped: {})", kept ? " " : "", list(mine, b, e));
        continue;
      }
      batches += (kept++ ? " " : "") + list(mine, b, e);
      if (e - b == 1) batches += " <- batch of 1: BatchNorm in training mode fails on it";
    }
    if (mine.empty()) batches = "(none)";
    std::printf("  batches (%lld): %s\n", (long long)kept, batches.c_str());
    if (kept == 0) std::printf("  this rank trains on nothing this epoch\n");
  }
}

int run(int argc, char** argv) {
  SamplerOptions o;
  int64_t size = -1, epoch = 0, batch_size = 0;
  int replicas = 0;
  bool no_shuffle = false, json = false, loader_drop_last = false;

  CLI::App app{"replica-sampler: what DistributedSampler gives each rank (padding, drop_last, "
               "set_epoch)"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.add_option("--size", size, "dataset size N (>= 0)")->required();
  app.add_option("--replicas", replicas, "number of ranks R (WORLD_SIZE, >= 1)")->required();
  app.add_option("--epoch", epoch, "the set_epoch() value (>= 0; omitting it = never calling "
                                   "set_epoch = epoch 0)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "sampler seed, the same on every rank")
      ->check(CLI::Validator(
          [](std::string& v) {  // CLI11 would wrap -1 and saturate 2^64 silently
            const std::string bad = "must be an integer in [0, 2^64), got " + v;
            if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) return bad;
            try {
              std::stoull(v);
            } catch (const std::exception&) {
              return bad;
            }
            return std::string();
          },
          ""))
      ->capture_default_str();
  app.add_flag("--drop-last", o.drop_last,
               "DistributedSampler drop_last: truncate instead of pad when N % R != 0");
  app.add_flag("--no-shuffle", no_shuffle, "keep the dataset order 0..N-1");
  app.add_option("--batch-size", batch_size, "per-rank DataLoader batch size: also show batches");
  app.add_flag("--loader-drop-last", loader_drop_last,
               "DataLoader drop_last: drop each rank's last partial batch (needs --batch-size)");
  app.add_flag("--json", json, "print {\"0\": [...], \"1\": [...]} (rank -> indices), one line");
  app.footer(kFooter);

  if (auto code = parse_cli(app, argc, argv)) return *code;
  REPLICA_USAGE_CHECK(size >= 0, "--size must be >= 0, got {}", size);
  REPLICA_USAGE_CHECK(size <= kMaxSize, "--size must be at most {}, got {}", kMaxSize, size);
  REPLICA_USAGE_CHECK(replicas >= 1, "--replicas must be >= 1, got {}", replicas);
  REPLICA_USAGE_CHECK(replicas <= kMaxReplicas, "--replicas must be at most {}, got {}",
                      kMaxReplicas, replicas);
  REPLICA_USAGE_CHECK(epoch >= 0, "--epoch must be >= 0, got {}", epoch);
  REPLICA_USAGE_CHECK(app.count("--batch-size") == 0 || batch_size >= 1,
                      "--batch-size must be >= 1, got {}", batch_size);
  REPLICA_USAGE_CHECK(!loader_drop_last || batch_size >= 1,
                      "--loader-drop-last needs --batch-size");
  REPLICA_USAGE_CHECK(!json || app.count("--batch-size") == 0,
                      "--json prints indices only; --batch-size is for the table output");
  o.dataset_size = size;
  o.num_replicas = replicas;
  o.rank = 0;
  o.shuffle = !no_shuffle;
  if (json)
    print_json(o, epoch);
  else
    print_table(o, epoch, batch_size, loader_drop_last);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-sampler", [&] { return run(argc, argv); });
}
