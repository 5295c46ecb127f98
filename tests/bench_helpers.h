// What the replica-bench suites share: the program, the committed fixture of saved results, the
// CNN's parameter count, and the JSON-lines files the program writes.
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"

namespace test {

inline const std::string kBench = bin("replica-bench");
inline const std::string kFixture = std::string(REPLICA_SOURCE_DIR) + "/tests/data/bench";
inline constexpr int64_t kCnnParams = 111100;  // 520 + 10,020 + 100,050 + 510

// One JSON object per non-empty line (replica-bench --json, results.jsonl).
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace test
