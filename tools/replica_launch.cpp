// replica-launch: starts one process per rank for DDP and watches them (torchrun's flags).
//   replica-launch --nproc-per-node 4 -- replica-train --mode ddp
//   replica-launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 4 -- prog
// Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT and OMP_NUM_THREADS=1 (unless set). One failure ends all: the others get SIGTERM,
// then SIGKILL after a grace period, and the launcher names the failing rank in one line.
//
// Each child runs in its own process group: Ctrl-C in a terminal then reaches only the launcher,
// which forwards SIGINT/SIGTERM/SIGHUP exactly once to every group (a second signal: SIGKILL),
// and signalling a group also reaches what the rank started itself (e.g. a shell's children).
// Children die with the launcher (PR_SET_PDEATHSIG) and read /dev/null when stdin is a terminal
// (a background process group reading the terminal would be stopped).
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/program.h"

#include "engine/error.h"

extern char** environ;

using namespace replica;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kGrace = std::chrono::seconds(5);

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGXFSZ:
      return "SIGXFSZ";
    case SIGSYS:
      return "SIGSYS";
    default:
      return "unknown signal";
  }
}

// The executable for `program`: as given when it holds a '/', else searched in PATH.
std::string resolve_program(const std::string& program) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    REPLICA_USAGE_CHECK(access(program.c_str(), F_OK) == 0, "program '{}' not found", program);
    REPLICA_USAGE_CHECK(runnable(program), "program '{}' is not an executable file", program);
    return program;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  for (;;) {
    size_t colon = dirs.find(':', start);
    std::string dir = dirs.substr(start, colon == std::string::npos ? colon : colon - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (runnable(candidate)) return candidate;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  throw UsageError(fmt::format("program '{}' not found in PATH", program));
}

std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& set) {
  std::vector<std::string> env;
  bool have_omp = false;
  for (char** e = environ; *e; ++e) {
    std::string entry = *e;
    std::string name = entry.substr(0, entry.find('='));
    have_omp |= name == "OMP_NUM_THREADS";
    bool replaced =
        std::any_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == name; });
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  if (!have_omp) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

void signal_groups(const std::vector<Child>& children, int sig, bool running_only) {
  for (const auto& c : children)
    if (c.pid > 0 && (c.running || !running_only)) kill(-c.pid, sig);
}

int run(int argc, char** argv) {
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 29500;
  std::string master_addr = "127.0.0.1";
  CLI::App app{
      "replica-launch: starts one process per rank for DDP and watches them.\n"
      "usage: replica-launch [OPTIONS] -- PROGRAM [ARGS...]",
      "replica-launch"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "processes (ranks) on this node")
      ->capture_default_str();
  app.add_option("--nnodes", nnodes, "number of nodes")->capture_default_str();
  app.add_option("--node-rank,--node_rank", node_rank, "this node's index, 0..nnodes-1")
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", master_addr, "address of rank 0's node")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", master_port, "free port on rank 0's node")
      ->capture_default_str();
  app.prefix_command();
  app.footer(
      "Children get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
      "MASTER_PORT and OMP_NUM_THREADS=1 (unless set). When one exits non-zero or by a "
      "signal, the others get SIGTERM, then SIGKILL after 5 s.");
  if (auto code = parse_cli(app, "replica-launch", argc, argv)) return *code;
  std::vector<std::string> command = app.remaining();
  if (!command.empty() && command.front() == "--") command.erase(command.begin());
  REPLICA_USAGE_CHECK(!command.empty(),
                      "no program to run: replica-launch [OPTIONS] -- PROGRAM [ARGS...]");
  REPLICA_USAGE_CHECK(command.front().empty() || command.front()[0] != '-',
                      "unknown option '{}' (options go before -- PROGRAM; see --help)",
                      command.front());
  REPLICA_USAGE_CHECK(nproc >= 1 && nproc <= 4096, "--nproc-per-node {} must be 1..4096", nproc);
  REPLICA_USAGE_CHECK(nnodes >= 1 && nnodes <= 65536, "--nnodes {} must be 1..65536", nnodes);
  REPLICA_USAGE_CHECK(node_rank >= 0 && node_rank < nnodes,
                      "--node-rank {} must be in 0..{} (--nnodes {})", node_rank, nnodes - 1,
                      nnodes);
  REPLICA_USAGE_CHECK(master_port >= 1 && master_port <= 65535, "--master-port {} must be 1..65535",
                      master_port);
  REPLICA_USAGE_CHECK(!master_addr.empty(), "--master-addr must not be empty");
  std::string program = resolve_program(command.front());

  sigset_t watched, old_mask;
  sigemptyset(&watched);
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&watched, s);
  signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would reap children behind our back
  sigprocmask(SIG_BLOCK, &watched, &old_mask);
  pid_t launcher = getpid();
  bool tty_stdin = isatty(STDIN_FILENO);

  std::vector<Child> children;
  for (int local = 0; local < nproc; ++local) {
    Child c;
    c.rank = node_rank * nproc + local;
    std::vector<std::string> env =
        child_environment({{"RANK", std::to_string(c.rank)},
                           {"LOCAL_RANK", std::to_string(local)},
                           {"WORLD_SIZE", std::to_string(nproc * nnodes)},
                           {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
                           {"GROUP_RANK", std::to_string(node_rank)},
                           {"MASTER_ADDR", master_addr},
                           {"MASTER_PORT", std::to_string(master_port)}});
    std::vector<char*> envp, args;
    for (auto& e : env) envp.push_back(e.data());
    for (auto& a : command) args.push_back(a.data());
    envp.push_back(nullptr);
    args.push_back(nullptr);
    int report[2];
    REPLICA_CHECK(pipe2(report, O_CLOEXEC) == 0, "pipe: {}", std::strerror(errno));
    c.pid = fork();
    if (c.pid == 0) {
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(127);
      if (tty_stdin) {
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) dup2(null, STDIN_FILENO);
      }
      execve(program.c_str(), args.data(), envp.data());
      int err = errno;
      ssize_t ignored = write(report[1], &err, sizeof err);
      (void)ignored;
      _exit(127);
    }
    close(report[1]);
    if (c.pid < 0) {
      int err = errno;
      close(report[0]);
      signal_groups(children, SIGKILL, false);
      throw Error(
          fmt::format("cannot start rank {}: fork failed ({})", c.rank, std::strerror(err)));
    }
    setpgid(c.pid, c.pid);  // also here: no window where a signal to the group misses it
    int exec_err = 0;
    ssize_t got;
    while ((got = read(report[0], &exec_err, sizeof exec_err)) < 0 && errno == EINTR) {}
    close(report[0]);
    c.running = true;
    children.push_back(c);
    if (got == sizeof exec_err) {
      signal_groups(children, SIGKILL, false);
      for (auto& k : children) waitpid(k.pid, nullptr, 0);
      throw UsageError(fmt::format("cannot run '{}': {}", program, std::strerror(exec_err)));
    }
  }

  int forwarded = 0;  // the signal the launcher got and passed on
  const Child* failed = nullptr;
  int failed_status = 0;
  bool stopping = false, killed = false;
  Clock::time_point deadline, give_up;
  auto running = [&] {
    return std::count_if(children.begin(), children.end(),
                         [](const Child& c) { return c.running; });
  };
  while (running() > 0) {
    auto now = Clock::now();
    auto wait = std::chrono::milliseconds(500);
    if (stopping && !killed)
      wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now),
                        std::chrono::milliseconds(1), wait);
    timespec ts{0, static_cast<long>(wait.count()) * 1000000L};
    siginfo_t info;
    int sig = sigtimedwait(&watched, &info, &ts);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (!stopping) {
        forwarded = sig;
        stopping = true;
        deadline = Clock::now() + kGrace;
        signal_groups(children, sig, true);
      } else if (!killed) {  // a second signal: no more patience
        if (!forwarded) forwarded = sig;
        killed = true;
        give_up = Clock::now() + kGrace;
        signal_groups(children, SIGKILL, false);
      }
    }
    int status = 0;
    for (pid_t pid; (pid = waitpid(-1, &status, WNOHANG)) > 0;) {
      for (auto& c : children) {
        if (c.pid != pid) continue;
        c.running = false;
        bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && !stopping) {
          failed = &c;
          failed_status = status;
          stopping = true;
          deadline = Clock::now() + kGrace;
          signal_groups(children, SIGTERM, false);  // the failed rank's group too: its children
        }
      }
    }
    if (stopping && !killed && Clock::now() >= deadline) {
      killed = true;
      give_up = Clock::now() + kGrace;
      signal_groups(children, SIGKILL, false);
    }
    if (killed && Clock::now() >= give_up) break;  // stuck in the kernel: nothing more to do
  }
  if (stopping) signal_groups(children, SIGKILL, false);  // leftovers of the ranks' groups

  if (forwarded) {
    std::fprintf(stderr, "replica-launch: received %s: stopped %zu rank%s\n",
                 signal_name(forwarded), children.size(), children.size() == 1 ? "" : "s");
    return 128 + forwarded;
  }
  if (failed) {
    if (WIFEXITED(failed_status))
      std::fprintf(stderr, "replica-launch: rank %d (pid %d) exited with code %d\n", failed->rank,
                   static_cast<int>(failed->pid), WEXITSTATUS(failed_status));
    else
      std::fprintf(stderr, "replica-launch: rank %d (pid %d) was killed by signal %d (%s)\n",
                   failed->rank, static_cast<int>(failed->pid), WTERMSIG(failed_status),
                   signal_name(WTERMSIG(failed_status)));
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-launch", [&] { return run(argc, argv); });
}
