// Tests that run a process group's ranks as threads of one process: how they end. Each rank
// counts itself finished in the store and waits there for the others before its group is torn
// down. A Gloo barrier as the last collective is not enough: its root returns as soon as it has
// sent the last message, and tearing its connections down then made a rank still waiting for
// that message fail with "Connection closed by peer" (seen once in test_ddp, on a loaded
// machine). ProcessGroup::leave() is the same wait for one rank per process; it numbers its
// keys per process, so threads of one process cannot share it.
#pragma once
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "parallel/rendezvous/store.h"

namespace test {

inline void finish_together(replica::Store& store, int ranks,
                            const std::string& key = "test/finished") {
  store.add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (store.add(key, 0) < ranks) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("not every rank finished within 30 s (" + key + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace test
