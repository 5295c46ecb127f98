#include "parallel/loop/distributed_sampler.h"

#include <algorithm>
#include <limits>

#include "engine/allocator.h"
#include "engine/data/dataset.h"
#include "engine/error.h"

namespace replica {

DistributedSampler::DistributedSampler(SamplerOptions o) : opt_(o) {
  REPLICA_USAGE_CHECK(o.num_replicas >= 1, "DistributedSampler: num_replicas must be >= 1, got {}",
                      o.num_replicas);
  REPLICA_USAGE_CHECK(o.rank >= 0 && o.rank < o.num_replicas,
                      "DistributedSampler: rank {} is outside [0, {})", o.rank, o.num_replicas);
  REPLICA_USAGE_CHECK(o.dataset_size >= 0, "DistributedSampler: dataset size must be >= 0, got {}",
                      o.dataset_size);
  const int64_t n = o.dataset_size, r = o.num_replicas;
  // total_size <= n + r - 1 must fit in int64.
  REPLICA_USAGE_CHECK(n <= std::numeric_limits<int64_t>::max() - r,
                      "DistributedSampler: dataset size {} is too large", n);
  // PyTorch: ceil((N - R) / R) when drop_last and N % R != 0, else ceil(N / R). In integers the
  // first is floor(N / R) (for N < R it is 0: ceil of a value in (-1, 0)).
  if (o.drop_last && n % r != 0)
    num_samples_ = n / r;
  else
    num_samples_ = n / r + (n % r != 0 ? 1 : 0);
  total_size_ = num_samples_ * r;
  // The epoch's order is made whole, as PyTorch's randperm makes it: 8 bytes per index, the
  // global order and this rank's share, in every rank on this machine. A size the machine
  // cannot hold is said now, not met as std::bad_alloc or the OOM killer once the first epoch
  // starts (each of two ranks once found room for its own order, and the OOM killer came).
  const int local = std::max(o.local_ranks, 1);
  const double need = 8.0 * (double(total_size_) + double(num_samples_)) * local;
  size_t room = 0;
  // (capped at 10^18 bytes, beyond any machine, so that the count fits a size_t)
  REPLICA_USAGE_CHECK(host_can_hold(size_t(std::min(need, 1e18)), &room),
                      "a data set of {} samples: its shuffled order takes {:.1f} GiB{} and "
                      "{:.1f} GiB is available",
                      n, need / (1 << 30),
                      local > 1 ? fmt::format(" in the {} ranks on this machine", local) : "",
                      double(room) / (1 << 30));
}

std::vector<int64_t> DistributedSampler::global_indices() const {
  std::vector<int64_t> order =
      epoch_order(opt_.dataset_size, opt_.seed, epoch_, opt_.shuffle);
  const int64_t n = opt_.dataset_size;
  if (total_size_ <= n) {
    order.resize(static_cast<size_t>(total_size_));  // drop_last: the tail is never read
    return order;
  }
  // Padding (not drop_last): PyTorch's `indices += indices[:p]` or, when p > N,
  // `(indices * ceil(p / N))[:p]` — both are the order repeated cyclically from its start.
  // n > 0 here: total_size_ > n >= 0 implies num_samples_ >= 1, i.e. n >= 1.
  order.reserve(static_cast<size_t>(total_size_));
  for (int64_t i = n; i < total_size_; ++i) order.push_back(order[static_cast<size_t>(i % n)]);
  return order;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const std::vector<int64_t> all = global_indices();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = opt_.rank; i < total_size_; i += opt_.num_replicas)
    mine.push_back(all[static_cast<size_t>(i)]);
  REPLICA_CHECK(static_cast<int64_t>(mine.size()) == num_samples_,
                "DistributedSampler: rank {} got {} indices, expected {}", opt_.rank, mine.size(),
                num_samples_);
  return mine;
}

}  // namespace replica
