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
// Ranks get 120 s after a forwarded signal to finish their step and write a checkpoint.
// Children die with the launcher (PR_SET_PDEATHSIG) and read /dev/null when stdin is a terminal
// (a background process group reading the terminal would be stopped).
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/program.h"

#include "engine/error.h"
#include "parallel/rendezvous/launcher.h"

using namespace replica;

namespace {

int run(int argc, char** argv) {
  LaunchOptions o;
  int& nproc = o.nproc_per_node;
  int& nnodes = o.nnodes;
  int& node_rank = o.node_rank;
  int& master_port = o.master_port;
  std::string& master_addr = o.master_addr;
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
      "signal, the others get SIGTERM, then SIGKILL after 5 s. A forwarded Ctrl-C gives "
      "the ranks 120 s to stop cleanly; a second one kills them.");
  if (auto code = parse_cli(app, argc, argv)) return *code;
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
  o.command = command;
  return launch_ranks(o);
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-launch", [&] { return run(argc, argv); });
}
