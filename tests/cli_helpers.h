// Helpers for tests that run the programs: a temp directory, small MNIST-format data sets,
// running a command to capture its exit code and output, what a bad invocation must print, a
// JSON file read back, and the message of an error thrown in-process.
#pragma once
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/error.h"

namespace test {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "replica-test-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str(const std::string& name = "") const { return (path / name).string(); }
  std::string file(const std::string& name) const { return str(name); }
  size_t entries() const { return size_t(std::distance(fs::directory_iterator(path), {})); }
};

inline std::vector<uint8_t> file_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

inline std::string read_text(const std::string& path) {
  auto bytes = file_bytes(path);
  return std::string(bytes.begin(), bytes.end());
}

inline void put_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

inline void write_be32(std::ofstream& out, uint32_t v) {
  unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                        static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
  out.write(reinterpret_cast<char*>(b), 4);
}

// Writes raw (uncompressed) IDX image and label files of `n` 28x28 samples whose label is
// learnable from the pixels (a bright band whose position is the class).
inline void write_mnist_split(const fs::path& dir, const std::string& prefix, int n,
                              unsigned seed) {
  std::mt19937 rng(seed);
  std::ofstream img(dir / (prefix + "-images-idx3-ubyte"), std::ios::binary);
  std::ofstream lab(dir / (prefix + "-labels-idx1-ubyte"), std::ios::binary);
  write_be32(img, 0x00000803);
  write_be32(img, n);
  write_be32(img, 28);
  write_be32(img, 28);
  write_be32(lab, 0x00000801);
  write_be32(lab, n);
  for (int i = 0; i < n; ++i) {
    unsigned char label = static_cast<unsigned char>(rng() % 10);
    for (int y = 0; y < 28; ++y)
      for (int x = 0; x < 28; ++x) {
        bool band = (y / 3) == label;
        unsigned char v = static_cast<unsigned char>(band ? 200 + rng() % 56 : rng() % 40);
        img.put(static_cast<char>(v));
      }
    lab.put(static_cast<char>(label));
  }
}

inline void write_mnist_dir(const fs::path& dir, int train = 512, int test = 128) {
  fs::create_directories(dir);
  write_mnist_split(dir, "train", train, 1);
  write_mnist_split(dir, "t10k", test, 2);
}

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command with a time limit (coreutils timeout), capturing its output.
inline RunResult run(const std::string& command, int timeout_s = 120) {
  RunResult r;
  std::string full = "timeout -k 5 " + std::to_string(timeout_s) + " " + command + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, got);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

inline std::string bin(const std::string& name) { return std::string(REPLICA_BIN_DIR) + "/" + name; }
inline const std::string kTrain = bin("replica-train");  // what most suites run

// A port per test run, away from the default 29500 (other jobs on the machine) and below the
// ephemeral range (32768 up): 30 per process, a block chosen by the process id.
inline int next_port() {
  static int port = 29600 + (getpid() % 100) * 30;
  return port++;
}

// "replica-launch --nproc-per-node N --master-port P -- " (a fresh port each time).
inline std::string launch(int ranks) {
  return bin("replica-launch") + " --nproc-per-node " + std::to_string(ranks) +
         " --master-port " + std::to_string(next_port()) + " -- ";
}

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The message of the replica::Error f() throws, "" if it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const replica::Error& e) {
    return e.what();
  }
  return "";
}

// A bad invocation of `program` (a program in the build's bin/): exit code 2 (usage) or 1, and
// exactly one output line, "program: error: ...", that contains `must_contain`.
inline void expect_clean_error(const std::string& program, const std::string& args,
                               const std::string& must_contain) {
  RunResult r = run(bin(program) + " " + args, 60);
  INFO("args: " << args << "\noutput: " << r.output);
  CHECK((r.exit_code == 1 || r.exit_code == 2));
  CHECK(count_lines(r.output) == 1);
  CHECK(r.output.rfind(program + ": error: ", 0) == 0);
  CHECK(r.output.find(must_contain) != std::string::npos);
}

// The same for replica-train, the program most suites run.
inline void expect_train_error(const std::string& args, const std::string& must_contain) {
  expect_clean_error("replica-train", args, must_contain);
}

}  // namespace test
