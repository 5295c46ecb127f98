// Exact reads and writes on POSIX file descriptors, for the checkpoint writer and reader, and
// whole files for the data readers: interrupted calls retried, large transfers in pieces,
// failures as replica::Error naming the file.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace replica {

// Owns a file descriptor; close() reports what ::close() said (a late write error on NFS).
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { close(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  int get() const { return fd_; }
  int close() {
    int r = 0;
    if (fd_ >= 0) r = ::close(fd_);
    fd_ = -1;
    return r;
  }

 private:
  int fd_;
};

// Writes all n bytes; `what` names the file in an error.
void write_all(int fd, const void* data, size_t n, const std::string& what);
// Reads exactly n bytes at offset; false at end of file.
bool read_at(int fd, void* data, size_t n, uint64_t offset, const std::string& path);

// std::unique_ptr<std::FILE, FileCloser>: a stdio file closed on every path.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

// `path` opened for reading: UsageError if it is missing or unreadable, a directory, or not a
// regular file (a named pipe would block the open and every read for good; a device would read
// without end); the message says `expected` ("a checkpoint").
Fd open_regular_file(const std::string& path, const std::string& expected);

// The whole file at `path`, opened as open_regular_file does (the message says `expected`: "an
// IDX file"); Error on a read error. Its size bounds what a parser of it allocates.
std::vector<uint8_t> read_file_bytes(const std::string& path, const std::string& expected);

// Checkpoints are little-endian on disk and copied as raw bytes.
inline bool little_endian() {
  const uint16_t x = 1;
  uint8_t b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

}  // namespace replica
