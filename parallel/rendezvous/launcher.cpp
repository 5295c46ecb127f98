#include "parallel/rendezvous/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "engine/error.h"
#include "parallel/rendezvous/launcher_signals.h"
#include "parallel/rendezvous/rank_errors.h"

namespace replica {

namespace {

using Clock = std::chrono::steady_clock;

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
};

std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& set) {
  // (REPLICA_ERROR_DIR is in `set`: it replaces an outer launcher's.)
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

// Why exec of `program` failed, in a line. The program was found before it was started, so "No
// such file or directory" means its script's interpreter (the #! line) is missing: named.
std::string exec_failure(const std::string& program, int err) {
  if (err == ENOENT) {
    std::ifstream in(program);
    std::string first;
    if (std::getline(in, first) && first.rfind("#!", 0) == 0) {
      const size_t start = std::min(first.find_first_not_of(" \t", 2), first.size());
      const std::string interpreter =
          first.substr(start, first.find_first_of(" \t", start) - start);
      return fmt::format("cannot run '{}': its interpreter '{}' (its #! line) was not found",
                         program, interpreter);
    }
  }
  return fmt::format("cannot run '{}': {}", program, std::strerror(err));
}

// Forks and execs one rank in its own process group and adds it to `children`; the exec error
// (if any) comes back through a close-on-exec pipe.
void start_rank(const LaunchOptions& o, const std::string& program, int local, pid_t launcher,
                bool tty_stdin, const LauncherSignals& signals, const std::string& error_dir,
                std::vector<Child>& children) {
  Child c;
  c.rank = o.node_rank * o.nproc_per_node + local;
  std::vector<std::string> env =
      child_environment({{"RANK", std::to_string(c.rank)},
                         {"LOCAL_RANK", std::to_string(local)},
                         {"WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
                         {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
                         {"GROUP_RANK", std::to_string(o.node_rank)},
                         {"MASTER_ADDR", o.master_addr},
                         {"MASTER_PORT", std::to_string(o.master_port)},
                         {RankErrors::kEnvVar, error_dir}});
  std::vector<std::string> command = o.command;
  std::vector<char*> envp, args;
  for (auto& e : env) envp.push_back(e.data());
  for (auto& a : command) args.push_back(a.data());
  envp.push_back(nullptr);
  args.push_back(nullptr);
  int report[2];
  REPLICA_CHECK(pipe2(report, O_CLOEXEC) == 0, "pipe: {}", std::strerror(errno));
  c.pid = fork();
  if (c.pid == 0) {
    signals.restore_in_rank();
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(127);
    if (tty_stdin) {  // a background process group reading the terminal would be stopped
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
    throw Error(fmt::format("cannot start rank {}: fork failed ({})", c.rank, std::strerror(err)));
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
    throw UsageError(exec_failure(program, exec_err));
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

}  // namespace

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REPLICA_CHECK(fd >= 0, "socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  close(fd);
  REPLICA_CHECK(ok, "cannot find a free TCP port: {}", std::strerror(err));
  return ntohs(addr.sin_port);
}

std::string current_executable() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  REPLICA_CHECK(n > 0, "cannot read /proc/self/exe: {}", std::strerror(errno));
  return std::string(buf, size_t(n));
}

namespace {

// What happened while the ranks ran.
struct Outcome {
  int forwarded = 0;          // the signal the launcher got and passed on
  const Child* failed = nullptr;  // the first rank that did not exit 0 on its own
  int failed_status = 0;
};

// Waits for every rank to end. The first failure (or a SIGINT/SIGTERM/SIGHUP to the launcher)
// stops the others: SIGTERM (SIGCONT too, so a stopped rank acts on it) or the forwarded signal,
// then SIGKILL after the grace period or at a second signal. A usage error (exit code 2: bad
// flags, a batch that does not divide by the ranks) comes from the command line every rank
// shares, so the others get a moment to reach and report it too before they are stopped.
Outcome watch_ranks(const LaunchOptions& o, std::vector<Child>& children, const sigset_t& watched) {
  Outcome out;
  bool stopping = false, killed = false;
  Clock::time_point deadline, give_up, usage_wait;
  const auto kill_grace = std::chrono::seconds(5);
  const auto usage_grace = std::chrono::seconds(2);
  bool waiting_for_usage = false;
  auto stop_within = [&](std::chrono::milliseconds grace) {
    stopping = true;
    deadline = Clock::now() + grace;
  };
  auto kill_all = [&] {
    killed = true;
    give_up = Clock::now() + kill_grace;
    signal_groups(children, SIGKILL, false);
  };
  while (std::any_of(children.begin(), children.end(), [](const Child& c) { return c.running; })) {
    auto wait = std::chrono::milliseconds(500);
    if ((stopping && !killed) || waiting_for_usage)
      wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                            (waiting_for_usage ? usage_wait : deadline) - Clock::now()),
                        std::chrono::milliseconds(1), wait);
    timespec ts{0, static_cast<long>(wait.count()) * 1000000L};
    siginfo_t info;
    const int sig = sigtimedwait(&watched, &info, &ts);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (!stopping) {
        waiting_for_usage = false;
        out.forwarded = sig;
        stop_within(o.signal_grace);
        signal_groups(children, sig, true);
      } else if (!killed) {  // a second signal: no more patience
        if (!out.forwarded) out.forwarded = sig;
        kill_all();
      }
    }
    int status = 0;
    bool stop_now = false;
    for (pid_t pid; (pid = waitpid(-1, &status, WNOHANG)) > 0;) {
      for (auto& c : children) {
        if (c.pid != pid) continue;
        c.running = false;
        const bool usage = WIFEXITED(status) && WEXITSTATUS(status) == 2;
        if ((WIFEXITED(status) && WEXITSTATUS(status) == 0) || stopping) continue;
        if (!out.failed) {
          out.failed = &c;
          out.failed_status = status;
        }
        if (usage && !waiting_for_usage && out.failed == &c) {
          waiting_for_usage = true;
          usage_wait = Clock::now() + usage_grace;
        } else if (!usage) {
          waiting_for_usage = false;
          stop_now = true;
        }
      }
    }
    if (waiting_for_usage && Clock::now() >= usage_wait) {
      waiting_for_usage = false;
      stop_now = true;
    }
    if (stop_now) {
      stop_within(o.failure_grace);
      signal_groups(children, SIGTERM, false);  // the failed rank's group too: its children
      signal_groups(children, SIGCONT, false);  // a stopped (SIGSTOP) rank acts on it too
    }
    if (stopping && !killed && Clock::now() >= deadline) kill_all();
    if (killed && Clock::now() >= give_up) break;  // stuck in the kernel: nothing more to do
  }
  if (stopping) signal_groups(children, SIGKILL, false);  // leftovers of the ranks' groups
  return out;
}

// The launcher's own last line, and its exit code.
int report_outcome(const LaunchOptions& o, const std::vector<Child>& children, const Outcome& out,
                   const RankErrors::Printed& printed) {
  const std::vector<int>& culprits = printed.culprits;
  const char* name = o.name.c_str();
  if (out.forwarded) {
    std::fprintf(stderr, "%s: received %s: stopped %zu rank%s\n", name,
                 signal_name(out.forwarded).c_str(), children.size(),
                 children.size() == 1 ? "" : "s");
    return 128 + out.forwarded;
  }
  if (!out.failed) return 0;
  // The same error on every rank (a bad flag, a corrupt data file): its one line was the whole
  // story.
  if (printed.every_rank_exit_code != 0) return printed.every_rank_exit_code;
  const Child& f = *out.failed;
  if (!culprits.empty()) {
    std::string who;
    for (int r : culprits) {
      auto c = std::find_if(children.begin(), children.end(),
                            [&](const Child& k) { return k.rank == r; });
      who += fmt::format("{}rank {}{}", who.empty() ? "" : ", ", r,
                         c != children.end() ? fmt::format(" (pid {})", c->pid) : "");
    }
    std::fprintf(stderr, "%s: %s stopped answering: rank %d failed waiting for it; stopped all "
                 "%zu ranks\n",
                 name, who.c_str(), f.rank, children.size());
  } else if (WIFEXITED(out.failed_status)) {
    std::fprintf(stderr, "%s: rank %d (pid %d) exited with code %d\n", name, f.rank,
                 static_cast<int>(f.pid), WEXITSTATUS(out.failed_status));
  } else {
    const int sig = WTERMSIG(out.failed_status);
    // A SIGKILL nobody here sent is most often the kernel's OOM killer, which says so only in
    // the kernel log.
    std::fprintf(stderr, "%s: rank %d (pid %d) was killed by signal %d (%s)%s\n", name, f.rank,
                 static_cast<int>(f.pid), sig, signal_name(sig).c_str(),
                 sig == SIGKILL ? ": out of memory? (the kernel log says: dmesg | grep -i oom)"
                                : "");
  }
  return 1;
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

int launch_ranks(const LaunchOptions& o) {
  REPLICA_USAGE_CHECK(!o.command.empty(), "no program to run");
  const std::string program = resolve_program(o.command.front());
  LauncherSignals signals;
  const pid_t launcher = getpid();
  const bool tty_stdin = isatty(STDIN_FILENO);

  RankErrors errors;
  std::vector<Child> children;
  for (int local = 0; local < o.nproc_per_node; ++local)
    start_rank(o, program, local, launcher, tty_stdin, signals, errors.dir(), children);
  const Outcome out = watch_ranks(o, children, signals.watched());
  signals.keep();
  const int failed_rank = out.failed ? out.failed->rank : -1;
  const RankErrors::Printed printed =
      errors.print(o.node_rank * o.nproc_per_node, o.nproc_per_node, failed_rank);
  return report_outcome(o, children, out, printed);
}

}  // namespace replica
