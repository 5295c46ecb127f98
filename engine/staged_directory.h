// replica-bench --report's directory: a set of outputs written as one, so that the directory
// holds the old report or the new one, never some of each (output_files.h: single outputs).
#pragma once
#include <string>
#include <vector>

namespace replica {

// A set of outputs in one directory written as one (replica-bench --report): they go into a
// hidden staging directory inside `dir`, and commit() moves them into place. A failure or a
// signal before commit() leaves every file of `dir` as it was (the staging directory is removed
// when this object goes, or after a signal by the next run; so are the directories it created,
// while they are empty); files `dir` holds that the set does not write (a user's notes, the
// traces a re-rendered report keeps) stay. commit() moves the files it replaces aside first and
// puts them back if a move fails, with Ctrl-C and termination held back meanwhile: `dir` holds
// the old set or the new one, never some of each. (A commit killed outright between its moves
// loses nothing: the next StagedDirectory of `dir` puts back the old files it finds missing.)
class StagedDirectory {
 public:
  explicit StagedDirectory(const std::string& dir);
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  const std::string& path() const { return staging_; }  // where to write until commit()
  // A file of `dir` the new set does not have: commit() removes it.
  void drop(const std::string& name) { dropped_.push_back(name); }
  void commit();

 private:
  void restore_replaced();

  std::string dir_, staging_;
  std::vector<std::string> created_;  // directories made for `dir`, innermost first
  std::vector<std::string> dropped_;
  bool committed_ = false;
  bool keep_staging_ = false;  // a failed commit() could not put every old file back
};

}  // namespace replica
