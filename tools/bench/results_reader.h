// Reading a results directory back (--from-results, --compare): results.jsonl and compare.jsonl
// rows, alpha_beta.json. Every field the report, the projection and the tables read is checked
// for its type here, so a hand-edited or foreign file fails on reading with the file, the line
// and the field named, never later inside the report with a JSON library's message or a crash.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace replica::bench {

// Rows of a JSON-lines file (blank lines skipped). Throws UsageError naming the file and line
// for missing or unreadable files (a pipe or a directory too), bad JSON, rows missing a
// required field or a field of the wrong type.
std::vector<nlohmann::json> read_rows(const std::string& path);

// alpha_beta.json's measurements (null when the file is absent). Throws UsageError naming the
// file and the entry for bad JSON or an entry that is not what measure_* wrote.
nlohmann::json read_alpha_beta(const std::string& path);

}  // namespace replica::bench
