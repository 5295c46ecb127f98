// On/off switches in the environment (REPLICA_CUDA_SLICED_SUMS, REPLICA_PAD_CHANNELS, ...): the
// knobs that turn one change off to time it against the old way in one run, and the debug
// checks. They are read by one rule, so that each does not speak its own dialect: unset or
// empty is the switch's default, "1" turns it on, "0" off, and any other word is a usage error
// that names the variable. A typo (REPLICA_PAD_CHANNELS=false, =off) then stops the run with one
// line instead of quietly timing the default. Callers read a switch where they use it, not once
// at start-up, where a test turns it for one case.
#pragma once
#include <cstdlib>
#include <cstring>

#include "engine/error.h"

namespace replica {

inline bool env_switch(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  if (std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  throw UsageError(fmt::format("{}='{}': expected 1 (on) or 0 (off)", name, v));
}

}  // namespace replica
