// Reading a checkpoint, a file that may come from anywhere: every field of the safetensors
// header is checked against the file before a byte of tensor data is trusted (tools/fuzz
// exercises this on corrupt input).
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "engine/allocator.h"
#include "engine/error.h"
#include "engine/file_io.h"

namespace replica {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100000000;  // safetensors' own limit (100 MB)
constexpr int64_t kMaxDim = int64_t(1) << 40;
constexpr size_t kMaxJsonDepth = 32;  // a safetensors header needs 3 levels

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
  const Fd fd = open_regular_file(path, "a checkpoint");
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
