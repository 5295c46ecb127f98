#include "engine/output_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/error.h"
#include "engine/file_io.h"

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

// The descriptor `p` names where it is one of this process's own through the kernel's links;
// -1 otherwise. Such a link reads as the file behind the descriptor ("/home/u/log", "pipe:[81]"),
// which is not where the output goes: it goes after what the descriptor already wrote.
int own_descriptor(const fs::path& p) {
  std::error_code ec;
  const std::string s = fs::absolute(p, ec).lexically_normal().string();
  if (s == "/dev/stdout") return 1;
  if (s == "/dev/stderr") return 2;
  const std::string dirs[] = {"/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/",
                              "/proc/" + std::to_string(getpid()) + "/fd/"};
  for (const std::string& dir : dirs) {
    if (s.rfind(dir, 0) != 0) continue;
    const std::string n = s.substr(dir.size());
    if (n.empty() || n.size() > 9 || n.find_first_not_of("0123456789") != std::string::npos)
      return -1;
    return std::stoi(n);
  }
  return -1;
}

}  // namespace

OutputTarget output_target(const std::string& path) {
  std::error_code ec;
  // A link's target, followed link by link (it need not exist yet; 40 is the kernel's limit),
  // up to a descriptor's name.
  fs::path p = path;
  for (int hops = 0;; ++hops) {
    const int fd = own_descriptor(p);
    if (fd >= 0) return {path, true, fd};
    if (hops == 40 || !fs::is_symlink(p, ec)) break;
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) break;
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  OutputTarget t{p.lexically_normal().string(), false, -1};
  const fs::file_status st = fs::status(t.path, ec);
  t.in_place = fs::exists(st) && !fs::is_regular_file(st) && !fs::is_directory(st);
  return t;
}

int open_in_place(const OutputTarget& target) {
  std::fflush(nullptr);  // what this process printed comes first (std::cout writes through stdio)
  if (target.fd >= 0) return fcntl(target.fd, F_DUPFD_CLOEXEC, 0);
  return open(target.path.c_str(), O_WRONLY | O_CLOEXEC);
}

void check_output_file(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const OutputTarget target = output_target(path);
  const fs::path p = fs::absolute(target.path, ec);
  REPLICA_USAGE_CHECK(!fs::is_directory(p, ec), "{} '{}' is a directory; give a file name", flag,
                      path);
  if (target.fd >= 0) {
    const int mode = fcntl(target.fd, F_GETFL);
    REPLICA_USAGE_CHECK(mode >= 0 && (mode & O_ACCMODE) != O_RDONLY,
                        "{} '{}': descriptor {} is not open for writing", flag, path, target.fd);
    return;
  }
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

void check_weights_file(const std::string& flag, const std::string& path) {
  check_output_file(flag, path);
  REPLICA_USAGE_CHECK(path.empty() || output_target(path).fd < 0,
                      "{} '{}': weights are written to a file of their own, not into a stream "
                      "the run shares (give a file name)",
                      flag, path);
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

std::string make_temporary_directory(const std::string& prefix, const std::string& for_what) {
  // TMPDIR alone, as POSIX and mktemp(1) read it. std::filesystem::temp_directory_path() said
  // only "temp_directory_path: No such file or directory", naming neither the variable nor
  // the directory.
  const char* tmpdir = std::getenv("TMPDIR");
  const bool from_env = tmpdir != nullptr && *tmpdir != '\0';
  const std::string base = from_env ? tmpdir : "/tmp";
  const std::string where = from_env ? "TMPDIR=" + base : base;
  auto cannot = [&](const std::string& why) {
    return Error(fmt::format("cannot make a temporary directory {}: {}", for_what, why));
  };
  struct stat st {};
  if (::stat(base.c_str(), &st) != 0)
    throw cannot(errno == ENOENT ? where + " does not exist"
                                 : fmt::format("{}: {}", where, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode)) throw cannot(where + " is not a directory");
  std::string path = base + (base.back() == '/' ? "" : "/") + prefix + "XXXXXX";
  if (mkdtemp(path.data()) == nullptr)
    throw cannot(fmt::format("{}: {}", where, std::strerror(errno)));
  return path;
}

namespace {

// What names one file: "dev:inode" where it exists, else its resolved absolute path; empty for
// a device, pipe or descriptor, which are written in place and may be shared.
std::string file_identity(const OutputTarget& t) {
  if (t.fd >= 0 || t.in_place) return "";
  struct stat st {};
  if (::stat(t.path.c_str(), &st) == 0) return fmt::format("{}:{}", st.st_dev, st.st_ino);
  std::error_code ec;
  const fs::path resolved = fs::weakly_canonical(fs::absolute(t.path, ec), ec);
  return "path:" + resolved.string();
}

}  // namespace

void check_outputs_apart(const std::vector<FlagPath>& outputs, const std::vector<FlagPath>& kept,
                         const std::vector<ReadInput>& inputs) {
  std::vector<std::pair<std::string, const FlagPath*>> seen;  // (identity, output)
  for (const FlagPath& o : outputs) {
    if (o.path.empty()) continue;
    const OutputTarget target = output_target(o.path);
    for (const ReadInput& in : inputs)
      REPLICA_USAGE_CHECK(in.path.empty() || target.fd >= 0 || target.in_place ||
                              !in.reads(target.path),
                          "{} '{}' would replace a file of {} '{}', which the run reads: write "
                          "it elsewhere",
                          o.flag, o.path, in.flag, in.path);
    const std::string id = file_identity(target);
    if (id.empty()) continue;
    for (const FlagPath& k : kept)
      REPLICA_USAGE_CHECK(k.path.empty() || file_identity(output_target(k.path)) != id,
                          "{} '{}' is the file that {} keeps: give another", o.flag, o.path,
                          k.flag);
    for (const auto& [other_id, other] : seen)
      REPLICA_USAGE_CHECK(other_id != id, "{} and {} name the same file ({}): give two",
                          other->flag, o.flag, o.path);
    seen.emplace_back(id, &o);
  }
}

std::string temporary_for(const std::string& path) {
  return path + ".tmp-" + std::to_string(getpid());
}

bool stale_temporary(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return false;
  const std::string pid_text = name.substr(prefix.size());
  if (pid_text.empty() || pid_text.size() > 9 ||
      pid_text.find_first_not_of("0123456789") != std::string::npos)
    return false;
  const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
  if (pid == getpid()) return false;
  return kill(pid_t(pid), 0) != 0 && errno != EPERM;  // EPERM: it runs, as another user
}

void remove_stale_temporaries(const std::string& path) {
  std::error_code ec;
  const fs::path p = fs::absolute(path, ec);
  const std::string prefix = p.filename().string() + ".tmp-";
  for (const auto& entry : fs::directory_iterator(p.parent_path(), ec))
    if (stale_temporary(entry.path().filename().string(), prefix))
      fs::remove_all(entry.path(), ec);  // a file, or a StagedDirectory
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

void write_output(const std::string& name, const OutputWriter& write) {
  const OutputTarget target = output_target(name);
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("cannot write '{}': {}", name, why));
  };
  if (target.in_place) {  // a device, pipe or descriptor: nothing to rename, nothing to sync
    Fd fd(open_in_place(target));
    if (fd.get() < 0) throw fail(std::strerror(errno));
    try {
      write(fd.get(), name);
    } catch (const std::exception& e) {
      throw fail(e.what());
    }
    return;
  }
  // A writer killed mid-write left its <path>.tmp-<pid>: gone before this one is written.
  const std::string& path = target.path;
  remove_stale_temporaries(path);
  const std::string tmp = temporary_for(path);
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (fd.get() < 0) throw fail(std::strerror(errno));
  mark_temporary(tmp);  // a second Ctrl-C removes it before the process ends
  std::string why;
  try {
    write(fd.get(), tmp);
    // On disk before the rename: a crash after it finds the new file whole, not empty.
    if (fsync(fd.get()) != 0)
      why = fmt::format("fsync: {}", std::strerror(errno));
    else if (fd.close() != 0)
      why = fmt::format("close: {}", std::strerror(errno));
    else if (std::rename(tmp.c_str(), path.c_str()) != 0)
      why = fmt::format("cannot rename its temporary over it: {}", std::strerror(errno));
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty()) {
    fd.close();
    unlink(tmp.c_str());
  }
  clear_temporary();
  if (!why.empty()) throw fail(why);
  // The rename itself made durable. Failure here is not fatal: the file is complete.
  const fs::path dir = fs::path(path).parent_path();
  Fd d(open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() >= 0) fsync(d.get());
}

void write_file_atomically(const std::string& path, const std::string& text) {
  write_output(path, [&](int fd, const std::string& file) {
    write_all(fd, text.data(), text.size(), file);
  });
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

}  // namespace replica
