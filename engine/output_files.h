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
// check_output_file for a file of weights (--save-model, --save-best): a descriptor's name
// (/dev/stdout) is refused, as the run's own lines, or --save-best's next model, would be
// written into the same stream.
void check_weights_file(const std::string& flag, const std::string& path);
// `path` is a writable directory, or can be created: its nearest existing ancestor is one.
void check_output_dir(const std::string& flag, const std::string& path);

// A new directory "<prefix>XXXXXX" (mkdtemp) under $TMPDIR, else /tmp, for files a program
// writes and removes itself. Error when it cannot be made, saying what it was `for_what` and why
// in one line ("cannot make a temporary directory for the runs' logs: TMPDIR=/nonexistent does
// not exist").
std::string make_temporary_directory(const std::string& prefix, const std::string& for_what);

// A path given with its flag, for messages ("--save-model 'm.safetensors'").
struct FlagPath {
  std::string flag, path;
};
// An input the run reads, named by its flag and path, and which files are its own (--data:
// data_dir_reads).
struct ReadInput {
  std::string flag, path;
  std::function<bool(const std::string& file)> reads;
};
// The outputs of one run, checked together before the work starts, since each is written
// whole over what was there and the run exits 0 after: no two of them are the same file (the
// last one written would replace the others), and none replaces a file the run reads or keeps.
// `kept` are files the run writes itself (the checkpoint); an output may not replace an
// existing file that one of `inputs` reads.
// Sameness is a file's device and inode where it exists (so links and other spellings count),
// else its resolved path; devices, pipes and descriptors (/dev/null, /dev/stdout) are exempt.
// UsageError naming both flags otherwise.
void check_outputs_apart(const std::vector<FlagPath>& outputs, const std::vector<FlagPath>& kept,
                         const std::vector<ReadInput>& inputs);

// "<path>.tmp-<pid>": where this process writes `path` before renaming it into place.
std::string temporary_for(const std::string& path);
// Whether `name` is "<prefix><pid>" of a process that no longer runs (never this one's).
bool stale_temporary(const std::string& name, const std::string& prefix);
// Removes "<path>.tmp-<pid>" files and directories that stale_temporary() finds.
void remove_stale_temporaries(const std::string& path);

// The temporary being written now, so a signal handler can remove it before the process ends
// (async-signal-safe: unlink() of a fixed buffer). Set while writing, cleared after the rename.
void mark_temporary(const std::string& tmp);
void clear_temporary();
void remove_temporary_in_progress();  // from a signal handler

// Writes the output `path` with `write(fd, file)` (`file` names what fd is, for its errors):
// into its temporary, synced to disk and renamed over it (its directory synced too), or in
// place for a device, pipe or descriptor. Any failure is one Error, "cannot write '<path>':
// why", with the temporary removed and the old file kept.
using OutputWriter = std::function<void(int fd, const std::string& file)>;
void write_output(const std::string& path, const OutputWriter& write);
// write_output of a text.
void write_file_atomically(const std::string& path, const std::string& text);

// Adds `text` after what `path` holds (a newline first where its last line has none): the old
// lines and the new ones are written whole, like every output, so a full disk or a signal leaves
// the file as it was, never with half a line added. A second process adding to the same file
// (a sweep started in two terminals) waits for the first, so neither's lines are lost.
void append_file_atomically(const std::string& path, const std::string& text);

}  // namespace replica
