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
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "engine/output_files.h"
#include "parallel/comm/peer_monitor.h"

extern char** environ;

namespace replica {

namespace {

using Clock = std::chrono::steady_clock;

// Where a rank leaves its fatal error for the launcher (one JSON file per rank).
constexpr const char* kErrorDirVar = "REPLICA_ERROR_DIR";

// A directory of the launch's own for the ranks' error reports, removed at the end.
class ErrorDir {
 public:
  ErrorDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/replica-launch-XXXXXX";
    if (mkdtemp(pattern.data())) path_ = pattern;
  }
  ~ErrorDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct RankReport {
  int rank = 0;
  std::string program, message;
  std::vector<int> silent;  // ranks this one found had stopped answering
};

std::vector<RankReport> read_reports(const std::string& dir, int first_rank, int count) {
  std::vector<RankReport> out;
  for (int r = first_rank; r < first_rank + count && !dir.empty(); ++r) {
    std::ifstream in(fmt::format("{}/rank{}.json", dir, r));
    if (!in) continue;
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) continue;
    RankReport rep;
    rep.rank = r;
    rep.program = j.value("program", std::string("rank"));
    rep.message = j.value("message", std::string());
    rep.silent = j.value("silent", std::vector<int>());
    out.push_back(std::move(rep));
  }
  return out;
}

// "rank 3", "ranks 0-3", "ranks 0, 2"
std::string rank_list(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  if (ranks.size() == 1) return fmt::format("rank {}", ranks[0]);
  const bool run = ranks.back() - ranks.front() + 1 == int(ranks.size());
  if (run && ranks.size() > 2) return fmt::format("ranks {}-{}", ranks.front(), ranks.back());
  std::string out = "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// Each distinct message once, with the ranks it came from ("every rank" when all did).
void print_reports(const std::vector<RankReport>& reports, int world_on_node) {
  std::vector<std::pair<std::string, std::vector<int>>> distinct;  // in rank order
  for (const auto& r : reports) {
    const std::string line = r.program + ": error: " + r.message;
    auto it = std::find_if(distinct.begin(), distinct.end(),
                           [&](const auto& d) { return d.first == line; });
    if (it == distinct.end()) distinct.push_back({line, {r.rank}});
    else it->second.push_back(r.rank);
  }
  for (const auto& [line, ranks] : distinct) {
    const std::string who = distinct.size() == 1 && int(ranks.size()) == world_on_node &&
                                    world_on_node > 1
                                ? "every rank"
                                : rank_list(ranks);
    std::fprintf(stderr, "%s [%s]\n", line.c_str(), who.c_str());
  }
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
};

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

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

// Forks and execs one rank in its own process group; the exec error (if any) comes back
// through a close-on-exec pipe.
Child start_rank(const LaunchOptions& o, const std::string& program, int local, pid_t launcher,
                 bool tty_stdin, const sigset_t& old_mask, const std::string& error_dir,
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
                         {kErrorDirVar, error_dir}});
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
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
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
    throw UsageError(fmt::format("cannot run '{}': {}", program, std::strerror(exec_err)));
  }
  return c;
}

}  // namespace

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

int launch_ranks(const LaunchOptions& o) {
  REPLICA_USAGE_CHECK(!o.command.empty(), "no program to run");
  const std::string program = resolve_program(o.command.front());

  sigset_t watched, old_mask;
  sigemptyset(&watched);
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&watched, s);
  signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would reap children behind our back
  sigprocmask(SIG_BLOCK, &watched, &old_mask);
  const pid_t launcher = getpid();
  const bool tty_stdin = isatty(STDIN_FILENO);

  ErrorDir errors;
  std::vector<Child> children;
  try {
    for (int local = 0; local < o.nproc_per_node; ++local)
      start_rank(o, program, local, launcher, tty_stdin, old_mask, errors.path(), children);
  } catch (...) {
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    throw;
  }

  int forwarded = 0;  // the signal the launcher got and passed on
  const Child* failed = nullptr;
  int failed_status = 0;
  bool stopping = false, killed = false;
  Clock::time_point deadline, give_up;
  const auto kill_grace = std::chrono::seconds(5);
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
        deadline = Clock::now() + o.signal_grace;
        signal_groups(children, sig, true);
      } else if (!killed) {  // a second signal: no more patience
        if (!forwarded) forwarded = sig;
        killed = true;
        give_up = Clock::now() + kill_grace;
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
          deadline = Clock::now() + o.failure_grace;
          signal_groups(children, SIGTERM, false);  // the failed rank's group too: its children
          signal_groups(children, SIGCONT, false);  // a stopped (SIGSTOP) rank acts on it too
        }
      }
    }
    if (stopping && !killed && Clock::now() >= deadline) {
      killed = true;
      give_up = Clock::now() + kill_grace;
      signal_groups(children, SIGKILL, false);
    }
    if (killed && Clock::now() >= give_up) break;  // stuck in the kernel: nothing more to do
  }
  if (stopping) signal_groups(children, SIGKILL, false);  // leftovers of the ranks' groups
  // The signals stay blocked: the caller is about to exit, and a second Ctrl-C pressed just
  // now must not kill it before it reports.

  const int first_rank = o.node_rank * o.nproc_per_node;
  std::vector<RankReport> reports = read_reports(errors.path(), first_rank, o.nproc_per_node);
  // What the rank that failed first found: the culprit, when it names one.
  std::vector<int> culprits;
  for (const auto& r : reports)
    if (failed && r.rank == failed->rank) culprits = r.silent;
  // Ranks that failed because the first one had (a peer gone after the job was stopped) only
  // repeat the story: left out.
  reports.erase(std::remove_if(reports.begin(), reports.end(),
                               [&](const RankReport& r) {
                                 return failed && r.rank != failed->rank &&
                                        std::find(r.silent.begin(), r.silent.end(),
                                                  failed->rank) != r.silent.end();
                               }),
                reports.end());
  print_reports(reports, o.nproc_per_node);
  if (forwarded) {
    std::fprintf(stderr, "%s: received %s: stopped %zu rank%s\n", o.name.c_str(),
                 signal_name(forwarded).c_str(), children.size(),
                 children.size() == 1 ? "" : "s");
    return 128 + forwarded;
  }
  if (!failed) return 0;
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
                 o.name.c_str(), who.c_str(), failed->rank, children.size());
    return 1;
  }
  if (WIFEXITED(failed_status))
    std::fprintf(stderr, "%s: rank %d (pid %d) exited with code %d\n", o.name.c_str(),
                 failed->rank, static_cast<int>(failed->pid), WEXITSTATUS(failed_status));
  else
    std::fprintf(stderr, "%s: rank %d (pid %d) was killed by signal %d (%s)\n", o.name.c_str(),
                 failed->rank, static_cast<int>(failed->pid), WTERMSIG(failed_status),
                 signal_name(WTERMSIG(failed_status)).c_str());
  return 1;
}

bool report_error_to_launcher(const std::string& program, const std::exception& error,
                              int exit_code) {
  const char* dir = std::getenv(kErrorDirVar);
  const char* rank = std::getenv("RANK");
  if (!dir || !*dir || !rank || !*rank) return false;
  nlohmann::json j = {{"program", program}, {"message", error.what()}, {"exit_code", exit_code}};
  if (const auto* pf = dynamic_cast<const PeerFailure*>(&error)) j["silent"] = pf->ranks();
  try {
    write_file_atomically(fmt::format("{}/rank{}.json", dir, rank), j.dump() + "\n");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace replica
