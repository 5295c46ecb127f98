#include "engine/staged_directory.h"

#include <signal.h>

#include <atomic>
#include <filesystem>
#include <iterator>

#include "engine/error.h"
#include "engine/output_files.h"

namespace replica {

namespace fs = std::filesystem;

namespace {

// Signals that would end the process, held off for the life of this object: a handler notes
// the first, whichever thread the kernel hands it to (blocking it in one thread would leave it
// to the others: the kernels' worker threads), and it is raised again afterwards, with the
// dispositions as they were.
std::atomic<int> g_deferred{0};

class DeferredSignals {
 public:
  DeferredSignals() {
    g_deferred = 0;
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      int none = 0;
      g_deferred.compare_exchange_strong(none, sig);
    };
    sigfillset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kHeld); ++i) sigaction(kHeld[i], &sa, &old_[i]);
  }
  ~DeferredSignals() {
    for (size_t i = 0; i < std::size(kHeld); ++i) sigaction(kHeld[i], &old_[i], nullptr);
    if (const int sig = g_deferred.exchange(0)) raise(sig);
  }
  DeferredSignals(const DeferredSignals&) = delete;
  DeferredSignals& operator=(const DeferredSignals&) = delete;

 private:
  static constexpr int kHeld[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
  struct sigaction old_[4];
};

constexpr const char* kReplaced = ".replaced";

}  // namespace

StagedDirectory::StagedDirectory(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  // The directories this creates, so a set never committed leaves none behind (empty).
  for (fs::path p = fs::absolute(dir_, ec); !p.empty() && !fs::exists(p, ec) &&
                                            p != p.root_path();
       p = p.parent_path())
    created_.push_back(p.string());
  fs::create_directories(dir_, ec);
  REPLICA_USAGE_CHECK(fs::is_directory(dir_, ec), "cannot create directory '{}'", dir_);
  const std::string base = (fs::path(dir_) / ".staging").string();
  restore_replaced();
  remove_stale_temporaries(base);
  staging_ = temporary_for(base);
  fs::remove_all(staging_, ec);
  fs::create_directory(staging_, ec);
  REPLICA_USAGE_CHECK(!ec, "cannot write into '{}': {}", dir_, ec.message());
}

StagedDirectory::~StagedDirectory() {
  std::error_code ec;
  if (committed_ || keep_staging_) return;
  fs::remove_all(staging_, ec);
  for (const std::string& d : created_)  // innermost first; a directory written into stays
    if (!fs::remove(d, ec)) break;
}

// A commit killed between its moves (SIGKILL, the OOM killer) left old files aside in its
// staging directory: those the directory no longer has go back, before the staging directory
// is removed as stale.
void StagedDirectory::restore_replaced() {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    if (!stale_temporary(entry.path().filename().string(), ".staging.tmp-")) continue;
    std::error_code e;
    for (const auto& old : fs::directory_iterator(entry.path() / kReplaced, e)) {
      const fs::path to = fs::path(dir_) / old.path().filename();
      if (!fs::exists(fs::symlink_status(to, e))) fs::rename(old.path(), to, e);
    }
  }
}

void StagedDirectory::commit() {
  // Ctrl-C, a terminal closed or a kill during the moves would leave a report half old and half
  // new: held back until the set is in place.
  const DeferredSignals deferred;

  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(staging_, ec))
    names.push_back(entry.path().filename().string());
  if (ec) throw Error(fmt::format("cannot read '{}': {}", staging_, ec.message()));
  // First the old files the set replaces or drops go aside (into the staging directory, on the
  // same file system), then the new ones come in. A failed move puts everything back as it
  // was: the directory holds the old set or the new one, never some of each.
  const fs::path aside = fs::path(staging_) / kReplaced;
  fs::create_directory(aside, ec);
  if (ec) throw Error(fmt::format("cannot write into '{}': {}", staging_, ec.message()));
  std::vector<std::string> moved_aside, moved_in;
  // Puts everything back; what it cannot put back is kept where it went, and said.
  const auto undo = [&](const std::string& what) {
    bool whole = true;
    std::error_code e;
    for (const std::string& n : moved_in) {
      fs::rename(fs::path(dir_) / n, fs::path(staging_) / n, e);
      whole = whole && !e;
    }
    for (const std::string& n : moved_aside) {
      fs::rename(aside / n, fs::path(dir_) / n, e);
      whole = whole && !e;
    }
    keep_staging_ = !whole;
    return Error(whole ? what
                       : fmt::format("{} (and putting the old files back failed: they are in "
                                     "'{}', and the next report into '{}' puts them back)",
                                     what, aside.string(), dir_));
  };
  std::vector<std::string> replaced = names;
  replaced.insert(replaced.end(), dropped_.begin(), dropped_.end());
  for (const std::string& n : replaced) {
    const fs::path old = fs::path(dir_) / n;
    if (!fs::exists(fs::symlink_status(old, ec)) || fs::exists(aside / n, ec)) continue;
    fs::rename(old, aside / n, ec);
    if (ec) throw undo(fmt::format("cannot replace '{}': {}", old.string(), ec.message()));
    moved_aside.push_back(n);
  }
  for (const std::string& n : names) {
    const fs::path to = fs::path(dir_) / n;
    fs::rename(fs::path(staging_) / n, to, ec);
    if (ec) throw undo(fmt::format("cannot move '{}' into place: {}", to.string(), ec.message()));
    moved_in.push_back(n);
  }
  committed_ = true;
  fs::remove_all(staging_, ec);  // the replaced files with it
}

}  // namespace replica
