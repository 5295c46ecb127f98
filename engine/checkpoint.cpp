#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/output_files.h"

namespace replica {

const Tensor* Checkpoint::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

namespace {

// The 8-byte little-endian header length and the JSON header, padded to a multiple of 8 with
// spaces (as the safetensors writer does), after checking every name and tensor.
std::string encode_header(const std::string& path, const Checkpoint& ckpt) {
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
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(uint64_t(text.size()) >> (8 * i)));
  return out + text;
}

void write_contents(int fd, const std::string& header, const Checkpoint& ckpt,
                    const std::string& what) {
  write_all(fd, header.data(), header.size(), what);
  for (const auto& [name, t] : ckpt.tensors) write_all(fd, t.raw(), t.bytes(), what);
}

}  // namespace

void save_checkpoint(const std::string& path, const Checkpoint& ckpt) {
  REPLICA_CHECK(little_endian(), "checkpoints need a little-endian host");
  const std::string header = encode_header(path, ckpt);
  write_output(path, [&](int fd, const std::string& file) {
    write_contents(fd, header, ckpt, file);
  });
}

}  // namespace replica
