// libFuzzer target for the checkpoint reader (engine/checkpoint.h, safetensors), built and run by
// tools/fuzz.sh. Each input is the whole file: it goes into an in-memory file (memfd) that
// load_checkpoint() opens by its /proc/self/fd path. Bad input may only throw replica::Error.
// A file that loads must describe itself: each tensor's bytes match its shape, and when
// save_checkpoint() accepts what was loaded, loading that again gives the same tensors.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/checkpoint.h"
#include "engine/error.h"

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_checkpoint: %s\n", what.c_str());
  std::abort();
}

// A memfd holding the current input.
struct Input {
  int fd = -1;
  std::string path;
  Input() {
    fd = memfd_create("fuzz-checkpoint", MFD_CLOEXEC);
    if (fd < 0) fail("memfd_create failed");
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void put(const uint8_t* data, size_t size) {
    if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))
      fail("cannot write the input to the memfd");
  }
};

// A fresh temporary directory (tmpfs when there is one), removed with what it holds.
struct TempDir {
  std::string dir;
  TempDir() {
    char shm[] = "/dev/shm/replica-fuzz-XXXXXX";
    char tmp[] = "/tmp/replica-fuzz-XXXXXX";
    const char* d = mkdtemp(shm) ? shm : mkdtemp(tmp);
    if (!d) fail("cannot create a temporary directory");
    dir = d;
  }
  ~TempDir() {
    unlink((dir + "/saved.safetensors").c_str());
    rmdir(dir.c_str());
  }
};

bool same(const replica::Checkpoint& a, const replica::Checkpoint& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [na, ta] = a.tensors[i];
    const auto& [nb, tb] = b.tensors[i];
    if (na != nb || ta.shape() != tb.shape() || ta.dtype() != tb.dtype() ||
        ta.bytes() != tb.bytes() || std::memcmp(ta.raw(), tb.raw(), ta.bytes()) != 0)
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Input input;
  input.put(data, size);
  replica::Checkpoint ckpt;
  try {
    ckpt = replica::load_checkpoint(input.path);
  } catch (const replica::Error&) {
    return 0;
  }
  size_t total = 0;
  for (const auto& [name, t] : ckpt.tensors) {
    if (!t.defined() || !t.on_host()) fail("tensor '" + name + "' came back undefined");
    total += t.bytes();
  }
  if (total > size) fail("the tensors hold more bytes than the file");
  TempDir tmp;
  const std::string saved = tmp.dir + "/saved.safetensors";
  try {
    replica::save_checkpoint(saved, ckpt);
  } catch (const replica::Error&) {
    return 0;  // e.g. a tensor named "": readable, but save_checkpoint refuses to write it
  }
  if (!same(ckpt, replica::load_checkpoint(saved)))
    fail("a loaded checkpoint, saved and loaded again, differs");
  return 0;
}
