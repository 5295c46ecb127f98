// engine/output_files: a set of outputs committed as one (replica-bench --report's directory)
// holds the old set or the new one after commit(), never some of each; and an output named by
// one of the process's descriptors is written through it; a temporary directory that cannot be
// made says why in one line. (replica-train's outputs as a user meets them: test_outputs.cpp.)
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cli_helpers.h"
#include "env_guard.h"
#include "engine/error.h"
#include "engine/output_files.h"
#include "engine/staged_directory.h"

using namespace replica;
namespace fs = test::fs;

namespace {

// Every file and directory under `dir` (relative name -> contents, "<dir>" for a directory).
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = fs::relative(e.path(), dir).string();
    files[name] = e.is_directory() ? "<dir>" : test::read_text(e.path().string());
  }
  return files;
}

void put_text(const fs::path& p, const std::string& text) {
  test::put_bytes(p.string(), std::vector<uint8_t>(text.begin(), text.end()));
}

// An earlier report in `dir`: its text, its traces directory, and `more` files.
void old_report(const fs::path& dir, const std::map<std::string, std::string>& more) {
  fs::create_directories(dir / "traces");
  put_text(dir / "report.md", "old report");
  put_text(dir / "traces" / "rank0.json", "an old trace");
  for (const auto& [name, text] : more) put_text(dir / name, text);
}

}  // namespace

TEST_CASE("commit: the new set replaces the old, files and directories alike; others stay") {
  test::TempDir tmp;
  const fs::path dir = tmp.path / "report";
  old_report(dir, {{"plots", "a file where the new set has a directory"},
                   {"compare.jsonl", "an earlier report's rows"},
                   {"notes.txt", "the user's"}});
  StagedDirectory staged(dir.string());
  const fs::path in = staged.path();
  put_text(in / "report.md", "new report");
  fs::create_directory(in / "plots");
  put_text(in / "plots" / "scaling.svg", "<svg/>");
  put_text(in / "traces", "a file where the old set had a directory");
  staged.drop("compare.jsonl");
  staged.commit();  // moved one by one it failed halfway: a file over a directory
  const std::map<std::string, std::string> want = {
      {"report.md", "new report"},
      {"plots", "<dir>"},
      {"plots/scaling.svg", "<svg/>"},
      {"traces", "a file where the old set had a directory"},
      {"notes.txt", "the user's"}};
  CHECK(snapshot(dir) == want);  // and no staging directory left
}

TEST_CASE("commit: a move that fails puts every old file back") {
  // A directory moved to another parent needs write permission on itself (its ".." changes),
  // which root has anyway: as root the commit runs in a child process as user "nobody".
  test::TempDir tmp;
  const fs::path dir = tmp.path / "report";
  old_report(dir, {{"results.jsonl", "old rows"}});
  const bool root = geteuid() == 0;
  const uid_t user = root ? 65534 : geteuid();
  bool owned = true;
  if (root) {
    owned = chown(tmp.path.c_str(), user, user) == 0;
    for (const auto& e : fs::recursive_directory_iterator(tmp.path))
      owned = owned && lchown(e.path().c_str(), user, user) == 0;
  }
  if (!owned) {
    MESSAGE("SKIPPED: cannot give the files to user 65534 (a user namespace without it?)");
    return;
  }
  fs::permissions(dir / "traces", fs::perms::owner_read | fs::perms::owner_exec);
  const auto old = snapshot(dir);

  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[0]);
    std::string said = "committed";
    if (root && (setgid(user) != 0 || setuid(user) != 0)) {
      said = "SKIPPED: cannot become user 65534";
    } else if (access(dir.c_str(), W_OK) != 0) {
      said = "SKIPPED: user 65534 cannot reach " + dir.string() + " (TMPDIR's parents?)";
    } else {
      try {
        StagedDirectory staged(dir.string());
        put_text(fs::path(staged.path()) / "report.md", "new report");
        put_text(fs::path(staged.path()) / "results.jsonl", "new rows");
        put_text(fs::path(staged.path()) / "traces", "new traces");
        staged.commit();
      } catch (const Error& e) {
        said = e.what();
      }
    }
    ssize_t w = write(pipe_fds[1], said.data(), said.size());
    _exit(w == ssize_t(said.size()) ? 0 : 4);
  }
  close(pipe_fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = read(pipe_fds[0], buf, sizeof buf)) > 0;) said.append(buf, size_t(n));
  close(pipe_fds[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  fs::permissions(dir / "traces", fs::perms::owner_all);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  if (said.rfind("SKIPPED", 0) == 0) {
    MESSAGE(said);
    return;
  }
  CHECK(said.find("cannot replace '" + (dir / "traces").string() + "': Permission denied") !=
        std::string::npos);
  CHECK(snapshot(dir) == old);  // the staging directory gone too
}

TEST_CASE("a commit killed between its moves loses nothing: the next set puts old files back") {
  test::TempDir tmp;
  const fs::path dir = tmp.path / "report";
  // As a commit killed (SIGKILL) after moving both old files aside and one new one in leaves it.
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const fs::path aside = dir / (".staging.tmp-" + std::to_string(dead)) / ".replaced";
  fs::create_directories(aside);
  put_text(aside / "report.md", "old report");
  put_text(aside / "results.jsonl", "old rows");
  put_text(dir / "report.md", "new report");
  { StagedDirectory next(dir.string()); }  // not committed: only what it found is done
  const std::map<std::string, std::string> want = {{"report.md", "new report"},
                                                   {"results.jsonl", "old rows"}};
  CHECK(snapshot(dir) == want);  // the dead commit's staging directory removed
}

TEST_CASE("an output named by an open descriptor is written through it, after what it holds") {
  test::TempDir tmp;
  const std::string log = tmp.str("log.txt");
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, "progress\n", 9) == 9);
  const std::string name = "/dev/fd/" + std::to_string(fd);
  const OutputTarget target = output_target(name);
  CHECK(target.in_place);
  CHECK(target.fd == fd);
  CHECK(output_target("/proc/self/fd/" + std::to_string(fd)).fd == fd);
  CHECK(output_target("/dev/stdout").fd == 1);
  CHECK(output_target(log).fd == -1);
  write_file_atomically(name, "{\"steps\": 2}\n");
  append_file_atomically(name, "more\n");
  close(fd);
  CHECK(test::read_text(log) == "progress\n{\"steps\": 2}\nmore\n");
  const std::string closed = "descriptor " + std::to_string(fd) + " is not open";
  CHECK_THROWS_WITH_AS(check_output_file("--trace", name), doctest::Contains(closed.c_str()),
                       UsageError);
}

TEST_CASE("a temporary directory is made under TMPDIR, or one line says why it cannot be") {
  test::TempDir tmp;
  const std::string base = tmp.path.string();
  {
    test::ScopedEnv tmpdir("TMPDIR", base);
    const fs::path made = make_temporary_directory("replica-test-", "for the test");
    CHECK(fs::is_directory(made));
    CHECK(made.parent_path() == tmp.path);
    CHECK(made.filename().string().rfind("replica-test-", 0) == 0);
  }
  test::put_bytes(tmp.str("file"), {1});
  // std::filesystem::temp_directory_path() said "temp_directory_path: No such file or
  // directory" for both, naming neither the variable nor the directory.
  for (const auto& [dir, why] : std::vector<std::pair<std::string, std::string>>{
           {base + "/none", "TMPDIR=" + base + "/none does not exist"},
           {base + "/file", "TMPDIR=" + base + "/file is not a directory"}}) {
    test::ScopedEnv tmpdir("TMPDIR", dir);
    const std::string said = "cannot make a temporary directory for the test: " + why;
    CHECK(test::error_of([] { make_temporary_directory("replica-test-", "for the test"); }) ==
          said);
  }
}
