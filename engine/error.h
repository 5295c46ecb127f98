// Errors: every failure a user can cause or act on is a replica::Error with a one-line message.
// Library code throws; only programs (samples/, tools/) turn errors into exit codes.
#pragma once
#include <stdexcept>
#include <string>
#include <fmt/format.h>

namespace replica {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Bad user input (flags, files, device strings): programs print it without a stack of context.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& message) : Error(message) {}
};

}  // namespace replica

// Throws replica::Error with file:line when cond is false. Message is fmt-formatted.
#define REPLICA_CHECK(cond, ...)                                                             \
  do {                                                                                       \
    if (!(cond))                                                                             \
      throw ::replica::Error(fmt::format("{} ({}:{})", fmt::format(__VA_ARGS__), __FILE__,   \
                                         __LINE__));                                         \
  } while (0)

#define REPLICA_USAGE_CHECK(cond, ...)                                                       \
  do {                                                                                       \
    if (!(cond)) throw ::replica::UsageError(fmt::format(__VA_ARGS__));                      \
  } while (0)
