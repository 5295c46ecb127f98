// Starting and watching one process per rank on this node (torchrun's environment): used by
// replica-launch and by `replica-train --mode ddp` when it is started without a launcher.
//
// Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT and OMP_NUM_THREADS=1 (unless set), and runs in its own process group, so Ctrl-C
// in a terminal reaches only the launcher, which forwards it once to every rank.
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace replica {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::vector<std::string> command;  // program (resolved like execvp) and its arguments
  std::string name = "replica-launch";  // prefix of the launcher's own messages
  // After a rank fails, the others get SIGTERM and this long before SIGKILL.
  std::chrono::milliseconds failure_grace{5000};
  // After a forwarded SIGINT/SIGTERM/SIGHUP the ranks get this long to finish their step and
  // write a checkpoint; a second signal kills them at once.
  std::chrono::milliseconds signal_grace{120000};
};

// Starts the ranks and waits for them. Returns 0 when every rank exited 0; 128 + signal after
// a forwarded signal; the ranks' exit code when every rank reported the same error (its line is
// all that is printed: 2 for a usage error); 1 when a rank failed otherwise. A rank's fatal
// error comes back through report_error_to_launcher() (rank_errors.h): the launcher prints
// each distinct message once, naming the ranks it came from, and its last line names the rank
// that failed first, or the rank the others found had stopped answering (a PeerFailure).
// Throws UsageError when the program cannot run.
int launch_ranks(const LaunchOptions& options);

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
int pick_free_port();

// The path of the running executable (/proc/self/exe).
std::string current_executable();

// "SIGTERM" for SIGTERM: how the launcher and replica-dp-vs-ddp name a signal in a message.
std::string signal_name(int sig);

}  // namespace replica
