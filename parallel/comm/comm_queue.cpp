#include "parallel/comm/comm_queue.h"

namespace replica {

CommQueue::CommQueue(std::function<void(int)> work) : work_(std::move(work)) {
  thread_ = std::thread([this] { loop(); });
}

CommQueue::~CommQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  queued_cv_.notify_all();
  thread_.join();
}

void CommQueue::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  done_ = 0;
  error_ = nullptr;
}

void CommQueue::push(int bucket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(bucket);
  }
  queued_cv_.notify_one();
}

void CommQueue::wait(int count) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return done_ >= count; });
  if (error_) std::rethrow_exception(error_);
}

void CommQueue::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    queued_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int bucket = queue_.front();
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      work_(bucket);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    ++done_;
    done_cv_.notify_all();
  }
}

}  // namespace replica
