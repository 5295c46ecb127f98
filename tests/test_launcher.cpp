// replica-launch with tiny shell programs as ranks: the environment each rank sees, one failure
// ending all (exit code or signal named, nothing left running), signals forwarded exactly once,
// and bad command lines.
#include <fcntl.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "parallel/rendezvous/launcher_signals.h"
#include "process_helpers.h"

using namespace std::chrono_literals;
using test::Clock;
using test::contains;
using test::read_text;
using test::seconds_since;

namespace {

const std::string kLaunch = test::bin("replica-launch");

// Alive and not a zombie (an orphan's zombie may linger where nobody reaps it).
bool alive(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

pid_t read_pid(const std::string& path) {
  std::string text = read_text(path);
  return text.empty() ? -1 : static_cast<pid_t>(std::stol(text));
}

bool wait_for_file(const std::string& path, std::chrono::seconds limit = 20s) {
  auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (!read_text(path).empty()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// The "R ..." lines the ranks print, sorted.
std::vector<std::string> rank_lines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("R ", 0) == 0) lines.push_back(line);
  std::sort(lines.begin(), lines.end());
  return lines;
}

const std::string kEcho =
    " -- /bin/sh -c 'echo R $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR "
    "$MASTER_PORT $OMP_NUM_THREADS'";

// Starts the launcher directly (in its own process group, output to a file) so a test can
// signal it.
pid_t spawn_launcher(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv{const_cast<char*>(kLaunch.c_str())};
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(kLaunch.c_str(), argv.data());
    _exit(127);
  }
  setpgid(pid, pid);
  return pid;
}

// Exit status of the launcher as a shell reports it (128 + signal when killed).
int wait_launcher(pid_t pid, std::chrono::seconds limit) {
  auto deadline = Clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(10ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TEST_CASE("replica-launch: every rank gets torchrun's environment") {
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    auto r = test::run(kLaunch + " --nproc-per-node " + std::to_string(n) + kEcho, 60);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    std::vector<std::string> expected;
    for (int i = 0; i < n; ++i)
      expected.push_back("R " + std::to_string(i) + " " + std::to_string(i) + " " +
                         std::to_string(n) + " " + std::to_string(n) + " 127.0.0.1 29500 1");
    CHECK(rank_lines(r.output) == expected);
    CHECK(test::count_lines(r.output) == n);  // nothing from the launcher itself
  }
}

TEST_CASE("replica-launch: the second of two nodes gets ranks 4..7; flags in both spellings") {
  auto r = test::run(kLaunch +
                         " --nnodes 2 --node_rank 1 --nproc_per_node 4 --master-addr "
                         "127.0.0.1 --master_port 29611" +
                         kEcho,
                     60);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  std::vector<std::string> expected;
  for (int i = 0; i < 4; ++i)
    expected.push_back("R " + std::to_string(4 + i) + " " + std::to_string(i) +
                       " 8 4 127.0.0.1 29611 1");
  CHECK(rank_lines(r.output) == expected);

  r = test::run("env OMP_NUM_THREADS=3 " + kLaunch + " --nproc-per-node 2" + kEcho, 60);
  CHECK(rank_lines(r.output) ==
        std::vector<std::string>{"R 0 0 2 2 127.0.0.1 29500 3", "R 1 1 2 2 127.0.0.1 29500 3"});
  // Arguments reach the program unchanged.
  r = test::run(kLaunch + " -- /bin/echo --nproc-per-node 'a b'", 60);
  CHECK(r.exit_code == 0);
  CHECK(r.output == "--nproc-per-node a b\n");
}

TEST_CASE("replica-launch: a rank that exits 3 ends the job; the others are killed") {
  test::TempDir tmp;
  // Rank 0 records its pid and the pid of a background child, then sleeps; rank 1 fails once
  // both are written.
  std::string script = "if [ $RANK = 0 ]; then sleep 60 & echo $! > " + tmp.str("grandchild") +
                       "; echo $$ > " + tmp.str("pid0") + "; wait; exit 0; fi; while [ ! -s " +
                       tmp.str("pid0") + " ]; do sleep 0.05; done; exit 3";
  auto t0 = Clock::now();
  auto r = test::run(kLaunch + " --nproc-per-node 2 -- /bin/sh -c '" + script + "'", 60);
  double took = seconds_since(t0);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(contains(r.output, "replica-launch: rank 1 (pid "));
  CHECK(contains(r.output, ") exited with code 3"));
  CHECK(test::count_lines(r.output) == 1);
  CHECK(took < 10.0);
  pid_t sibling = read_pid(tmp.str("pid0")), grandchild = read_pid(tmp.str("grandchild"));
  REQUIRE(sibling > 0);
  REQUIRE(grandchild > 0);
  CHECK_FALSE(alive(sibling));
  auto deadline = Clock::now() + 5s;  // the orphan is reaped by init, give it a moment
  while (alive(grandchild) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  CHECK_FALSE(alive(grandchild));
}

TEST_CASE("replica-launch: a rank killed by SIGKILL is named with its signal") {
  test::TempDir tmp;
  std::string script = "if [ $RANK = 1 ]; then sleep 0.3; kill -9 $$; fi; echo $$ > " +
                       tmp.str("pid0") + "; exec sleep 60";
  auto t0 = Clock::now();
  auto r = test::run(kLaunch + " --nproc-per-node 3 -- /bin/sh -c '" + script + "'", 60);
  INFO(r.output);
  CHECK(seconds_since(t0) < 30.0);
  CHECK(r.exit_code == 1);
  CHECK(contains(r.output, "replica-launch: rank 1 (pid "));
  CHECK(contains(r.output, ") was killed by signal 9 (SIGKILL): out of memory? (the kernel log "
                           "says: dmesg | grep -i oom)"));
  CHECK(test::count_lines(r.output) == 1);
  CHECK_FALSE(alive(read_pid(tmp.str("pid0"))));
}

TEST_CASE("replica-launch: SIGTERM and Ctrl-C reach every rank exactly once") {
  for (int sig : {SIGTERM, SIGINT}) {
    CAPTURE(sig);
    test::TempDir tmp;
    const char* name = sig == SIGTERM ? "TERM" : "INT";
    std::string script = std::string("trap 'echo got $RANK >> ") + tmp.str("log") + "; exit 0' " +
                         name + "; echo $$ > " + tmp.str("pid") +
                         "$RANK; while :; do sleep 0.1; done";
    pid_t launcher =
        spawn_launcher({"--nproc-per-node", "2", "--", "/bin/sh", "-c", script}, tmp.str("out"));
    REQUIRE(wait_for_file(tmp.str("pid0")));
    REQUIRE(wait_for_file(tmp.str("pid1")));
    auto t0 = Clock::now();
    // SIGTERM to the launcher alone; SIGINT to its whole process group, as a terminal's Ctrl-C.
    if (sig == SIGTERM)
      kill(launcher, SIGTERM);
    else
      kill(-launcher, SIGINT);
    int code = wait_launcher(launcher, 30s);
    std::string out = read_text(tmp.str("out"));
    INFO(out);
    CHECK(code == 128 + sig);
    CHECK(seconds_since(t0) < 5.0);  // the ranks exit on the signal: no grace period needed
    CHECK(contains(out, std::string("replica-launch: received SIG") + name + ": stopped 2 ranks"));
    std::string log = read_text(tmp.str("log"));
    std::vector<std::string> lines;
    std::istringstream in(log);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    std::sort(lines.begin(), lines.end());
    CHECK(lines == std::vector<std::string>{"got 0", "got 1"});  // once each, not twice
    CHECK_FALSE(alive(read_pid(tmp.str("pid0"))));
    CHECK_FALSE(alive(read_pid(tmp.str("pid1"))));
  }
}

TEST_CASE("replica-launch: a launcher started with SIGINT ignored still stops ranks with it") {
  // As a script's background job starts it: SIGINT and SIGQUIT ignored, inherited through exec.
  // The ranks, plain shells without a trap, must end on the forwarded SIGINT at once, not at
  // the grace period's SIGKILL.
  test::TempDir tmp;
  const std::string script = "echo $$ > " + tmp.str("pid") + "$RANK; while :; do sleep 0.1; done";
  struct sigaction ignore {}, saved_int {}, saved_quit {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGINT, &ignore, &saved_int);
  sigaction(SIGQUIT, &ignore, &saved_quit);
  const pid_t launcher =
      spawn_launcher({"--nproc-per-node", "2", "--", "/bin/sh", "-c", script}, tmp.str("out"));
  sigaction(SIGINT, &saved_int, nullptr);
  sigaction(SIGQUIT, &saved_quit, nullptr);
  REQUIRE(wait_for_file(tmp.str("pid0")));
  REQUIRE(wait_for_file(tmp.str("pid1")));
  const auto t0 = Clock::now();
  kill(launcher, SIGINT);
  const int code = wait_launcher(launcher, 30s);
  INFO(read_text(tmp.str("out")));
  CHECK(code == 128 + SIGINT);
  CHECK(seconds_since(t0) < 5.0);  // the grace period is 120 s
  CHECK_FALSE(alive(read_pid(tmp.str("pid0"))));
  CHECK_FALSE(alive(read_pid(tmp.str("pid1"))));
}

TEST_CASE("replica-launch: a rank ignoring SIGTERM is killed after the grace period") {
  test::TempDir tmp;
  std::string script = "trap \"\" TERM; if [ $RANK = 1 ]; then sleep 0.3; exit 5; fi; echo $$ > " +
                       tmp.str("pid0") + "; while :; do sleep 0.1; done";
  auto t0 = Clock::now();
  auto r = test::run(kLaunch + " --nproc-per-node 2 -- /bin/sh -c '" + script + "'", 60);
  double took = seconds_since(t0);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(contains(r.output, ") exited with code 5"));
  CHECK(took > 4.0);
  CHECK(took < 15.0);
  CHECK_FALSE(alive(read_pid(tmp.str("pid0"))));
}

TEST_CASE("launcher signals: a Ctrl-C reaches the launcher's thread, whichever thread takes it") {
  // In a child process: a thread started before the launcher's signals were set up (as the
  // CUDA driver's are, counting GPUs, before `replica-train --mode ddp` launches), one started
  // after, then SIGINT to the process, which the launcher's sigtimedwait() must get. The kernel
  // may hand it to the first thread, which does not block it: without the handler that sends
  // it on, its default action ended the process.
  const auto sigint_with_threads = [] {
    const pid_t child = fork();
    if (child == 0) {
      signal(SIGINT, SIG_DFL);  // doctest's handler off: the launcher's process has none
      std::atomic<bool> done{false};
      std::atomic<int> running{0};
      const auto spin = [&] {  // running, so the kernel may hand it the signal
        ++running;
        while (!done) usleep(1000);
      };
      std::thread early(spin);
      bool arrived = false;
      {
        replica::LauncherSignals signals;
        std::thread later(spin);
        while (running < 2) usleep(1000);
        bool every = true;  // the kernel picks the thread: 20 signals, each must arrive
        for (int i = 0; i < 20 && every; ++i) {
          kill(getpid(), SIGINT);
          timespec ts{5, 0};
          every = sigtimedwait(&signals.watched(), nullptr, &ts) == SIGINT;
        }
        arrived = every;
        done = true;
        later.join();
      }
      early.join();
      _exit(arrived ? 0 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    return status;
  };
  const int status = sigint_with_threads();
  CHECK_MESSAGE(WIFEXITED(status), "the process died of signal ", WTERMSIG(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("replica-launch: help, bad flags and missing programs") {
  auto r = test::run(kLaunch + " --help");
  CHECK(r.exit_code == 0);
  CHECK(contains(r.output, "--nproc-per-node"));
  CHECK(contains(r.output, "--master-port"));

  test::TempDir tmp;
  std::ofstream(tmp.str("data.txt")) << "not a program\n";
  chmod(tmp.str("data.txt").c_str(), 0644);
  // A script whose interpreter is missing: exec says "No such file or directory" of a file that
  // is there.
  std::ofstream(tmp.str("script.sh")) << "#!/no/such/interpreter -e\necho hi\n";
  chmod(tmp.str("script.sh").c_str(), 0755);
  struct Bad {
    std::string args, message;
  };
  for (const Bad& b : std::vector<Bad>{
           {"--bogus -- /bin/true", "unknown option '--bogus'"},
           {"--nproc-per-node 2 --master-port", "--master-port"},
           {"--nproc-per-node x -- /bin/true", "--nproc-per-node"},
           {"--nproc-per-node 0 -- /bin/true", "--nproc-per-node 0 must be 1..4096"},
           {"--nnodes 2 --node-rank 2 -- /bin/true", "--node-rank 2 must be in 0..1"},
           {"--master-port 70000 -- /bin/true", "--master-port 70000 must be 1..65535"},
           {"--nproc-per-node 2", "no program to run"},
           {"-- /no/such/program", "program '/no/such/program' not found"},
           {"-- no-such-program-replica", "program 'no-such-program-replica' not found in PATH"},
           {"-- " + tmp.str("data.txt"), "is not an executable file"},
           {"-- " + tmp.str(), "is not an executable file"},  // a directory
           {"--nproc-per-node 2 -- " + tmp.str("script.sh"),
            "its interpreter '/no/such/interpreter' (its #! line) was not found"},
       }) {
    CAPTURE(b.args);
    r = test::run(kLaunch + " " + b.args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.output, "replica-launch: error: "));
    CHECK(contains(r.output, b.message));
    CHECK(test::count_lines(r.output) == 1);
  }
}
