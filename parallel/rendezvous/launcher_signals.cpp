#include "parallel/rendezvous/launcher_signals.h"

#include <pthread.h>

namespace replica {

LauncherSignals::LauncherSignals() {
  sigemptyset(&watched_);
  for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&watched_, s);
  signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would reap the ranks behind the launcher's back
  pthread_sigmask(SIG_BLOCK, &watched_, &before_);
}

LauncherSignals::~LauncherSignals() {
  if (!kept_) pthread_sigmask(SIG_SETMASK, &before_, nullptr);
}

}  // namespace replica
