// PeerMonitor: each rank's heartbeat in the rendezvous store, so that a collective that fails or
// times out names the rank that stopped answering. Without it the error names only the peer the
// transport was waiting on, which in a ring is often a healthy rank that is itself waiting.
//
// A thread of the monitor's own, on a store connection of its own, writes every `interval`
//   health/<rank> = "<beat> <collectives entered> <the last one's name>"
// A stopped (SIGSTOP), dead or wedged process stops beating; a healthy rank blocked inside a
// collective keeps beating. diagnose() reads every rank's heartbeat twice, a window apart.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"

namespace replica {

class Store;

// A collective failed because of other ranks: `ranks` are the ones that stopped answering
// (empty when none could be named). Programs report them (cli/program.h), and the launcher
// names them in its last line.
class PeerFailure : public Error {
 public:
  PeerFailure(const std::string& message, std::vector<int> ranks)
      : Error(message), ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

class PeerMonitor {
 public:
  // `store` is a connection of the monitor's own (Store::connect_again()).
  PeerMonitor(std::unique_ptr<Store> store, int rank, int world);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  // Ends the heartbeat (idempotent): once a rank is done with the job, its monitor writes to the
  // store no more.
  void stop();

  // As a collective starts: counts it and remembers its name (a string literal). Lock-free.
  void entering(const char* collective);

  struct Finding {
    std::vector<int> silent;  // ranks whose heartbeat stopped
    std::string text;         // one sentence: who stopped answering, or who lags behind
  };
  // Which ranks stopped answering, judged over about a second: call after a collective failed.
  Finding diagnose() const;

 private:
  void beat_loop();
  std::string state() const;

  std::unique_ptr<Store> store_;
  const int rank_, world_;
  static constexpr std::chrono::milliseconds interval_{250};
  std::atomic<int64_t> entered_{0};
  std::atomic<const char*> last_{"none"};
  int64_t beats_ = 0;

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// "rank 3", "ranks 0-3", "ranks 0, 2": how messages name ranks.
std::string rank_list(std::vector<int> ranks);

}  // namespace replica
