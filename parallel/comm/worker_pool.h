// WorkerPool: the ranks of a DP job, one long-lived thread per device. run(f) executes f(i) on
// worker i for every i at once and returns when all have finished (rethrowing the first error).
// The same thread always serves the same device, so per-thread state (the current CUDA device,
// the TBB arena it joins) stays put across iterations. The DP engine runs its phases on it, and
// the LocalGroup its per-rank copies (local_group.h).
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace replica {

class WorkerPool {
 public:
  explicit WorkerPool(int workers);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void run(const std::function<void(int)>& task);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void loop(int index);

  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace replica
