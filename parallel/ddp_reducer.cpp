#include "parallel/ddp_reducer.h"

#include "engine/error.h"
#include "engine/trace.h"

namespace replica {

DdpReducer::DdpReducer(DeviceContext& ctx, Model& model, ProcessGroup& group,
                       size_t first_bucket_bytes, size_t bucket_bytes)
    : ctx_(ctx), model_(model), group_(group) {
  buckets_ = make_buckets(model.params(), first_bucket_bytes, bucket_bytes);
  bucket_of_param_.assign(model.params().size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int p : buckets_[b].params) bucket_of_param_[p] = static_cast<int>(b);
  for (size_t i = 0; i < model.params().size(); ++i) index_[model.params()[i]] = int(i);
  remaining_.assign(buckets_.size(), 0);
  if (group.size() > 1) comm_ = std::thread([this] { comm_loop(); });
}

DdpReducer::~DdpReducer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (comm_.joinable()) comm_.join();
}

void DdpReducer::begin(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
  for (size_t b = 0; b < buckets_.size(); ++b) remaining_[b] = int(buckets_[b].params.size());
  next_launch_ = 0;
  done_ = 0;
  queue_.clear();
  error_ = nullptr;
}

void DdpReducer::launch_ready_locked() {
  bool launched = false;
  while (next_launch_ < int(buckets_.size()) && remaining_[next_launch_] == 0) {
    queue_.push_back(next_launch_++);
    launched = true;
  }
  if (launched) queue_cv_.notify_one();
}

void DdpReducer::on_ready(const std::vector<Param*>& params) {
  if (group_.size() <= 1) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_) return;
  for (const Param* p : params) --remaining_[bucket_of_param_[index_.at(p)]];
  launch_ready_locked();
}

void DdpReducer::comm_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int b = queue_.front();
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      TraceSpan span("comm", "allreduce");
      ctx_.activate();
      Tensor view = model_.flat_grads().view(buckets_[b].offset, {buckets_[b].numel});
      group_.allreduce_sum(ctx_, view, /*persistent=*/true);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    ++done_;
    done_cv_.notify_all();
  }
}

void DdpReducer::finalize() {
  if (group_.size() <= 1) return;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!sync_) return;
  // Parameters that got no gradient this step (unused): their buckets go now, still in order.
  for (auto& r : remaining_) r = 0;
  launch_ready_locked();
  {
    TraceSpan span("host", "wait_allreduce");
    done_cv_.wait(lock, [&] { return done_ == int(buckets_.size()); });
  }
  if (error_) std::rethrow_exception(error_);
  lock.unlock();
  ctx_.ops().scale(ctx_, model_.flat_grads(), 1.f / float(group_.size()));
}

}  // namespace replica
