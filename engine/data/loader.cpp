#include "engine/data/loader.h"

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>

#include "engine/allocator.h"
#include "engine/error.h"

namespace replica {

struct Loader::State {
  struct Slot {
    Tensor images, labels, indices;  // max-size buffers; batches are row slices of them
  };
  struct Ready {
    int64_t index = 0, count = 0;
    int slot = -1;             // -1 with `error` set: preparing batch `index` failed
    std::exception_ptr error;
  };

  // Fixed at construction.
  const Dataset* data = nullptr;
  const ResidentDataset* resident = nullptr;  // set: only the indices are written
  int64_t batch_size = 1;
  size_t prefetch = 1;
  std::vector<Slot> slots;

  std::mutex mu;
  std::condition_variable work_cv;   // the thread waits for work and free buffers
  std::condition_variable ready_cv;  // next() waits for ready batches
  bool stop = false;
  std::vector<int> free;             // slot ids nobody uses
  std::deque<Ready> ready;           // prepared, in batch order, not yet handed out
  uint64_t generation = 0;           // bumped by start_epoch: work of older epochs is dropped
  bool started = false;
  std::shared_ptr<const std::vector<int64_t>> indices;
  int64_t epoch = 0;
  int64_t next_fill = 0;     // next batch the thread prepares
  int64_t next_deliver = 0;  // next batch next() hands out
  int64_t end = 0;           // batches in the epoch
  std::exception_ptr failed;  // this epoch's error: re-thrown until start_epoch
  std::exception_ptr dead;    // the thread itself died (should not happen): re-thrown forever

  void release(int slot) {
    {
      std::lock_guard<std::mutex> lock(mu);
      free.push_back(slot);
    }
    work_cv.notify_one();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    try {
      for (;;) {
        work_cv.wait(lock, [&] {
          return stop || (next_fill < end && !free.empty() && ready.size() < prefetch);
        });
        if (stop) return;
        int slot = free.back();
        free.pop_back();
        const int64_t b = next_fill++;
        const uint64_t gen = generation;
        const int64_t batch_epoch = epoch;
        const auto idx = indices;  // keeps this epoch's indices alive if start_epoch replaces them
        const int64_t begin = b * batch_size;
        const int64_t count = std::min<int64_t>(batch_size, int64_t(idx->size()) - begin);
        lock.unlock();
        std::exception_ptr error;
        try {
          const Slot& out = slots[slot];
          int32_t* rows = out.indices.i32();
          for (int64_t i = 0; i < count; ++i) rows[i] = static_cast<int32_t>((*idx)[begin + i]);
          if (!resident)
            data->read(idx->data() + begin, count, out.images.f32(), out.labels.i32(),
                       batch_epoch);
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        if (gen != generation || stop) {  // restarted (or stopping) meanwhile: drop it
          free.push_back(slot);
          continue;
        }
        if (error) {
          free.push_back(slot);
          ready.push_back({b, count, -1, error});
          next_fill = end;  // nothing more for this epoch
        } else {
          ready.push_back({b, count, slot, nullptr});
        }
        ready_cv.notify_all();
      }
    } catch (...) {
      if (!lock.owns_lock()) lock.lock();
      dead = std::current_exception();
      ready_cv.notify_all();
    }
  }
};

void PendingCopies::add(DeviceContext& ctx) {
  if (!ctx.is_cuda()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(events_.begin(), events_.end(), [&](const Copies& c) {
    return c.ctx == &ctx && c.device == ctx.device();
  });
  if (it == events_.end())
    it = events_.insert(events_.end(), {&ctx, ctx.device(), std::make_unique<StreamEvent>()});
  it->done->record(ctx);
}

void PendingCopies::wait() {
  // The events stay, to be recorded again when the buffer is refilled and copied.
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& c : events_) c.done->host_wait();
}

StagedRows::~StagedRows() {
  for (Rows& r : rows_) {
    try {
      r.copied->host_wait();
    } catch (...) {
      // A failed copy surfaces on the device's own stream; here there is nothing to do.
    }
  }
}

void StagedRows::put(Rows rows) {
  std::lock_guard<std::mutex> lock(mutex_);
  rows_.push_back(std::move(rows));
}

std::optional<DeviceBatch> StagedRows::take(DeviceContext& ctx, int64_t begin, int64_t end,
                                            BatchParts parts) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = std::find_if(rows_.begin(), rows_.end(), [&](const Rows& r) {
    return r.ctx == &ctx && r.begin == begin && r.end == end && r.parts == parts;
  });
  if (it == rows_.end()) return std::nullopt;
  Rows r = std::move(*it);
  rows_.erase(it);
  lock.unlock();
  r.copied->wait(ctx);
  return std::move(r.rows);
}

size_t StagedRows::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return rows_.size();
}

Batch read_batch(const Dataset& data, const std::vector<int64_t>& indices, Allocator& alloc) {
  const int64_t n = int64_t(indices.size());
  Shape image_shape = data.sample_shape();
  image_shape.insert(image_shape.begin(), n);
  Batch b;
  b.images = Tensor::empty(alloc, image_shape);
  b.labels = Tensor::empty(alloc, {n}, DType::I32);
  data.read(indices.data(), n, b.images.f32(), b.labels.i32());
  return b;
}

Loader::Loader(const Dataset& data, int64_t batch_size, bool drop_last, int prefetch,
               const ResidentDataset* resident)
    : data_(data), batch_size_(batch_size), drop_last_(drop_last) {
  REPLICA_USAGE_CHECK(batch_size >= 1, "batch size must be at least 1 (got {})", batch_size);
  REPLICA_USAGE_CHECK(prefetch >= 1, "loader prefetch must be at least 1 (got {})", prefetch);
  auto s = std::make_shared<State>();
  s->data = &data;
  s->batch_size = batch_size;
  s->prefetch = static_cast<size_t>(prefetch);
  REPLICA_CHECK(!resident || &resident->dataset() == &data,
                "loader: the resident set holds another dataset");
  REPLICA_USAGE_CHECK(data.size() <= INT32_MAX, "a dataset of {} samples is too large (2^31 - 1)",
                      data.size());
  s->resident = resident;
  // No batch holds more samples than the dataset (the sampler's indices are at most that
  // many): a --batch-size beyond it allocates for the dataset, not for the number given.
  const int64_t rows = std::min<int64_t>(batch_size, std::max<int64_t>(data.size(), 1));
  Shape image_shape = data.sample_shape();
  image_shape.insert(image_shape.begin(), rows);
  // prefetch ready + one the consumer works on + one it may still hold (e.g. an H2D copy in flight)
  const int pool = prefetch + 2;
  for (int i = 0; i < pool; ++i) {
    State::Slot slot;
    slot.indices = Tensor::empty(pinned_allocator(), {rows}, DType::I32);
    if (!resident) {
      slot.images = Tensor::empty(pinned_allocator(), image_shape, DType::F32);
      slot.labels = Tensor::empty(pinned_allocator(), {rows}, DType::I32);
    }
    s->slots.push_back(std::move(slot));
    s->free.push_back(pool - 1 - i);
  }
  state_ = s;
  thread_ = std::thread([s] { s->run(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->work_cv.notify_all();
  state_->ready_cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

int Loader::pool_size() const { return static_cast<int>(state_->slots.size()); }

int64_t Loader::batches_per_epoch(int64_t n_indices) const {
  if (n_indices <= 0) return 0;
  if (drop_last_) return n_indices / batch_size_;
  return (n_indices - 1) / batch_size_ + 1;  // rounded up, without overflow for a huge batch
}

void Loader::start_epoch(std::vector<int64_t> indices, int64_t epoch, int64_t first_batch) {
  const int64_t size = data_.size();
  for (size_t i = 0; i < indices.size(); ++i)
    REPLICA_USAGE_CHECK(indices[i] >= 0 && indices[i] < size,
                        "epoch {}: sample index {} (position {}) is outside the dataset of {} "
                        "samples",
                        epoch, indices[i], i, size);
  // The buffers hold at most the dataset's rows: an order longer than the dataset (epochs one
  // after another) must not make a batch larger than they are.
  const int64_t rows = state_->slots.front().indices.shape()[0];
  REPLICA_CHECK(std::min<int64_t>(batch_size_, int64_t(indices.size())) <= rows,
                "loader: batches of {} from {} indices, but each buffer holds {} rows (the "
                "dataset's {} samples)", batch_size_, indices.size(), rows, size);
  const int64_t total = batches_per_epoch(static_cast<int64_t>(indices.size()));
  REPLICA_USAGE_CHECK(first_batch >= 0 && first_batch <= total,
                      "epoch {}: cannot start at batch {}: the epoch has {} batches", epoch,
                      first_batch, total);
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.generation;
    for (const auto& r : s.ready)
      if (r.slot >= 0) s.free.push_back(r.slot);
    s.ready.clear();
    s.indices = std::make_shared<const std::vector<int64_t>>(std::move(indices));
    s.epoch = epoch;
    s.next_fill = s.next_deliver = first_batch;
    s.end = total;
    s.failed = nullptr;
    s.started = true;
  }
  s.work_cv.notify_all();
  s.ready_cv.notify_all();
}

std::shared_ptr<Batch> Loader::next() {
  std::shared_ptr<State> s = state_;  // next() touches only the shared state (see ~Loader)
  std::unique_lock<std::mutex> lock(s->mu);
  if (!s->started) throw Error("Loader::next() called before start_epoch()");
  for (;;) {
    if (s->dead) std::rethrow_exception(s->dead);
    if (s->failed) std::rethrow_exception(s->failed);
    if (s->stop || s->next_deliver >= s->end) return nullptr;
    if (!s->ready.empty()) break;
    s->ready_cv.wait(lock);
  }
  State::Ready r = s->ready.front();
  s->ready.pop_front();
  s->work_cv.notify_one();  // room in the ready queue
  if (r.error) {
    s->failed = r.error;
    std::rethrow_exception(r.error);
  }
  REPLICA_CHECK(r.index == s->next_deliver, "loader: batch {} ready, expected {}", r.index,
                s->next_deliver);
  ++s->next_deliver;
  const State::Slot& slot = s->slots[r.slot];
  const int id = r.slot;
  std::unique_ptr<Batch> batch;
  try {
    batch = std::make_unique<Batch>();
    if (!s->resident) {
      batch->images = slot.images.slice_rows(0, r.count);
      batch->labels = slot.labels.slice_rows(0, r.count);
    }
    batch->indices = slot.indices.slice_rows(0, r.count);
    batch->resident = s->resident;
    batch->epoch = s->epoch;
    batch->index = r.index;
  } catch (...) {
    s->free.push_back(id);
    throw;
  }
  lock.unlock();
  // If the control block cannot be allocated, shared_ptr calls the deleter: the slot goes back.
  return std::shared_ptr<Batch>(batch.release(), [s, id](Batch* b) {
    try {
      b->copies->wait();
    } catch (...) {
      // A failed GPU copy surfaces on the device's own stream; here there is nothing to do.
    }
    delete b;
    s->release(id);
  });
}

}  // namespace replica
