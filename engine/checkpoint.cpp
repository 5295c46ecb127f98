#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/allocator.h"
#include "engine/error.h"
#include "engine/output_files.h"

namespace replica {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100000000;  // safetensors' own limit (100 MB)
constexpr int64_t kMaxDim = int64_t(1) << 40;
constexpr size_t kMaxJsonDepth = 32;  // a safetensors header needs 3 levels

bool little_endian() {
  const uint16_t x = 1;
  uint8_t b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { close(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
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

// Reads exactly n bytes at offset; false at end of file.
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

// Whether arrays and objects in JSON text nest deeper than `limit` (strings skipped). The
// parser itself is iterative, but copying or printing a parsed value recurses once per level
// (ordered_json copies its members when an object grows): a header nested 100000 levels deep
// would overflow the stack.
bool json_deeper_than(const std::string& text, size_t limit) {
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > limit) return true;
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

const Tensor* Checkpoint::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

void save_checkpoint(const std::string& path, const Checkpoint& ckpt) {
  REPLICA_CHECK(little_endian(), "checkpoints need a little-endian host");
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, t] : ckpt.tensors) {
    if (name.empty() || name == "__metadata__")
      throw Error(fmt::format("{}: cannot save a tensor named '{}'", path, name));
    if (!names.insert(name).second)
      throw Error(fmt::format("{}: tensor name '{}' appears twice", path, name));
    if (!t.defined()) throw Error(fmt::format("{}: tensor '{}' is undefined", path, name));
    if (!t.on_host())
      throw Error(fmt::format("{}: tensor '{}' is on {}: copy it to the host first", path, name,
                              t.device().str()));
    const uint64_t bytes = t.bytes();
    header[name] = {{"dtype", dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!ckpt.metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : ckpt.metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception&) {
    throw Error(fmt::format("{}: tensor names and metadata must be valid UTF-8", path));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));

  // A writer killed mid-write left its <path>.tmp-<pid>: gone before this one is written.
  remove_stale_temporaries(path);
  const std::string tmp = temporary_for(path);
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0)
    throw Error(fmt::format("{}: cannot write checkpoint: {}: {}", path, tmp,
                            std::strerror(errno)));
  mark_temporary(tmp);  // a second Ctrl-C removes it before the process ends
  struct Unmark {
    ~Unmark() { clear_temporary(); }
  } unmark;
  try {
    write_all(fd.get(), len, sizeof len, tmp);
    write_all(fd.get(), text.data(), text.size(), tmp);
    for (const auto& [name, t] : ckpt.tensors) write_all(fd.get(), t.raw(), t.bytes(), tmp);
    if (::fsync(fd.get()) != 0)
      throw Error(fmt::format("{}: fsync failed: {}", tmp, std::strerror(errno)));
    if (fd.close() != 0)
      throw Error(fmt::format("{}: close failed: {}", tmp, std::strerror(errno)));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw Error(fmt::format("{}: cannot rename {} over it: {}", path, tmp,
                              std::strerror(errno)));
  } catch (...) {
    fd.close();
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable. Failure here is not fatal: the file is complete.
  Fd dir(::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() >= 0) ::fsync(dir.get());
}

namespace {

// One tensor as the header describes it: where its bytes lie among the data bytes.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// The header's JSON and where the data bytes start and how many there are; every way the first
// 8 + n bytes can be wrong is named.
struct Header {
  nlohmann::ordered_json json;
  uint64_t data_begin = 0, data_size = 0;
};

Header read_header(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw Error(fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode))
    throw UsageError(fmt::format("{}: is a directory, expected a checkpoint file", path));
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8)
    throw Error(fmt::format("{}: not a checkpoint: {} bytes, shorter than the 8-byte header "
                            "length",
                            path, file_size));
  uint8_t len[8];
  if (!read_at(fd, len, 8, 0, path))
    throw Error(fmt::format("{}: truncated while reading the header length", path));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n < 2 || n > kMaxHeaderBytes)
    throw Error(fmt::format("{}: not a safetensors checkpoint: header length {} is implausible",
                            path, n));
  if (n > file_size - 8)
    throw Error(fmt::format("{}: truncated: header length {} but the file has only {} bytes after "
                            "it",
                            path, n, file_size - 8));
  std::string text(n, '\0');
  if (!read_at(fd, text.data(), n, 8, path))
    throw Error(fmt::format("{}: truncated while reading the header", path));
  if (json_deeper_than(text, kMaxJsonDepth))
    throw Error(fmt::format("{}: corrupt checkpoint header: JSON nested more than {} levels deep",
                            path, kMaxJsonDepth));
  Header h;
  h.data_begin = 8 + n;
  h.data_size = file_size - h.data_begin;
  try {
    h.json = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: corrupt checkpoint header (invalid JSON: {})", path, e.what()));
  }
  if (!h.json.is_object())
    throw Error(fmt::format("{}: corrupt checkpoint header: not a JSON object", path));
  return h;
}

// One tensor's header entry, checked against the data_size bytes the file holds.
Entry parse_entry(const std::string& path, const std::string& name,
                  const nlohmann::ordered_json& v, uint64_t data_size) {
  auto bad = [&](const std::string& what) {
    return Error(fmt::format("{}: corrupt header: tensor '{}': {}", path, name, what));
  };
  if (!v.is_object()) throw bad("entry is not an object");
  if (!v.contains("dtype") || !v["dtype"].is_string()) throw bad("missing dtype");
  const std::string dt = v["dtype"].get<std::string>();
  Entry e{name, DType::F32, {}, 0, 0};
  if (dt == "F32") e.dtype = DType::F32;
  else if (dt == "I32") e.dtype = DType::I32;
  else throw bad(fmt::format("unsupported dtype '{}' (replica reads F32 and I32)", dt));
  if (!v.contains("shape") || !v["shape"].is_array()) throw bad("missing shape");
  // numel is capped just above the data size; nonzero, the product of the non-zero
  // dimensions, just above 2^40: a zero dimension must not hide a product that overflows
  // every later shape computation (shape_numel() multiplies in int64).
  uint64_t numel = 1, nonzero = 1;
  for (const auto& d : v["shape"]) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(kMaxDim))
      throw bad(fmt::format("bad dimension {} in shape {}", d.dump(), v["shape"].dump()));
    e.shape.push_back(d.get<int64_t>());
    uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && numel > (data_size + 1) / dim) numel = data_size + 1;  // capped: too large
    else numel *= dim;
    if (dim != 0)
      nonzero = nonzero > uint64_t(kMaxDim) / dim ? uint64_t(kMaxDim) + 1 : nonzero * dim;
  }
  const auto& off = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::ordered_json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    throw bad("data_offsets must be [begin, end]");
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  if (e.begin > e.end || e.end > data_size)
    throw bad(fmt::format("data_offsets [{}, {}] outside the {} data bytes (truncated file?)",
                          e.begin, e.end, data_size));
  if (numel > data_size || numel * 4 != e.end - e.begin)
    throw bad(fmt::format("shape {} needs {} bytes but data_offsets [{}, {}] hold {}",
                          v["shape"].dump(), numel > data_size ? "more than the file's" :
                          std::to_string(numel * 4), e.begin, e.end, e.end - e.begin));
  if (nonzero > uint64_t(kMaxDim))
    throw bad(fmt::format("shape {} is too large: its non-zero dimensions multiply to more "
                          "than 2^40 elements",
                          v["shape"].dump()));
  return e;
}

// The tensors, sorted by offset, must tile the data bytes exactly: no overlap, no gap, nothing
// after the last (safetensors' own rule; a gap or a tail would hide data the header does not name).
void check_layout(const std::string& path, std::vector<Entry>& entries, uint64_t data_size) {
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  uint64_t at = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < at)
      throw Error(fmt::format("{}: corrupt header: tensor '{}' [{}, {}] overlaps tensor '{}' "
                              "[{}, {}]",
                              path, e.name, e.begin, e.end, prev->name, prev->begin, prev->end));
    if (e.begin > at)
      throw Error(fmt::format("{}: corrupt header: {} unused bytes before tensor '{}' at {}",
                              path, e.begin - at, e.name, e.begin));
    at = e.end;
    prev = &e;
  }
  if (at != data_size)
    throw Error(fmt::format("{}: {} bytes after the last tensor: the header describes {} data "
                            "bytes, the file has {}",
                            path, data_size - at, at, data_size));
}

}  // namespace

Checkpoint load_checkpoint(const std::string& path) {
  REPLICA_CHECK(little_endian(), "checkpoints need a little-endian host");
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) throw UsageError(fmt::format("{}: no such checkpoint file", path));
    throw UsageError(fmt::format("{}: cannot open checkpoint: {}", path, std::strerror(errno)));
  }
  const Header h = read_header(fd.get(), path);
  std::vector<Entry> entries;
  Checkpoint ckpt;
  for (const auto& [name, v] : h.json.items()) {
    if (name != "__metadata__") {
      entries.push_back(parse_entry(path, name, v, h.data_size));
      continue;
    }
    if (!v.is_object())
      throw Error(fmt::format("{}: corrupt header: __metadata__ is not an object", path));
    for (const auto& [k, mv] : v.items()) {
      if (!mv.is_string())
        throw Error(fmt::format("{}: corrupt header: metadata '{}' is not a string", path, k));
      ckpt.metadata[k] = mv.get<std::string>();
    }
  }
  check_layout(path, entries, h.data_size);
  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(host_allocator(), e.shape, e.dtype);
    if (e.end > e.begin &&
        !read_at(fd.get(), t.raw(), e.end - e.begin, h.data_begin + e.begin, path))
      throw Error(fmt::format("{}: truncated while reading tensor '{}'", path, e.name));
    ckpt.tensors.emplace_back(e.name, std::move(t));
  }
  return ckpt;
}

}  // namespace replica
