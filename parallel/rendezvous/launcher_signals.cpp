#include "parallel/rendezvous/launcher_signals.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <iterator>

#include "engine/error.h"

namespace replica {

namespace {

std::atomic<pid_t> g_launcher_thread{0};
static_assert(std::atomic<pid_t>::is_always_lock_free, "read from a signal handler");

// Runs in a thread that does not block the signal (never the launcher's own): hands it to the
// launcher's thread, which blocks it, so it stays pending there for sigtimedwait().
void send_on(int sig) {
  const int saved = errno;
  const pid_t to = g_launcher_thread.load();
  if (to > 0) syscall(SYS_tgkill, getpid(), to, sig);
  errno = saved;
}

}  // namespace

LauncherSignals::LauncherSignals() {
  REPLICA_CHECK(g_launcher_thread.exchange(pid_t(syscall(SYS_gettid))) == 0,
                "one launcher at a time");
  sigemptyset(&watched_);
  for (int s : kSignals) sigaddset(&watched_, s);
  pthread_sigmask(SIG_BLOCK, &watched_, &before_);
  struct sigaction sa {};
  sa.sa_handler = send_on;
  sigfillset(&sa.sa_mask);
  // SIGCHLD's handler also undoes an inherited SIG_IGN, which would reap the ranks behind the
  // launcher's back.
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &sa, &old_[i]);
}

LauncherSignals::~LauncherSignals() {
  if (kept_) return;
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  g_launcher_thread = 0;
  pthread_sigmask(SIG_SETMASK, &before_, nullptr);
}

void LauncherSignals::restore_in_rank() const {
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  for (int s : {SIGCHLD, SIGINT, SIGQUIT}) signal(s, SIG_DFL);
  sigprocmask(SIG_SETMASK, &before_, nullptr);
}

}  // namespace replica
