// Rendezvous: every rank learns its rank and world size (from the launcher's environment, Open
// MPI's or Slurm's) and connects to one key-value store, then all of them join before any goes on.
// env:// and tcp:// put the store on rank 0 (TcpStoreServer), file:// in a shared directory.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "parallel/rendezvous/store.h"

namespace replica {

struct RendezvousOptions {
  // "env://" (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), "tcp://host:port" or
  // "file://DIR". tcp:// and file:// take rank/world size from below, else from the environment.
  std::string init_method = "env://";
  int rank = -1;        // -1: from the environment
  int world_size = -1;  // -1: from the environment
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
};

struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::shared_ptr<Store> store;
  // Where the other ranks reach this process (Gloo binds here): the address of this machine's
  // interface that routes to rank 0's node (MASTER_ADDR, tcp://HOST), so a rank on another node
  // offers its own address, not rank 0's; 127.0.0.1 when every rank is on this machine.
  std::string address = "127.0.0.1";
};

// A --timeout given in seconds, as every program takes it: from a millisecond to a week (NaN,
// infinity or a year would overflow the clocks it is added to); UsageError naming `flag` else.
std::chrono::milliseconds timeout_from_seconds(double seconds, const char* flag);

// Rank and world size from the environment: RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE
// (replica-launch, torchrun), else OMPI_COMM_WORLD_*, else SLURM_PROCID/SLURM_NTASKS/
// SLURM_LOCALID, else a single process. store stays null.
Rendezvous rendezvous_env_ranks();

// This machine's address on the way to `host` (the source address of a route to it; nothing is
// sent). Empty when `host` does not resolve or no route leads there.
std::string local_address_toward(const std::string& host);

// An --init-method's text, its syntax checked (UsageError): env:// (the address and port come
// from MASTER_ADDR and MASTER_PORT when the ranks meet), tcp://HOST:PORT (a port up to 65535;
// 0 only for one process) or file://DIR. What rendezvous() connects by, and what a program
// checks before it starts any rank.
struct InitMethod {
  enum Kind { Env, Tcp, File } kind = Env;
  std::string host;  // tcp://: brackets of an IPv6 address removed
  int port = 0;      // tcp://
  std::string dir;   // file://
};
InitMethod parse_init_method(const std::string& method);

// Connects every rank to one store (rank 0 hosts the TCP server) and joins: each rank counts
// itself in, then all wait until world_size ranks have joined. A timeout names the missing
// ranks; a rank that joins twice (or a reused file:// directory) is an error.
Rendezvous rendezvous(const RendezvousOptions& options = {});

}  // namespace replica
