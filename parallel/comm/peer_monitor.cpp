#include "parallel/comm/peer_monitor.h"

#include <algorithm>
#include <sstream>

#include "parallel/rendezvous/store.h"

namespace replica {

namespace {

std::string health_key(int rank) { return fmt::format("health/{}", rank); }

struct Health {
  bool present = false;
  int64_t beat = -1, entered = 0;
  std::string last;
};

Health parse_health(const Bytes& value) {
  Health h;
  std::istringstream in(to_string(value));
  if (!(in >> h.beat >> h.entered)) return Health{};
  std::getline(in >> std::ws, h.last);
  h.present = true;
  return h;
}

}  // namespace

std::string rank_list(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  if (ranks.size() == 1) return fmt::format("rank {}", ranks[0]);
  const bool run = ranks.back() - ranks.front() + 1 == int(ranks.size());
  if (run && ranks.size() > 2) return fmt::format("ranks {}-{}", ranks.front(), ranks.back());
  std::string out = "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

PeerMonitor::PeerMonitor(std::unique_ptr<Store> store, int rank, int world)
    : store_(std::move(store)), rank_(rank), world_(world) {
  thread_ = std::thread([this] { beat_loop(); });
}

PeerMonitor::~PeerMonitor() { stop(); }

void PeerMonitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PeerMonitor::entering(const char* collective) {
  last_.store(collective, std::memory_order_relaxed);
  entered_.fetch_add(1, std::memory_order_relaxed);
}

std::string PeerMonitor::state() const {
  return fmt::format("{} {} {}", beats_, entered_.load(std::memory_order_relaxed),
                     last_.load(std::memory_order_relaxed));
}

void PeerMonitor::beat_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    ++beats_;
    try {
      store_->set(health_key(rank_), to_bytes(state()));
    } catch (const std::exception&) {
      // The store is gone (rank 0 has left) or slow: a missed beat is what diagnose() reads.
    }
    lock.lock();
    wake_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

PeerMonitor::Finding PeerMonitor::diagnose() const {
  Finding f;
  const auto window = std::max(std::chrono::milliseconds(1000), 4 * interval_);
  auto read_all = [&] {
    std::vector<Health> all(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r)
      if (r != rank_ && store_->check({health_key(r)}))
        all[size_t(r)] = parse_health(store_->get(health_key(r)));
    return all;
  };
  std::vector<Health> before, after;
  try {
    before = read_all();
    std::this_thread::sleep_for(window);
    after = read_all();
  } catch (const std::exception& e) {
    if (rank_ != 0) f.silent = {0};
    f.text = fmt::format("rank 0, which hosts the rendezvous store, stopped answering (the store "
                         "did not answer: {})",
                         e.what());
    return f;
  }
  const int64_t mine = entered_.load();
  std::vector<int> behind;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Health &a = before[size_t(r)], &b = after[size_t(r)];
    if (!b.present || a.beat == b.beat) f.silent.push_back(r);
    else if (b.entered < mine) behind.push_back(r);
  }
  if (!f.silent.empty()) {
    const Health& h = after[size_t(f.silent.front())];
    f.text = fmt::format(
        "{} stopped answering (no heartbeat during a {:.1f} s watch{})", rank_list(f.silent),
        window.count() / 1000.0,
        f.silent.size() == 1 && h.present
            ? fmt::format("; it last entered collective #{}, a {}", h.entered, h.last)
            : "");
  } else if (!behind.empty()) {
    const Health& h = after[size_t(behind.front())];
    f.text = fmt::format(
        "every rank is alive, but {} has not reached collective #{} (it has entered {}, the last "
        "a {}): the ranks are out of step",
        rank_list(behind), mine, h.entered, h.last);
  } else {
    f.text = "every rank is alive and has entered the same collectives";
  }
  return f;
}

}  // namespace replica
