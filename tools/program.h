// What every replica program does at its edges: parse flags with CLI11 (help -> exit 0, a bad
// flag -> one line and exit 2) and turn errors into one line on stderr: "NAME: error: ..." with
// exit code 2 for usage errors, 1 for everything else. Header-only: programs link CLI11.
#pragma once
#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/error.h"
#include "tools/parse_flags.h"

namespace replica {

// Returns an exit code when the program should stop now (help printed, or a bad flag).
inline std::optional<int> parse_cli(CLI::App& app, const char* name, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "%s: error: %s (see --help)\n", name, msg.c_str());
    return 2;
  }
  return std::nullopt;
}

template <class Body>
int run_program(const char* name, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace replica
