// The signals a launcher waits for (SIGCHLD, and SIGINT, SIGTERM, SIGHUP to forward to its
// ranks), taken by its own thread with sigtimedwait() rather than ending the process.
//
// A signal sent to a process goes to any one of its threads that does not block it, and
// blocking it in the launcher's thread says nothing of threads that were already there: by the
// time `replica-train --mode ddp` launches its ranks, counting the GPUs has started the CUDA
// driver's threads. A Ctrl-C one of them took would end the launcher at once and leave the ranks
// (in process groups of their own, out of the terminal's reach) running. So besides blocking them
// here, a handler, whichever thread runs it, sends each of them on to the launcher's thread,
// where it waits, pending, for sigtimedwait().
#pragma once
#include <signal.h>
#include <sys/types.h>

namespace replica {

class LauncherSignals {
 public:
  LauncherSignals();   // in the launcher's thread; one at a time
  ~LauncherSignals();  // the handlers and the mask as they were, unless kept
  LauncherSignals(const LauncherSignals&) = delete;
  LauncherSignals& operator=(const LauncherSignals&) = delete;

  const sigset_t& watched() const { return watched_; }
  // In a rank's process, between fork() and exec(): the dispositions and the mask the launcher
  // had before (SIGCHLD at its default, SIGINT and SIGQUIT too: the launcher stops ranks with
  // the SIGINT it forwards, so a rank must not inherit it ignored, as a launcher started in the
  // background by a script has it). Async-signal-safe.
  void restore_in_rank() const;
  // As they are until the process exits: it is about to report and exit, and a second Ctrl-C
  // pressed now must not end it before it has.
  void keep() { kept_ = true; }

 private:
  static constexpr int kSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP};
  sigset_t watched_, before_;
  struct sigaction old_[4];
  bool kept_ = false;
};

}  // namespace replica
