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

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}


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
  const OutputTarget target = output_target(path);
  if (target.in_place) {  // a device or pipe (/dev/null): nothing to rename, nothing to sync
    Fd fd(::open(target.path.c_str(), O_WRONLY | O_CLOEXEC));
    if (fd.get() < 0)
      throw Error(fmt::format("{}: cannot write checkpoint: {}", path, std::strerror(errno)));
    write_contents(fd.get(), header, ckpt, path);
    return;
  }
  // A writer killed mid-write left its <path>.tmp-<pid>: gone before this one is written.
  remove_stale_temporaries(target.path);
  const std::string tmp = temporary_for(target.path);
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0)
    throw Error(fmt::format("{}: cannot write checkpoint: {}: {}", path, tmp,
                            std::strerror(errno)));
  mark_temporary(tmp);  // a second Ctrl-C removes it before the process ends
  struct Unmark {
    ~Unmark() { clear_temporary(); }
  } unmark;
  try {
    write_contents(fd.get(), header, ckpt, tmp);
    if (::fsync(fd.get()) != 0)
      throw Error(fmt::format("{}: fsync failed: {}", tmp, std::strerror(errno)));
    if (fd.close() != 0)
      throw Error(fmt::format("{}: close failed: {}", tmp, std::strerror(errno)));
    if (::rename(tmp.c_str(), target.path.c_str()) != 0)
      throw Error(fmt::format("{}: cannot rename {} over it: {}", path, tmp,
                              std::strerror(errno)));
  } catch (...) {
    fd.close();
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable. Failure here is not fatal: the file is complete.
  Fd dir(::open(dir_of(target.path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() >= 0) ::fsync(dir.get());
}

}  // namespace replica
