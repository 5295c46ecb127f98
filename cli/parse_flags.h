// Values of list-like flags shared by the programs: "--threads 1,2", "--input-shape 3x224x224".
// Header-only; bad text is a UsageError naming the flag.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/error.h"

namespace replica {

// "1,2,4" (sep ',') or "3x224x224" (sep 'x'): positive integers below a million; the flag's name
// and the whole text go into the error.
inline std::vector<int64_t> parse_positive_list(const std::string& text, char sep,
                                                const std::string& flag) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (true) {
    const size_t at = text.find(sep, start);
    const std::string part = text.substr(start, at == std::string::npos ? at : at - start);
    REPLICA_USAGE_CHECK(!part.empty() && part.size() < 7 &&
                            part.find_first_not_of("0123456789") == std::string::npos &&
                            std::stoll(part) > 0,
                        "{} '{}': expected positive integers below a million, got '{}'", flag,
                        text, part);
    out.push_back(std::stoll(part));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return out;
}

// --input-shape CxHxW.
inline std::vector<int64_t> parse_input_shape(const std::string& text) {
  REPLICA_USAGE_CHECK(!text.empty() && text.find_first_not_of("0123456789x") == std::string::npos,
                      "--input-shape '{}': expected CxHxW, e.g. 3x224x224", text);
  std::vector<int64_t> shape = parse_positive_list(text, 'x', "--input-shape");
  REPLICA_USAGE_CHECK(shape.size() == 3, "--input-shape '{}': expected CxHxW, e.g. 3x224x224",
                      text);
  return shape;
}

}  // namespace replica
