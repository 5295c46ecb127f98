// DistributedSampler: which samples each DDP rank reads in an epoch. The structure is PyTorch's
// torch.utils.data.distributed.DistributedSampler exactly:
//
//   num_samples = ceil((N - R) / R)  if drop_last and N % R != 0   (= floor(N / R))
//                 ceil(N / R)         otherwise
//   total_size  = num_samples * R
//   order       = shuffle ? permutation of 0..N-1 : 0..N-1
//   not drop_last: order is padded to total_size by repeating it from its start
//                  (order[0], order[1], ... cyclically, as often as needed when N < R)
//   drop_last:     order is truncated to total_size (the last N % R entries are never read)
//   rank r reads   order[r : total_size : R]            (interleaved, not contiguous blocks)
//
// The one difference: the permutation is replica's epoch_order(N, seed, epoch, true)
// (engine/data/dataset.h), not torch.randperm seeded with seed + epoch. It is a pure function of
// (N, seed, epoch), identical on every platform and rank, so the ranks agree without
// communicating; but the concrete numbers differ from a PyTorch run with the same seed. Padding,
// truncation and subsampling positions are PyTorch's, so the same *shape* of result appears:
// e.g. N = 5, R = 2 pads to 6 by repeating order[0]: rank 0 reads it at position 0 and rank 1
// again at position 5. With shuffle == false the numbers are PyTorch's too.
//
// Epochs: as in PyTorch, the order changes only when set_epoch() is called. A sampler whose
// set_epoch() is never called returns the same split (the epoch-0 order) every epoch.
//
// Key property (tested in tests/test_sampler.cpp): take a global batch B divisible by R and a
// per-rank batch b = B / R, with the ranks' loaders forming consecutive chunks of indices().
// Rank r's step s reads positions r + R*j, j in [s*b, (s+1)*b), of the padded order, so the
// union over ranks of step s is positions [s*B, (s+1)*B): exactly the samples of step s of a
// one-device run over epoch_order(N, seed, epoch, shuffle) with batch B. This holds for every
// step whose positions are real samples (no padding) and kept ones (not truncated away):
// all full steps with (s+1)*B <= min(N, total_size), and also the final partial step when
// N % R == 0. Padding (not drop_last) adds repeated samples to the last step; drop_last removes
// the tail the one-device run would read.
#pragma once
#include <cstdint>
#include <vector>

namespace replica {

struct SamplerOptions {
  int64_t dataset_size = 0;  // N >= 0
  int num_replicas = 1;      // R >= 1 (WORLD_SIZE)
  int rank = 0;              // in [0, R)
  bool shuffle = true;
  uint64_t seed = 0;       // must be the same on every rank
  bool drop_last = false;  // the SAMPLER's drop_last: truncate instead of pad when N % R != 0.
                           // Not the DataLoader's drop_last (which drops partial batches).
  // The ranks on this machine (LOCAL_WORLD_SIZE), each holding an order of its own: the check
  // that the orders fit in memory counts them all.
  int local_ranks = 1;
};

class DistributedSampler {
 public:
  // UsageError: dataset_size < 0, num_replicas < 1, rank outside [0, num_replicas).
  explicit DistributedSampler(SamplerOptions o);

  // Selects the epoch whose order indices() returns (PyTorch: call it before every epoch, or
  // every epoch repeats the epoch-0 split). Any value is accepted; the default is 0.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }

  int64_t num_samples() const { return num_samples_; }  // per rank: len(indices())
  int64_t total_size() const { return total_size_; }    // num_samples() * num_replicas

  // This rank's indices for the current epoch: num_samples() values in [0, N).
  std::vector<int64_t> indices() const;

  // The whole epoch's list before subsampling: the order after padding or truncation,
  // total_size() values. indices() == global_indices()[rank : : num_replicas].
  std::vector<int64_t> global_indices() const;

 private:
  SamplerOptions opt_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
  int64_t total_size_ = 0;
};

}  // namespace replica
