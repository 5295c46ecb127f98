// What every replica program does at its edges: parse flags with CLI11 (help -> exit 0, a bad
// flag -> one line and exit 2) and turn errors into one line on stderr: "NAME: error: ..." with
// exit code 2 for usage errors, 1 for everything else. A rank under replica-launch hands the
// error to its launcher instead, which prints it once for all ranks
// (parallel/rendezvous/launcher.h).
// Header-only: programs link CLI11.
#pragma once
#include <unistd.h>  // environ (glibc declares it with _GNU_SOURCE, g++'s default)

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/parse_flags.h"
#include "engine/context.h"
#include "engine/env_switch.h"
#include "engine/error.h"
#include "parallel/rendezvous/rank_errors.h"

namespace replica {

// The first integer flag value that does not fit in 64 bits, as "--flag 'text'" (empty: none).
// CLI11 stores such a value as the nearest extreme, which then passes range checks meant for
// what the user typed ("--batch-size 99999999999999999999" became 2^63 - 1).
inline std::string integer_out_of_range(const CLI::App& app) {
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_type_name() != "INT" && opt->get_type_name() != "UINT") continue;
    for (const std::string& text : opt->results()) {
      errno = 0;
      char* end = nullptr;
      if (opt->get_type_name() == "UINT") std::strtoull(text.c_str(), &end, 0);
      else std::strtoll(text.c_str(), &end, 0);
      if (errno == ERANGE) return fmt::format("{} '{}'", opt->get_name(), text);
    }
  }
  return "";
}

// Edit distance between two flag names (insertions, deletions, substitutions): how far a typo is.
inline size_t flag_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The environment's switches, checked when a program starts rather than where each is read:
// every one set must be 1 or 0 (a GPU-only switch is read on a GPU only, so a CPU run would
// never see its typo), REPLICA_CUDNN_API and REPLICA_RESIDUAL_SUM one of their words, and a
// REPLICA_ variable one or two letters from a switch's name (REPLICA_PAD_CHANNEL=0) is a typo
// that would otherwise time the default.
inline void check_environment_switches() {
  std::vector<std::string> known(std::begin(switches::kChoices), std::end(switches::kChoices));
  for (const EnvSwitch* s : switches::kAll) {
    static_cast<void>(s->on());
    known.push_back(s->name());
  }
  static_cast<void>(conv_api_from_environment());  // read by CUDA devices only, checked here
  static_cast<void>(switches::residual_sum_in_conv());  // read by ResNets only
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (name.rfind("REPLICA_", 0) != 0 ||
        std::find(known.begin(), known.end(), name) != known.end())
      continue;
    for (const std::string& k : known)
      REPLICA_USAGE_CHECK(flag_distance(name, k) > 2,
                          "{} is not a variable replica reads (did you mean {}?)", name, k);
  }
}

// "unknown flag --devics (did you mean --devices?)" for the first flag the parse left over that
// the program does not have, or "" when there is none. A typo used to read as CLI11's "The
// following arguments were not expected: cpu*2 --devics", or as "--replicas is required" when
// the mistyped flag was a required one.
inline std::string unknown_flag(const CLI::App& app) {
  // A program that hands flags on (replica-launch's command, replica-dp-vs-ddp's replica-train
  // flags) keeps them among the leftovers: they are not its to judge.
  if (app.get_allow_extras() || app.get_prefix_command()) return "";
  for (const std::string& arg : app.remaining()) {
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const std::string name = arg.substr(0, arg.find('='));
    if (app.get_option_no_throw(name) != nullptr) continue;
    std::string best;
    size_t best_distance = 3;  // at most two edits, or a prefix of the real flag
    for (const CLI::Option* opt : app.get_options()) {
      for (const std::string& known : opt->get_lnames()) {
        const std::string flag = "--" + known;
        const size_t d = flag.rfind(name, 0) == 0 ? 1 : flag_distance(name, flag);
        if (d < best_distance) best_distance = d, best = flag;
      }
    }
    return fmt::format("unknown flag {}{}", name,
                       best.empty() ? "" : fmt::format(" (did you mean {}?)", best));
  }
  return "";
}

// Puts every option declared since the last call (those still in CLI11's default group) under
// the heading `name` in --help, so a long flag list reads in sections.
inline void group_options(CLI::App& app, const std::string& name) {
  for (CLI::Option* opt : app.get_options())
    if (opt->get_group() == "Options" && opt->get_name() != "--help") opt->group(name);
}

// CLI11's "Could not convert: --batch-size = abc" in the words of the other flag errors:
// "--batch-size 'abc': expected a whole number", or "the number is too large" for a whole number
// beyond the flag's type (--accumulate 99999999999). "" where the message is not that one.
inline std::string bad_value(const CLI::App& app, const std::string& message) {
  const std::string head = "Could not convert: ";
  const size_t eq = message.find(" = ");
  if (message.rfind(head, 0) != 0 || eq == std::string::npos) return "";
  const std::string name = message.substr(head.size(), eq - head.size());
  const std::string text = message.substr(eq + 3);
  const CLI::Option* opt = app.get_option_no_throw(name);
  const std::string type = opt != nullptr ? opt->get_type_name() : "";
  char* end = nullptr;
  std::strtoll(text.c_str(), &end, 10);
  const bool whole = !text.empty() && *end == '\0';
  if (type == "INT" || type == "UINT")
    return fmt::format("{} '{}': {}", name, text,
                       whole ? "the number is too large" : "expected a whole number");
  if (type == "FLOAT") return fmt::format("{} '{}': expected a number", name, text);
  return "";
}

// Returns an exit code when the program should stop now (help printed). A bad flag is a
// UsageError, so it takes run_program's one path: one line, exit 2, and under replica-launch
// one line for all ranks rather than one per rank.
inline std::optional<int> parse_cli(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    // Leftovers explain only these two; a bad value (--epochs abc) is CLI11's own message.
    const bool leftovers_matter = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr ||
                                  dynamic_cast<const CLI::RequiredError*>(&e) != nullptr;
    if (const std::string unknown = leftovers_matter ? unknown_flag(app) : "";
        !unknown.empty())
      throw UsageError(unknown + " (see --help)");
    std::string msg = e.what();
    if (const std::string bad = bad_value(app, msg); !bad.empty()) msg = bad;
    // CLI11's counts, said in words: "--optimizer: 1 required TEXT missing", "--batch-size: At
    // Most 1 required but received 2".
    const size_t colon = msg.find(": ");
    if (colon != std::string::npos && msg.rfind("--", 0) == 0) {
      const std::string flag = msg.substr(0, colon), rest = msg.substr(colon + 2);
      const std::string at_most = "At Most 1 required but received ";
      if (rest.find("required") != std::string::npos && rest.find("missing") != std::string::npos)
        msg = flag + " needs a value";
      else if (rest.rfind(at_most, 0) == 0)
        msg = flag + " is given " + rest.substr(at_most.size()) + " times: give it once";
    }
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    throw UsageError(msg + " (see --help)");
  }
  if (const std::string bad = integer_out_of_range(app); !bad.empty())
    throw UsageError(bad + ": the number is too large (see --help)");
  // An empty flag value would otherwise read as "not given" (--devices "" as every device).
  // Positionals (replica-launch's command line) pass through as typed.
  for (const CLI::Option* opt : app.get_options())
    if (opt->nonpositional())
      for (const std::string& text : opt->results())
        REPLICA_USAGE_CHECK(!text.empty(), "{} '': give a value (see --help)", opt->get_name());
  return std::nullopt;
}

template <class Body>
int run_program(const char* name, Body&& body) {
  auto report = [&](const std::exception& e, int code) {
    if (!report_error_to_launcher(name, e, code))
      std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return code;
  };
  try {
    check_environment_switches();
    const int code = body();
    // What went to stdout must have arrived: `> /dev/full` or a closed stdout lost the
    // output (a sampler's --json, --print-config) and still exited 0.
    errno = 0;
    if (std::fflush(stdout) != 0 || std::ferror(stdout))
      throw Error(fmt::format("cannot write the output to standard output: {}",
                              errno != 0 ? std::strerror(errno) : "write error"));
    return code;
  } catch (const UsageError& e) {
    return report(e, 2);
  } catch (const std::bad_alloc&) {
    // what() is only "std::bad_alloc": say what ran out.
    return report(Error("out of host memory (an allocation failed): a smaller batch, model or "
                        "data set?"),
                  1);
  } catch (const std::exception& e) {
    return report(e, 1);
  }
}

}  // namespace replica
