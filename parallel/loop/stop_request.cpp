#include "parallel/loop/stop_request.h"

#include <signal.h>

#include <atomic>

#include "engine/output_files.h"

namespace replica {

namespace {

volatile sig_atomic_t g_signal = 0;
std::atomic<bool> g_installed{false};
struct sigaction g_old_int, g_old_term;

void on_signal(int sig) {
  if (g_signal != 0) {  // the second signal: the default action, now
    remove_temporary_in_progress();  // a half-written checkpoint must not stay behind
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  g_signal = sig;
}

}  // namespace

void StopRequest::install() {
  if (g_installed.exchange(true)) return;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and collectives carry on; the loop checks the flag
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
}

void StopRequest::uninstall() {
  if (!g_installed.exchange(false)) return;
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
}

int StopRequest::signal() { return g_signal; }

}  // namespace replica
