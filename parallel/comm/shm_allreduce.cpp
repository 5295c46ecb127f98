#include "parallel/comm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>
#include <random>

#include <fmt/format.h>

#include "engine/env_switch.h"
#include "engine/error.h"
#include "parallel/comm/nccl_placement.h"
#include "parallel/rendezvous/store.h"

namespace replica {

struct ShmAllreduce::Segment {
  // counters[0]: rounds whose tensor this rank has put in place; counters[1]: rounds whose 1/n
  // it has summed. Each on a cache line of its own: peers poll them while this rank writes.
  struct alignas(64) Counter {
    std::atomic<uint32_t> value{0};
  };
  Counter counters[2];
  // Per area, what this rank put there: the length of its call and of the round. Peers check
  // them: ranks whose calls differ would otherwise sum unlike tensors without a word.
  alignas(64) int64_t shape[2][2];
  alignas(4096) float areas[2][kAreaFloats];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "counters shared between processes");

namespace {

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// "pid:[4026531836]": a pid means another process, or none, in another pid namespace
// (containers sharing /dev/shm and the network).
std::string pid_namespace() {
  char link[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof link - 1);
  return n > 0 ? std::string(link, size_t(n)) : "unknown";
}

}  // namespace

ShmAllreduce::ShmAllreduce(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank),
      size_(size),
      timeout_(timeout),
      segments_(size, nullptr),
      pids_(size, 0),
      pidfds_(size, -1) {}

ShmAllreduce::~ShmAllreduce() {
  for (Segment* s : segments_)
    if (s) munmap(s, sizeof(Segment));
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
}

std::unique_ptr<ShmAllreduce> ShmAllreduce::connect(Store& store, int rank, int size,
                                                    const std::string& address,
                                                    std::chrono::milliseconds timeout) {
  std::unique_ptr<ShmAllreduce> shm(new ShmAllreduce(rank, size, timeout));
  // This rank's segment, created under a name no other job uses; reserved with fallocate, so a
  // full /dev/shm is an error here, not a SIGBUS on a later write.
  std::random_device entropy;
  const std::string name = fmt::format("/replica-allreduce-{}-{}-{:08x}", getpid(), rank,
                                       uint32_t(entropy()));
  // The name goes however this function ends: once every rank has mapped the segment, or when
  // the set-up fails (a peer or the store gone).
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) shm_unlink(name.c_str());
    }
  } unlink_own;
  if (switches::kShmAllreduce.on()) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) {
      void* m = MAP_FAILED;
      if (posix_fallocate(fd, 0, sizeof(Segment)) == 0)
        m = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      unlink_own.name = name;
      if (m != MAP_FAILED) shm->segments_[size_t(rank)] = new (m) Segment;
    }
  }
  // Round 1: every rank's segment (or "-"), its machine, address and process namespace (a
  // peer's pid is looked up to see whether it exited). All ranks read the same entries, so all
  // decide alike whether to go on.
  const std::string where = machine_id() + " " + address + " " + pid_namespace();
  const bool made = shm->segments_[size_t(rank)] != nullptr;
  store.set(fmt::format("shm/made/{}", rank),
            to_bytes(made ? fmt::format("{} {} {}", name, getpid(), where) : "-"));
  std::vector<std::string> names(static_cast<size_t>(size));
  bool usable = true;
  for (int r = 0; r < size; ++r) {
    const std::string entry = to_string(store.get(fmt::format("shm/made/{}", r)));
    char peer[256] = {0};
    int pid = 0, rest = 0;  // "name pid where": `rest` is where `where` starts
    usable &= entry != "-" && std::sscanf(entry.c_str(), "%255s %d %n", peer, &pid, &rest) == 2 &&
              entry.compare(size_t(rest), std::string::npos, where) == 0;
    names[size_t(r)] = peer;
    shm->pids_[size_t(r)] = pid;
  }
  // Round 2: every rank has mapped every segment (or says it could not), so each may unlink its
  // own name: nothing is left in /dev/shm however the job ends.
  bool mapped = usable;
  for (int r = 0; usable && r < size; ++r) {
    if (r == rank) continue;
    const int fd = shm_open(names[size_t(r)].c_str(), O_RDWR, 0);
    void* m = fd < 0 ? MAP_FAILED
                     : mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (m == MAP_FAILED) {
      mapped = false;
      break;
    }
    shm->segments_[size_t(r)] = static_cast<Segment*>(m);
    // The peer's process, to see whether it exited: readable once it has (no pid reuse race).
    shm->pidfds_[size_t(r)] = int(syscall(SYS_pidfd_open, shm->pids_[size_t(r)], 0));
    if (shm->pidfds_[size_t(r)] < 0) {
      mapped = false;
      break;
    }
  }
  store.set(fmt::format("shm/mapped/{}", rank), to_bytes(mapped ? "1" : "0"));
  bool all_mapped = true;
  for (int r = 0; r < size; ++r)
    all_mapped &= to_string(store.get(fmt::format("shm/mapped/{}", r))) == "1";
  if (!all_mapped) return nullptr;  // the destructor unmaps what was mapped
  return shm;
}

void ShmAllreduce::sum(float* p, int64_t n) {
  // After a failure the ranks' rounds are out of step: every later call fails too.
  if (failed_) throw Error("an earlier shared-memory all-reduce failed");
  try {
    for (int64_t off = 0; off < n; off += kAreaFloats)
      round(p + off, std::min(kAreaFloats, n - off), n);
  } catch (...) {
    failed_ = true;
    throw;
  }
}

void ShmAllreduce::round(float* p, int64_t n, int64_t call_n) {
  const uint32_t r = ++rounds_;
  const int area = int(r % 2);
  Segment& mine = *segments_[size_t(rank_)];
  mine.shape[area][0] = call_n;
  mine.shape[area][1] = n;
  // In place: the tensor into this rank's area. A rank two rounds ahead would reuse this area,
  // but it cannot be: it waited in the round between for every rank to arrive.
  std::memcpy(mine.areas[area], p, size_t(n) * sizeof(float));
  mine.counters[0].value.store(r, std::memory_order_release);
  futex(&mine.counters[0].value, FUTEX_WAKE, INT_MAX, nullptr);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    wait_for(q, 0, r);
    const int64_t* theirs = segments_[size_t(q)]->shape[area];
    if (theirs[0] != call_n || theirs[1] != n)
      throw Error(fmt::format("rank {} all-reduces {} values where this rank has {}: the ranks' "
                              "calls differ",
                              q, theirs[0], call_n));
  }
  // This rank's 1/n, summed over the ranks in rank order, into its own area (which no other
  // rank reads until this rank's counter says it is summed).
  const int64_t begin = n * rank_ / size_, end = n * (rank_ + 1) / size_;
  constexpr int64_t kBlock = 1024;  // partial sums on the stack: the loops vectorise
  float partial[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t m = std::min(kBlock, end - b);
    const float* first = segments_[0]->areas[area] + b;
    for (int64_t i = 0; i < m; ++i) partial[i] = first[i];
    for (int q = 1; q < size_; ++q) {
      const float* in = segments_[size_t(q)]->areas[area] + b;
      for (int64_t i = 0; i < m; ++i) partial[i] += in[i];
    }
    std::memcpy(mine.areas[area] + b, partial, size_t(m) * sizeof(float));
  }
  mine.counters[1].value.store(r, std::memory_order_release);
  futex(&mine.counters[1].value, FUTEX_WAKE, INT_MAX, nullptr);
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) wait_for(q, 1, r);
    const int64_t b = n * q / size_, e = n * (q + 1) / size_;
    std::memcpy(p + b, segments_[size_t(q)]->areas[area] + b, size_t(e - b) * sizeof(float));
  }
}

void ShmAllreduce::wait_for(int peer, int which, uint32_t target) const {
  std::atomic<uint32_t>& word = segments_[size_t(peer)]->counters[which].value;
  auto reached = [&](uint32_t v) { return int32_t(v - target) >= 0; };
  for (int spin = 0; spin < 4000; ++spin)
    if (reached(word.load(std::memory_order_acquire))) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const timespec slice{0, 100'000'000};  // wakes up to see whether the peer is still there
  while (true) {
    const uint32_t v = word.load(std::memory_order_acquire);
    if (reached(v)) return;
    futex(&word, FUTEX_WAIT, v, &slice);
    if (reached(word.load(std::memory_order_acquire))) return;
    pollfd gone{pidfds_[size_t(peer)], POLLIN, 0};
    if (poll(&gone, 1, 0) > 0)
      throw Error(fmt::format("rank {} (pid {}) exited during the all-reduce", peer,
                              pids_[size_t(peer)]));
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(fmt::format("waited {} s for rank {}", timeout_.count() / 1000.0, peer));
  }
}

}  // namespace replica
