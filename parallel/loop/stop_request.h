// Ctrl-C (SIGINT) and SIGTERM during training: the first signal asks the training loop to stop
// after the step in progress (it then writes a checkpoint and exits 128 + signal); a second
// one removes the temporary file being written, if any (engine/output_files.h), restores the
// default action and re-raises it, which ends the process at once.
#pragma once

namespace replica {

class StopRequest {
 public:
  // Installs the handlers for SIGINT and SIGTERM (idempotent).
  static void install();
  // Restores the handlers that were there before install().
  static void uninstall();
  // The signal that asked to stop, or 0.
  static int signal();
  static bool requested() { return signal() != 0; }
};

}  // namespace replica
