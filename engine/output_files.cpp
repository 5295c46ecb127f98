#include "engine/output_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/error.h"

namespace replica {

namespace fs = std::filesystem;

namespace {

char g_temporary[4096];
std::atomic<bool> g_writing{false};
static_assert(std::atomic<bool>::is_always_lock_free, "read from a signal handler");

// Holds an exclusive flock() on a directory while it lives: two processes that each read a
// file and rename a new one over it take turns.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& dir)
      : fd_(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
    while (fd_ >= 0 && flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~DirectoryLock() {
    if (fd_ >= 0) close(fd_);  // closing the descriptor releases the lock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

}  // namespace

OutputTarget output_target(const std::string& path) {
  std::error_code ec;
  OutputTarget t{path, false};
  // A link's target, followed link by link (it need not exist yet; 40 is the kernel's limit).
  fs::path p = path;
  for (int hops = 0; hops < 40 && fs::is_symlink(p, ec); ++hops) {
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) break;
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  t.path = p.lexically_normal().string();
  const fs::file_status st = fs::status(t.path, ec);
  t.in_place = fs::exists(st) && !fs::is_regular_file(st) && !fs::is_directory(st);
  return t;
}

void check_output_file(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const OutputTarget target = output_target(path);
  const fs::path p = fs::absolute(target.path, ec);
  REPLICA_USAGE_CHECK(!fs::is_directory(p, ec), "{} '{}' is a directory; give a file name", flag,
                      path);
  if (target.in_place) {
    REPLICA_USAGE_CHECK(access(p.c_str(), W_OK) == 0, "{} '{}': cannot write to it", flag, path);
    return;
  }
  const fs::path dir = p.parent_path();
  REPLICA_USAGE_CHECK(fs::is_directory(dir, ec), "{} '{}': '{}' {}", flag, path, dir.string(),
                      fs::exists(dir, ec) ? "is not a directory" : "does not exist");
  REPLICA_USAGE_CHECK(access(dir.c_str(), W_OK) == 0, "{} '{}': cannot write into '{}'", flag,
                      path, dir.string());
}

void check_output_dir(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  fs::path dir = fs::absolute(path, ec);
  while (!dir.empty() && !fs::exists(dir, ec) && dir != dir.root_path()) dir = dir.parent_path();
  REPLICA_USAGE_CHECK(fs::is_directory(dir, ec), "{} '{}': '{}' is not a directory", flag, path,
                      dir.string());
  REPLICA_USAGE_CHECK(access(dir.c_str(), W_OK) == 0, "{} '{}': cannot write into '{}'", flag,
                      path, dir.string());
}

std::string temporary_for(const std::string& path) {
  return path + ".tmp-" + std::to_string(getpid());
}

void remove_stale_temporaries(const std::string& path) {
  std::error_code ec;
  const fs::path p = fs::absolute(path, ec);
  const std::string prefix = p.filename().string() + ".tmp-";
  for (const auto& entry : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid == getpid()) continue;
    if (kill(pid_t(pid), 0) == 0 || errno == EPERM) continue;  // that process still runs
    fs::remove_all(entry.path(), ec);  // a file, or a StagedDirectory
  }
}

void mark_temporary(const std::string& tmp) {
  g_writing = false;
  std::snprintf(g_temporary, sizeof g_temporary, "%s", tmp.c_str());
  g_writing = tmp.size() < sizeof g_temporary;
}

void clear_temporary() { g_writing = false; }

void remove_temporary_in_progress() {
  if (g_writing) unlink(g_temporary);
}

void write_file_atomically(const std::string& name, const std::string& text) {
  const OutputTarget target = output_target(name);
  const std::string& path = target.path;
  if (target.in_place) {
    std::ofstream out(path, std::ios::binary);
    out << text;
    out.flush();
    REPLICA_USAGE_CHECK(out.good(), "cannot write '{}': {}", name, std::strerror(errno));
    return;
  }
  remove_stale_temporaries(path);
  const std::string tmp = temporary_for(path);
  mark_temporary(tmp);
  bool ok;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    ok = out.good();
  }
  if (ok) ok = std::rename(tmp.c_str(), path.c_str()) == 0;
  const int err = errno;
  if (!ok) std::remove(tmp.c_str());
  clear_temporary();
  REPLICA_USAGE_CHECK(ok, "cannot write '{}': {}", name, std::strerror(err));
}

void append_file_atomically(const std::string& path, const std::string& text) {
  const OutputTarget target = output_target(path);
  const fs::path parent = fs::path(target.path).parent_path();
  DirectoryLock lock(parent.empty() ? std::string(".") : parent.string());
  std::string old;
  if (!target.in_place && fs::exists(target.path)) {
    std::ifstream in(target.path, std::ios::binary);
    std::ostringstream read;
    read << in.rdbuf();
    REPLICA_USAGE_CHECK(in.good() || in.eof(), "cannot read '{}' to add to it", path);
    old = read.str();
    if (!old.empty() && old.back() != '\n') old += '\n';
  }
  write_file_atomically(path, old + text);
}

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
  remove_stale_temporaries(base);
  staging_ = temporary_for(base);
  fs::remove_all(staging_, ec);
  fs::create_directory(staging_, ec);
  REPLICA_USAGE_CHECK(!ec, "cannot write into '{}': {}", dir_, ec.message());
}

StagedDirectory::~StagedDirectory() {
  std::error_code ec;
  if (committed_) return;
  fs::remove_all(staging_, ec);
  for (const std::string& d : created_)  // innermost first; a directory written into stays
    if (!fs::remove(d, ec)) break;
}

void StagedDirectory::commit() {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(staging_, ec)) {
    const fs::path to = fs::path(dir_) / entry.path().filename();
    fs::rename(entry.path(), to, ec);
    if (ec) throw Error(fmt::format("cannot move '{}' into place: {}", to.string(), ec.message()));
  }
  if (ec) throw Error(fmt::format("cannot read '{}': {}", staging_, ec.message()));
  for (const std::string& name : dropped_) fs::remove(fs::path(dir_) / name, ec);
  committed_ = true;
  fs::remove_all(staging_, ec);
}

}  // namespace replica
