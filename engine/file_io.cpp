#include "engine/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>

#include "engine/error.h"

namespace replica {

void write_all(int fd, const void* data, size_t n, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("{}: write failed: {}", what, std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

bool read_at(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min<size_t>(n, size_t(1) << 30), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("{}: read failed: {}", path, std::strerror(errno)));
    }
    if (r == 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return true;
}

Fd open_regular_file(const std::string& path, const std::string& expected) {
  // O_NONBLOCK: open() of a named pipe would otherwise wait for a writer, for good.
  Fd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) throw UsageError(fmt::format("{}: no such file", path));
    throw UsageError(fmt::format("{}: cannot open: {}", path, std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    throw UsageError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode))
    throw UsageError(fmt::format("{}: is a directory, expected {}", path, expected));
  if (!S_ISREG(st.st_mode))
    throw UsageError(fmt::format("{}: not a regular file (a pipe, socket or device), expected {}",
                                 path, expected));
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::vector<uint8_t> read_file_bytes(const std::string& path, const std::string& expected) {
  Fd fd = open_regular_file(path, expected);
  struct stat st {};
  ::fstat(fd.get(), &st);
  std::vector<uint8_t> bytes(static_cast<size_t>(st.st_size));
  if (!bytes.empty() && !read_at(fd.get(), bytes.data(), bytes.size(), 0, path))
    throw Error(fmt::format("{}: read error: the file shrank below {} bytes", path, bytes.size()));
  return bytes;
}

}  // namespace replica
