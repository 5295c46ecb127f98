// CommQueue: a reducer's communication thread. push(b) queues bucket b; the thread runs
// work(b) for each, in push order; wait(n) blocks until n buckets of this step are done and
// rethrows the first error a bucket raised (a failed collective ends in an exception on the
// training thread, never in std::terminate on the communication thread).
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace replica {

class CommQueue {
 public:
  explicit CommQueue(std::function<void(int)> work);
  ~CommQueue();
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  void reset();  // a new step: completion count and error cleared (call with nothing queued)
  void push(int bucket);
  void wait(int count);

 private:
  void loop();

  std::function<void(int)> work_;
  std::mutex mutex_;
  std::condition_variable queued_cv_, done_cv_;
  std::deque<int> queue_;
  int done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace replica
