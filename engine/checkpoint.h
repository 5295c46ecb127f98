// Checkpoints in the safetensors format, so PyTorch users can read replica's weights with
// safetensors.torch.load_file (layout and naming conventions: docs/checkpoint-format.md).
//   u64 little-endian N | N bytes of JSON header (space-padded to a multiple of 8) | raw data
// Header: {"name": {"dtype": "F32"|"I32", "shape": [...], "data_offsets": [begin, end]}, ...,
//          "__metadata__": {"key": "string value", ...}}; offsets are relative to the data
// section, tensors are stored contiguously in order, little-endian.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace replica {

struct Checkpoint {
  std::vector<std::pair<std::string, Tensor>> tensors;  // host tensors (host_allocator())
  std::map<std::string, std::string> metadata;
  const Tensor* find(const std::string& name) const;   // nullptr when absent
};

// Writes `path` atomically: to "<path>.tmp-<pid>", fsync, rename over `path`, fsync the
// directory. A crash or an error never leaves a half-written file at `path` (nor the temporary).
// Tensors must be defined host tensors (on_host()), names unique, non-empty and not
// "__metadata__". Errors name the path and the problem.
void save_checkpoint(const std::string& path, const Checkpoint& ckpt);

// Reads and validates everything: header length against the file size, the JSON, dtypes
// (F32, I32), shapes, data_offsets inside the data section and consistent with the shape,
// no overlaps or gaps, metadata values strings. Tensors come back in data order, on the host.
// Errors (UsageError for a missing file, Error otherwise) name the file and the problem.
Checkpoint load_checkpoint(const std::string& path);

}  // namespace replica
