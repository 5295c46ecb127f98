// Checkpoints (safetensors layout): bit-exact round trips with metadata, the exact byte layout
// PyTorch's safetensors expects, atomic writes, and every kind of corrupt file.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/allocator.h"
#include "engine/checkpoint.h"
#include "cli_helpers.h"
#include "engine/error.h"

namespace fs = std::filesystem;
using namespace replica;

namespace {

using test::file_bytes;
using test::TempDir;
using test::put_bytes;
using test::error_of;
using test::contains;

Tensor f32(const Shape& shape, float start) {
  Tensor t = Tensor::empty(host_allocator(), shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = start + 0.37f * float(i);
  return t;
}

Checkpoint sample() {
  Checkpoint c;
  c.tensors.emplace_back("model.conv1.weight", f32({4, 1, 3, 3}, -1.5f));
  c.tensors.emplace_back("model.fc.bias", f32({10}, 0.25f));
  Tensor special = f32({6}, 0);
  special.f32()[0] = std::numeric_limits<float>::quiet_NaN();
  special.f32()[1] = -0.0f;
  special.f32()[2] = std::numeric_limits<float>::infinity();
  special.f32()[3] = std::numeric_limits<float>::denorm_min();
  c.tensors.emplace_back("optim.exp_avg", special);
  Tensor steps = Tensor::empty(host_allocator(), {3}, DType::I32);
  steps.i32()[0] = -7, steps.i32()[1] = 0, steps.i32()[2] = 2147483647;
  c.tensors.emplace_back("optim.step", steps);
  c.tensors.emplace_back("buffer.bn1.running_mean", f32({}, 3.0f));   // a scalar
  c.tensors.emplace_back("model.empty", f32({0, 5}, 0));              // zero elements
  c.metadata = {{"format", "replica-checkpoint-v1"}, {"model", "resnet18"}, {"epoch", "3"},
                {"step", "1200"}, {"optimizer", "adam"}, {"seed", "42"},
                {"note", "quotes \" and \\ and unicode \xc3\xa9 survive"}};
  return c;
}

// Header JSON and data section of a saved file.
struct Parsed {
  uint64_t n;
  nlohmann::json header;
  std::vector<uint8_t> data;
};
Parsed parse(const std::vector<uint8_t>& b) {
  Parsed p;
  p.n = 0;
  for (int i = 0; i < 8; ++i) p.n |= uint64_t(b[size_t(i)]) << (8 * i);
  p.header = nlohmann::json::parse(std::string(b.begin() + 8, b.begin() + 8 + long(p.n)));
  p.data.assign(b.begin() + 8 + long(p.n), b.end());
  return p;
}

// Builds a file from a header text and data bytes.
std::vector<uint8_t> build(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> b(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) b[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(b.data() + 8 + header.size(), data.data(), data.size());
  return b;
}

}  // namespace

TEST_CASE("checkpoint: round trip is bit-exact, with metadata and order") {
  TempDir d;
  Checkpoint c = sample();
  save_checkpoint(d.file("a.safetensors"), c);
  Checkpoint r = load_checkpoint(d.file("a.safetensors"));
  CHECK(r.metadata == c.metadata);
  REQUIRE(r.tensors.size() == c.tensors.size());
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const auto& [name, t] = c.tensors[i];
    CAPTURE(name);
    CHECK(r.tensors[i].first == name);
    const Tensor& u = r.tensors[i].second;
    CHECK(u.shape() == t.shape());
    CHECK(u.dtype() == t.dtype());
    CHECK(u.on_host());
    CHECK(std::memcmp(u.raw(), t.raw(), t.bytes()) == 0);
  }
  REQUIRE(r.find("optim.step") != nullptr);
  CHECK(r.find("optim.step")->i32()[2] == 2147483647);
  CHECK(r.find("nope") == nullptr);
  CHECK(std::isnan(r.find("optim.exp_avg")->f32()[0]));
  CHECK(std::signbit(r.find("optim.exp_avg")->f32()[1]));
  // Saving again over the same path replaces it; no temporary left behind.
  c.metadata["epoch"] = "4";
  save_checkpoint(d.file("a.safetensors"), c);
  CHECK(load_checkpoint(d.file("a.safetensors")).metadata.at("epoch") == "4");
  CHECK(d.entries() == 1);
  // An empty checkpoint is valid too.
  save_checkpoint(d.file("empty.safetensors"), Checkpoint{});
  CHECK(load_checkpoint(d.file("empty.safetensors")).tensors.empty());
}

TEST_CASE("checkpoint: the byte layout is safetensors") {
  TempDir d;
  Checkpoint c = sample();
  save_checkpoint(d.file("a.safetensors"), c);
  auto b = file_bytes(d.file("a.safetensors"));
  Parsed p = parse(b);
  CHECK(p.n % 8 == 0);
  CHECK(b[8] == '{');
  CHECK(p.header["__metadata__"]["format"] == "replica-checkpoint-v1");
  CHECK(p.header["model.conv1.weight"]["dtype"] == "F32");
  CHECK(p.header["model.conv1.weight"]["shape"] == nlohmann::json::array({4, 1, 3, 3}));
  CHECK(p.header["model.conv1.weight"]["data_offsets"] == nlohmann::json::array({0, 144}));
  CHECK(p.header["model.fc.bias"]["data_offsets"] == nlohmann::json::array({144, 184}));
  CHECK(p.header["optim.step"]["dtype"] == "I32");
  CHECK(p.header["buffer.bn1.running_mean"]["shape"] == nlohmann::json::array());
  // Data section: the tensors back to back, little-endian.
  uint64_t total = 0;
  for (auto& [name, t] : c.tensors) {
    auto off = p.header[name]["data_offsets"];
    CHECK(off[0].get<uint64_t>() == total);
    CHECK(std::memcmp(p.data.data() + total, t.raw(), t.bytes()) == 0);
    total += t.bytes();
  }
  CHECK(p.data.size() == total);
  float first;
  std::memcpy(&first, p.data.data(), 4);
  CHECK(first == -1.5f);
  // A header written by another tool (Python safetensors: sorted keys, no metadata) loads.
  std::vector<uint8_t> data(12);
  float v[3] = {1.0f, 2.0f, 3.0f};
  std::memcpy(data.data(), v, 12);
  put_bytes(d.file("py.safetensors"),
            build(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", data));
  Checkpoint py = load_checkpoint(d.file("py.safetensors"));
  REQUIRE(py.find("w") != nullptr);
  CHECK(py.find("w")->f32()[2] == 3.0f);
  CHECK(py.metadata.empty());
}

TEST_CASE("checkpoint: truncated files at every cut point are errors") {
  TempDir d;
  save_checkpoint(d.file("a"), sample());
  auto b = file_bytes(d.file("a"));
  for (size_t cut = 0; cut < b.size(); cut += (cut < 16 ? 1 : 5)) {
    CAPTURE(cut);
    put_bytes(d.file("t"), {b.begin(), b.begin() + long(cut)});
    std::string e = error_of([&] { load_checkpoint(d.file("t")); });
    CHECK_FALSE(e.empty());
    CHECK(contains(e, d.file("t") + ": "));
  }
  put_bytes(d.file("t"), {b.begin(), b.end() - 1});
  CHECK(contains(error_of([&] { load_checkpoint(d.file("t")); }), "outside the"));
  put_bytes(d.file("t"), {b.begin(), b.begin() + 4});
  CHECK(contains(error_of([&] { load_checkpoint(d.file("t")); }), "shorter than the 8-byte"));
  put_bytes(d.file("t"), {b.begin(), b.begin() + 40});
  CHECK(contains(error_of([&] { load_checkpoint(d.file("t")); }), "truncated: header length"));
  // Trailing bytes after the last tensor.
  auto extra = b;
  extra.push_back(0);
  put_bytes(d.file("x"), extra);
  CHECK(contains(error_of([&] { load_checkpoint(d.file("x")); }), "1 bytes after the last tensor"));
}

TEST_CASE("checkpoint: corrupt headers and bad offsets are errors naming the problem") {
  TempDir d;
  std::string p = d.file("bad");
  std::vector<uint8_t> data(16, 0);
  auto expect = [&](const std::string& header, const std::string& what,
                    const std::vector<uint8_t>& bytes) {
    put_bytes(p, build(header, bytes));
    std::string e = error_of([&] { load_checkpoint(p); });
    CAPTURE(header);
    CAPTURE(e);
    CHECK(contains(e, p + ": "));
    CHECK(contains(e, what));
  };
  expect(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)", "invalid JSON", data);
  expect(R"([1, 2, 3])", "not a JSON object", data);
  expect(R"({"a": 5})", "entry is not an object", data);
  expect(R"({"a": {"shape": [4], "data_offsets": [0, 16]}})", "missing dtype", data);
  expect(R"({"a": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}})",
         "unsupported dtype 'F16'", data);
  expect(R"({"a": {"dtype": "F32", "data_offsets": [0, 16]}})", "missing shape", data);
  expect(R"({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", "bad dimension",
         data);
  expect(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]}})", "bad dimension",
         data);
  expect(R"({"a": {"dtype": "F32", "shape": [4]}})", "data_offsets must be", data);
  expect(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0]}})", "data_offsets must be",
         data);
  expect(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
         "outside the 16 data bytes", data);
  expect(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [12, 4]}})", "outside", data);
  expect(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})",
         "shape [3] needs 12 bytes", data);
  expect(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})",
         "needs more than", data);
  expect(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
         "overlaps tensor 'a'", data);
  expect(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
         "8 unused bytes before tensor 'a'", data);
  expect(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
         "8 bytes after the last tensor", data);
  expect(R"({"__metadata__": {"epoch": 3},
             "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
         "metadata 'epoch' is not a string", data);
  expect(R"({"__metadata__": [1]})", "__metadata__ is not an object", {});
  // Header length field lies.
  auto b = build("{}", {});
  b[0] = 0xff, b[5] = 0x7f;
  put_bytes(p, b);
  CHECK(contains(error_of([&] { load_checkpoint(p); }), "implausible"));
  b = build("{}", {});
  b[0] = 200;
  put_bytes(p, b);
  CHECK(contains(error_of([&] { load_checkpoint(p); }), "truncated: header length 200"));
  // Not a checkpoint at all.
  std::string text = "this is a text file, not a checkpoint at all";
  put_bytes(p, std::vector<uint8_t>(text.begin(), text.end()));
  CHECK_FALSE(error_of([&] { load_checkpoint(p); }).empty());
  // Missing file and directory: UsageError.
  CHECK_THROWS_AS(load_checkpoint(d.file("missing.safetensors")), UsageError);
  CHECK(contains(error_of([&] { load_checkpoint(d.file("missing")); }), "missing: no such file"));
  CHECK_THROWS_AS(load_checkpoint(d.path.string()), UsageError);
  CHECK(contains(error_of([&] { load_checkpoint(d.path.string()); }), "is a directory"));
  // A named pipe: refused at once (opening it would wait for a writer, for good). In a child
  // with an alarm, so that a reader that blocks fails the test instead of hanging it.
  REQUIRE(::mkfifo(d.file("pipe").c_str(), 0600) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::alarm(10);
    const std::string e = error_of([&] { load_checkpoint(d.file("pipe")); });
    ::_exit(contains(e, "pipe: not a regular file (a pipe, socket or device), expected a "
                        "checkpoint") ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0),
                "the reader of a named pipe did not refuse it (status " << status << ")");
  // Random byte flips in a good file: an error or a valid load, never a crash.
  save_checkpoint(d.file("good"), sample());
  auto good = file_bytes(d.file("good"));
  for (size_t pos = 0; pos < good.size(); pos += 3) {
    auto bad = good;
    bad[pos] ^= 0x41;
    put_bytes(p, bad);
    try {
      load_checkpoint(p);
    } catch (const Error&) {
    }
  }
}

TEST_CASE("checkpoint: atomic write leaves no temporary and never a partial file") {
  TempDir d;
  std::string path = d.file("model.safetensors");
  save_checkpoint(path, sample());
  auto before = file_bytes(path);
  // A save that fails part-way (a device tensor, a duplicate name) leaves the old file intact.
  Checkpoint dup = sample();
  dup.tensors.push_back(dup.tensors[0]);
  CHECK(contains(error_of([&] { save_checkpoint(path, dup); }), "appears twice"));
  Checkpoint undefined = sample();
  undefined.tensors.emplace_back("model.missing", Tensor());
  CHECK(contains(error_of([&] { save_checkpoint(path, undefined); }), "is undefined"));
  Checkpoint reserved;
  reserved.tensors.emplace_back("__metadata__", f32({1}, 0));
  CHECK_THROWS_AS(save_checkpoint(path, reserved), Error);
  Checkpoint bad_utf8;
  bad_utf8.metadata["model"] = "\xff\xfe";
  CHECK(contains(error_of([&] { save_checkpoint(path, bad_utf8); }), "valid UTF-8"));
  CHECK(file_bytes(path) == before);
  CHECK(d.entries() == 1);
  // Writing into a directory that does not exist: a clear error, nothing created.
  const std::string nowhere = d.file("no/such/dir/x.safetensors");
  std::string e = error_of([&] { save_checkpoint(nowhere, sample()); });
  CHECK(contains(e, "cannot write '" + nowhere + "': No such file or directory"));
  CHECK(d.entries() == 1);
  // A read-only directory (skipped when running as root, which may write anyway).
  if (::geteuid() != 0) {
    fs::path ro = d.path / "ro";
    fs::create_directories(ro);
    save_checkpoint((ro / "m").string(), sample());
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THROWS_AS(save_checkpoint((ro / "m").string(), Checkpoint{}), Error);
    fs::permissions(ro, fs::perms::owner_all);
    CHECK(file_bytes((ro / "m").string()) == before);
    CHECK(size_t(std::distance(fs::directory_iterator(ro), {})) == 1);
  }
  // Rename over a directory fails after the temporary was written: it is removed again.
  fs::create_directories(d.path / "isdir");
  fs::create_directories(d.path / "isdir" / "x");
  CHECK(contains(error_of([&] { save_checkpoint((d.path / "isdir").string(), sample()); }),
                 "cannot rename"));
  size_t n = 0;
  for (auto& entry : fs::directory_iterator(d.path))
    n += entry.path().filename().string().find(".tmp-") != std::string::npos;
  CHECK(n == 0);
}

// A process killed while writing leaves <path>.tmp-<pid>: the next write of the same file
// removes it, never a temporary of a process that still runs.
TEST_CASE("checkpoint: temporaries of dead writers are removed by the next write") {
  TempDir d;
  const std::string path = d.file("checkpoint.safetensors");
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  REQUIRE(dead > 0);
  waitpid(dead, nullptr, 0);  // reaped: that pid runs no process now
  const std::string stale = path + ".tmp-" + std::to_string(dead);
  const std::string alive = path + ".tmp-" + std::to_string(getppid());
  const std::string other = d.file("other.safetensors.tmp-" + std::to_string(dead));
  const std::string odd = path + ".tmp-notapid";
  for (const auto& f : {stale, alive, other, odd}) put_bytes(f, {1, 2, 3});
  save_checkpoint(path, sample());
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(alive));  // its writer may still be writing
  CHECK(fs::exists(other));  // another file's
  CHECK(fs::exists(odd));
  CHECK(load_checkpoint(path).tensors.size() == sample().tensors.size());
}

// Inputs that once crashed the reader (tools/fuzz/fuzz_checkpoint.cpp runs it on random files).
TEST_CASE("checkpoint: headers that crashed the reader are errors") {
  TempDir d;
  std::string p = d.file("bad");
  auto load_error = [&](const std::string& header) {
    put_bytes(p, build(header, {}));
    return error_of([&] { load_checkpoint(p); });
  };
  // A zero dimension made the shape's size 0 while its other dimensions multiply past int64
  // (UB in shape_numel()).
  std::string e = load_error(R"({"a": {"dtype": "F32", "shape": [1099511627776, 1099511627776, 0],
                                        "data_offsets": [0, 0]}})");
  CHECK_MESSAGE(contains(e, "tensor 'a': shape [1099511627776,1099511627776,0] is too large"), e);
  CHECK(contains(load_error(R"({"a": {"dtype": "I32", "shape": [0, 2, 1099511627776],
                                     "data_offsets": [0, 0]}})"),
                 "is too large"));
  put_bytes(p, build(R"({"a": {"dtype": "F32", "shape": [0, 1099511627776],
                               "data_offsets": [0, 0]}})",
                     {}));
  Checkpoint empty = load_checkpoint(p);  // 2^40 is still a legal dimension of an empty tensor
  REQUIRE(empty.tensors.size() == 1);
  CHECK(empty.tensors[0].second.numel() == 0);
  // A shape nested 200000 arrays deep overflowed the stack: ordered_json copies an object's
  // members (recursively) when the object grows, and the error message printed the shape.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  e = load_error(R"({"a": {"dtype": "F32", "shape": [)" + deep + R"(], "data_offsets": [0, 0]}})");
  CHECK_MESSAGE(contains(e, p + ": corrupt checkpoint header: JSON nested more than 32 levels"), e);
  CHECK(contains(load_error(R"({"__metadata__": {"k": )" + deep + "}}"), "nested more than"));
  CHECK(contains(load_error(deep), "nested more than"));
  // Brackets inside strings do not count; 32 levels are still read (and rejected as a tensor).
  CHECK(load_error(R"({"__metadata__": {"k": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"{{"}})").empty());
  CHECK(contains(load_error(R"({"a": )" + std::string(31, '[') + std::string(31, ']') + "}"),
                 "tensor 'a': entry is not an object"));
}
