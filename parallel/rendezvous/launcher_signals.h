// The signals a launcher waits for (SIGCHLD, and SIGINT, SIGTERM, SIGHUP to forward to its
// ranks), blocked so that it takes them with sigtimedwait() rather than dying of them.
//
// A signal sent to a process goes to any one of its threads that does not block it, and a
// blocked mask is inherited only by threads started after it is set. So they are blocked
// before the launching process starts any thread: `replica-train --mode ddp` counts the devices
// before it launches, and counting GPUs starts the CUDA driver's threads. Blocked only later, a
// Ctrl-C could land on a driver thread, where its default action ends the launcher at once and
// leaves the ranks (in process groups of their own, out of the terminal's reach) running.
#pragma once
#include <signal.h>

namespace replica {

class LauncherSignals {
 public:
  LauncherSignals();   // blocks them in the calling thread (and the threads it starts after)
  ~LauncherSignals();  // the mask as it was, unless kept
  LauncherSignals(const LauncherSignals&) = delete;
  LauncherSignals& operator=(const LauncherSignals&) = delete;

  const sigset_t& watched() const { return watched_; }
  const sigset_t& before() const { return before_; }  // the mask to start the ranks with
  // Blocked until the process exits: it is about to report and exit, and a second Ctrl-C
  // pressed now must not end it before it has.
  void keep() { kept_ = true; }

 private:
  sigset_t watched_, before_;
  bool kept_ = false;
};

}  // namespace replica
