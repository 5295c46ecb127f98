// How a rank's fatal error reaches the launcher. A rank started by launch_ranks() writes its error
// as one small JSON file (program, message, exit code and, for a PeerFailure, the ranks it found
// had stopped answering) into a directory the launcher made for the job; the launcher, once every
// rank has ended, prints each distinct message once with the ranks it came from, instead of N
// interleaved copies, and can say which rank the first failure blamed.
#pragma once
#include <exception>
#include <string>
#include <vector>

namespace replica {

// The launcher's side: a fresh directory for the job (REPLICA_ERROR_DIR in the ranks'
// environment), removed when the launch ends.
class RankErrors {
 public:
  static constexpr const char* kEnvVar = "REPLICA_ERROR_DIR";

  RankErrors();
  ~RankErrors();
  RankErrors(const RankErrors&) = delete;
  RankErrors& operator=(const RankErrors&) = delete;

  const std::string& dir() const { return dir_; }

  struct Printed {
    std::vector<int> culprits;  // the ranks failed_rank found silent (empty: it named none)
    // Every rank reported the same error with the same exit code (a bad flag all of them share,
    // a data file all of them read): that one line said it all. 0 otherwise.
    int every_rank_exit_code = 0;
  };
  // Prints the reports of ranks [first_rank, first_rank + count) to stderr: each distinct message
  // once, tagged "[every rank]", "[rank 3]" or "[ranks 0, 2]". When failed_rank (-1: none) found
  // peers silent, the reports of ranks that only failed because they lost failed_rank are left
  // out.
  Printed print(int first_rank, int count, int failed_rank) const;

 private:
  std::string dir_;
};

// A rank's side: under a launcher (REPLICA_ERROR_DIR and RANK set) writes the error for it and
// returns true; false when not under one, or the report cannot be written (the caller prints
// the error itself then).
bool report_error_to_launcher(const std::string& program, const std::exception& error,
                              int exit_code);

}  // namespace replica
