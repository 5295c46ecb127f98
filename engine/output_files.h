// The files a run writes. An output is checked before the work starts (hours of training must
// not end in "cannot write"), written whole or not at all (a temporary file renamed over it),
// and a temporary left by a process that died while writing is removed the next time the same
// file is written (or, for the writing process itself, when a second Ctrl-C ends it).
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace replica {

// Where an output named `path` is written: a symbolic link's target (the link stays a link),
// through a temporary renamed over it when that is a regular file or nothing yet; in place when
// it is a device or a pipe (/dev/null), which a rename would replace. A name of one of this
// process's open descriptors (/dev/stdout, /dev/fd/N, /proc/self/fd/N) is written through that
// descriptor, after what it already holds: `--metrics-json /dev/stdout > log` adds the metrics
// after the progress lines (renamed over "log" they were lost, and a pipe's link led nowhere).
struct OutputTarget {
  std::string path;
  bool in_place = false;
  int fd = -1;  // the open descriptor named, or -1
};
OutputTarget output_target(const std::string& path);
// An in-place target opened for writing (its descriptor duplicated, or the device or pipe
// opened by name; the process's own buffered output flushed first): -1 and errno on failure.
int open_in_place(const OutputTarget& target);

// `path` (given with `flag`) can be written: not a directory, its directory exists and this
// process may write into it (a device or pipe: may write to it). UsageError naming the flag
// otherwise.
void check_output_file(const std::string& flag, const std::string& path);
// `path` is a writable directory, or can be created: its nearest existing ancestor is one.
void check_output_dir(const std::string& flag, const std::string& path);

// "<path>.tmp-<pid>": where this process writes `path` before renaming it into place.
std::string temporary_for(const std::string& path);
// Removes "<path>.tmp-<pid>" files whose process no longer runs (never this process's own).
void remove_stale_temporaries(const std::string& path);

// The temporary being written now, so a signal handler can remove it before the process ends
// (async-signal-safe: unlink() of a fixed buffer). Set while writing, cleared after the rename.
void mark_temporary(const std::string& tmp);
void clear_temporary();
void remove_temporary_in_progress();  // from a signal handler

// Writes the output `path` with `write(fd, file)` (`file` names what fd is, for its errors): into its temporary, synced to disk and renamed over
// it (its directory synced too), or in place for a device, pipe or descriptor. Any failure is
// one Error, "cannot write '<path>': why", with the temporary removed and the old file kept.
using OutputWriter = std::function<void(int fd, const std::string& file)>;
void write_output(const std::string& path, const OutputWriter& write);
// write_output of a text.
void write_file_atomically(const std::string& path, const std::string& text);

// Adds `text` after what `path` holds (a newline first where its last line has none): the old
// lines and the new ones are written whole, like every output, so a full disk or a signal leaves
// the file as it was, never with half a line added. A second process adding to the same file
// (a sweep started in two terminals) waits for the first, so neither's lines are lost.
void append_file_atomically(const std::string& path, const std::string& text);

// A set of outputs in one directory written as one (replica-bench --report): they go into a
// hidden staging directory inside `dir`, and commit() moves them into place. A failure or a
// signal before commit() leaves every file of `dir` as it was (the staging directory is removed
// when this object goes, or after a signal by the next run; so are the directories it created,
// while they are empty); files `dir` holds that the set does not write (a user's notes, the
// traces a re-rendered report keeps) stay. commit() moves the files it replaces aside first and
// puts them back if a move fails, with Ctrl-C and termination held back meanwhile: `dir` holds
// the old set or the new one, never some of each.
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
  std::string dir_, staging_;
  std::vector<std::string> created_;  // directories made for `dir`, innermost first
  std::vector<std::string> dropped_;
  bool committed_ = false;
  bool keep_staging_ = false;  // a failed commit() could not put every old file back
};

}  // namespace replica
