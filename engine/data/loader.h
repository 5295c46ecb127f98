// Loader: a background thread that prepares the next batches in pinned host memory while the
// devices compute. One mutex and two condition variables; batch buffers come from a fixed pool
// allocated once (prefetch + 2 buffers of batch_size samples), so steady state allocates nothing.
//
// Life of a buffer: free -> filled by the thread -> ready queue -> handed out by next() inside a
// shared_ptr<Batch> -> back to free when the consumer releases that shared_ptr and the device
// copies recorded in Batch::copies have run (the release waits for them, which on a GPU is
// normally long past: the copy ran before the step that used it).
// Do not keep copies of a batch's tensors after releasing the Batch: the memory is reused.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "engine/allocator.h"
#include "engine/context.h"
#include "engine/data/dataset.h"
#include "engine/data/resident_dataset.h"
#include "engine/tensor.h"

namespace replica {

// Device copies that may still be reading a batch's host memory: on a GPU a host->device copy
// from pinned memory is asynchronous, so the buffer must not be refilled until it has run.
// One event per context, recorded again at each copy: a stream runs in order, so its latest
// copy covers the earlier ones, and a batch used for many steps (replica-bench's) holds no more
// events than it has devices.
class PendingCopies {
 public:
  void add(DeviceContext& ctx);  // after enqueueing a copy on ctx's stream (no-op on CPU)
  void wait();                   // the host waits for every copy added
 private:
  struct Copies {
    const DeviceContext* ctx;  // compared only, with its device: a context made later at
    Device device;             // the same address on another GPU needs an event of its own
    std::unique_ptr<StreamEvent> done;
  };
  std::mutex mutex_;  // DP's workers copy their chunks from one batch at once
  std::vector<Copies> events_;
};

// Which parts of a batch a device needs, and rows of a batch on a device: images (F32) and/or
// labels (I32; a part not asked for stays undefined).
enum class BatchParts { Images, Labels, Both };
struct DeviceBatch {
  Tensor images, labels;
};

// Rows of a batch copied to a device ahead of the step that uses them, on a copy stream of that
// device while the step before computes (BatchPrefetcher, parallel/engines/engine_steps.h), and
// waiting there to be taken by that step. Thread-safe: DP's workers stage and take their own
// rows of one batch at once.
class StagedRows {
 public:
  struct Rows {
    const DeviceContext* ctx = nullptr;
    int64_t begin = 0, end = 0;
    BatchParts parts = BatchParts::Both;
    DeviceBatch rows;  // device memory of ctx's allocator
    std::unique_ptr<StreamEvent> copied;  // recorded on the copy stream after the copies
  };
  StagedRows() = default;
  // Rows never taken are freed only once their copies ran (the host waits: a copy stream may
  // still be writing memory the allocator would hand out again). Never throws.
  ~StagedRows();
  StagedRows(const StagedRows&) = delete;
  StagedRows& operator=(const StagedRows&) = delete;

  void put(Rows rows);
  // The rows staged for exactly (ctx, begin, end, parts), no longer held here; ctx's stream
  // waits for their copies before anything enqueued on it after this call. Empty when none.
  std::optional<DeviceBatch> take(DeviceContext& ctx, int64_t begin, int64_t end,
                                  BatchParts parts);
  size_t size();  // rows staged and not yet taken

 private:
  std::mutex mutex_;
  std::vector<Rows> rows_;
};

struct Batch {
  Tensor images;  // F32 [n, C, H, W] in pinned host memory (pinned_allocator())
  Tensor labels;  // I32 [n]
  int64_t epoch = 0, index = 0;  // batch index within the epoch
  // Copies made of this batch (shared by copies of the Batch): a Loader's buffer goes back to
  // be refilled only after they ran.
  std::shared_ptr<PendingCopies> copies = std::make_shared<PendingCopies>();
  // Rows of this batch already copied to devices, for its step to take (shared likewise).
  std::shared_ptr<StagedRows> staged = std::make_shared<StagedRows>();
  // A Loader's batches: the dataset's sample indices, I32 [n] in pinned host memory. With
  // `resident` set, images and labels are not read at all: each device gathers its rows of the
  // batch from the set it holds (ResidentDataset::images/labels by these indices).
  Tensor indices;
  const ResidentDataset* resident = nullptr;
  int64_t size() const {
    return indices.defined() ? indices.dim(0) : labels.defined() ? labels.dim(0) : 0;
  }
};

// The samples `indices` of `data` as one batch, outside any Loader: fixed batches for
// benchmarks, tests and one-step experiments. Images and labels come from `alloc`.
Batch read_batch(const Dataset& data, const std::vector<int64_t>& indices,
                 Allocator& alloc = pinned_allocator());

class Loader {
 public:
  // batch_size >= 1 and prefetch >= 1 (UsageError otherwise); prefetch = batches prepared ahead.
  // `data` must outlive the Loader. With `resident` (holding `data`), batches carry only their
  // indices and point to it; the thread then reads no samples.
  Loader(const Dataset& data, int64_t batch_size, bool drop_last, int prefetch = 2,
         const ResidentDataset* resident = nullptr);
  // Stops and joins the thread (after the batch it may be filling). Never hangs, whatever the
  // consumer holds; batches still held stay valid. A next() blocked on another thread returns
  // nullptr, but calling next() after destruction has begun is, as for any object, an error.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Starts (or restarts) an epoch over `indices` (already ordered: an epoch_order() permutation or
  // a DistributedSampler's share), beginning at batch `first_batch` (to resume mid-epoch; may equal
  // batches_per_epoch(), giving an empty epoch). Batches of a previous epoch not yet handed out
  // are discarded; those the consumer holds stay valid until released. Indices must be in
  // [0, data.size()) (UsageError otherwise).
  void start_epoch(std::vector<int64_t> indices, int64_t epoch, int64_t first_batch = 0);

  // The next batch of the epoch (consecutive chunks of `indices`; the last one partial unless
  // drop_last), or nullptr at the end of the epoch. Blocks while the thread prepares it. An
  // exception thrown while preparing a batch is re-thrown here (after the batches before it), and
  // again by every later next() until start_epoch(). Error if no epoch was started.
  // If the consumer holds every buffer (prefetch + 2 batches), next() waits until one is released.
  std::shared_ptr<Batch> next();

  // Batches in an epoch of n_indices samples: floor (drop_last) or ceil.
  int64_t batches_per_epoch(int64_t n_indices) const;

  int64_t batch_size() const { return batch_size_; }
  int pool_size() const;  // buffers in the pool

 private:
  struct State;  // shared with the thread and with handed-out batches
  const Dataset& data_;
  int64_t batch_size_;
  bool drop_last_;
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace replica
