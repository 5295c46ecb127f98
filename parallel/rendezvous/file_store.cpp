// FileStore (store.h). The temporaries are named per process and per write (a counter), as
// several threads of one rank may set keys at once; engine/output_files' single-writer files do
// not allow that.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "engine/error.h"
#include "engine/file_io.h"
#include "parallel/rendezvous/store.h"

namespace replica {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

std::string errno_text() { return std::strerror(errno); }

// Polls `ready` with a growing sleep (1 ms .. 50 ms) until it returns true or the deadline.
template <typename F>
bool poll_until(Clock::time_point deadline, F ready) {
  milliseconds nap(1);
  for (;;) {
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::min(
        nap, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()) + milliseconds(1)));
    nap = std::min(nap * 2, milliseconds(50));
  }
}

bool read_file(const std::string& path, Bytes* out) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno != ENOENT)
      throw Error(fmt::format("file store: cannot read '{}' ({})", path, errno_text()));
    return false;
  }
  out->clear();
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd.get(), buf, sizeof buf)) > 0) out->insert(out->end(), buf, buf + n);
  if (n != 0) throw Error(fmt::format("file store: cannot read '{}' ({})", path, errno_text()));
  return true;
}

void write_atomically(const std::string& dir, const std::string& path, const Bytes& value) {
  static std::atomic<uint64_t> counter{0};
  std::string tmp = fmt::format("{}/.tmp-{}-{}", dir, getpid(), counter++);
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0)
    throw Error(fmt::format("file store: cannot create '{}' ({})", tmp, errno_text()));
  size_t off = 0;
  while (off < value.size()) {
    ssize_t n = write(fd.get(), value.data() + off, value.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string why = errno_text();
      fd.close();
      unlink(tmp.c_str());
      throw Error(fmt::format("file store: cannot write '{}' ({})", tmp, why));
    }
    off += static_cast<size_t>(n);
  }
  fd.close();
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    unlink(tmp.c_str());
    throw Error(fmt::format("file store: cannot rename '{}' to '{}' ({})", tmp, path, why));
  }
}

}  // namespace

FileStore::FileStore(const std::string& dir, milliseconds timeout) : Store(timeout), dir_(dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  REPLICA_USAGE_CHECK(std::filesystem::is_directory(dir),
                      "cannot create the file store directory '{}' ({})", dir,
                      ec ? ec.message() : "not a directory");
}

// Safe characters stay, others become %XX; long keys become two 64-bit hashes.
std::string FileStore::path_for(const std::string& key) const {
  std::string name = "k-";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-')
      name += static_cast<char>(c);
    else
      name += fmt::format("%{:02X}", c);
  }
  if (name.size() > 200)
    name = fmt::format("h-{:016x}{:016x}", text_hash(key),
                       text_hash(key, 0x9e3779b97f4a7c15ull));
  return dir_ + "/" + name;
}

// The store's own files only: keys ("k-", "h-"), counter locks ("l") and temporaries (".tmp-").
void FileStore::remove_keys() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("k-", 0) == 0 || name.rfind("h-", 0) == 0 || name.rfind("l", 0) == 0 ||
        name.rfind(".tmp-", 0) == 0)
      std::filesystem::remove(entry.path(), ec);
  }
}

void FileStore::set(const std::string& key, const Bytes& value) {
  check_key(key, "set");
  check_value(key, value);
  write_atomically(dir_, path_for(key), value);
}

Bytes FileStore::get(const std::string& key) {
  check_key(key, "get");
  Bytes out;
  std::string path = path_for(key);
  if (!poll_until(Clock::now() + timeout_, [&] { return read_file(path, &out); }))
    throw Error(fmt::format("store get('{}') timed out after {}: the key was never set (store {})",
                            key, format_duration(timeout_), describe()));
  return out;
}

std::vector<std::string> FileStore::wait_for(const std::vector<std::string>& keys,
                                             milliseconds timeout) {
  for (const auto& k : keys) check_key(k, "wait");
  std::vector<std::string> missing;
  poll_until(Clock::now() + timeout, [&] {
    missing.clear();
    for (const auto& k : keys)
      if (access(path_for(k).c_str(), F_OK) != 0) missing.push_back(k);
    return missing.empty();
  });
  return missing;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  check_key(key, "add");
  std::string path = path_for(key);
  std::string lock_path = dir_ + "/l" + path.substr(dir_.size() + 2);
  Fd lock(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));  // closing unlocks
  if (lock.get() < 0)  // the directory's I/O error, not the engine's: no source line in it
    throw Error(
        fmt::format("file store: cannot open the lock '{}' ({})", lock_path, errno_text()));
  while (flock(lock.get(), LOCK_EX) != 0)
    if (errno != EINTR)
      throw Error(fmt::format("file store: cannot lock '{}' ({})", lock_path, errno_text()));
  Bytes old;
  const bool had = read_file(path, &old);
  const std::string text = to_string(old);
  int64_t sum = 0;
  const std::string why = add_to_counter(had ? &text : nullptr, delta, &sum);
  if (!why.empty()) throw Error(fmt::format("store add('{}'): {}", key, why));
  write_atomically(dir_, path, to_bytes(std::to_string(sum)));
  return sum;
}

}  // namespace replica
