#include "parallel/rendezvous/rank_errors.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/output_files.h"
#include "parallel/comm/peer_monitor.h"

namespace replica {

namespace {

struct RankReport {
  int rank = 0;
  std::string program, message;
  std::vector<int> silent;  // ranks this one found had stopped answering
  int exit_code = 1;
};

std::vector<RankReport> read_reports(const std::string& dir, int first_rank, int count) {
  std::vector<RankReport> out;
  for (int r = first_rank; r < first_rank + count && !dir.empty(); ++r) {
    std::ifstream in(fmt::format("{}/rank{}.json", dir, r));
    if (!in) continue;
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) continue;
    RankReport rep;
    rep.rank = r;
    rep.program = j.value("program", std::string("rank"));
    rep.message = j.value("message", std::string());
    rep.silent = j.value("silent", std::vector<int>());
    rep.exit_code = j.value("exit_code", 1);
    out.push_back(std::move(rep));
  }
  return out;
}

}  // namespace

RankErrors::RankErrors() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/replica-launch-XXXXXX";
  if (mkdtemp(pattern.data())) dir_ = pattern;
}

RankErrors::~RankErrors() {
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

RankErrors::Printed RankErrors::print(int first_rank, int count, int failed_rank) const {
  std::vector<RankReport> reports = read_reports(dir_, first_rank, count);
  Printed printed;
  for (const auto& r : reports)
    if (r.rank == failed_rank) printed.culprits = r.silent;
  // Ranks that failed because the first one had (a peer gone after the job was stopped) only
  // repeat the story: left out.
  reports.erase(std::remove_if(reports.begin(), reports.end(),
                               [&](const RankReport& r) {
                                 return failed_rank >= 0 && r.rank != failed_rank &&
                                        std::count(r.silent.begin(), r.silent.end(), failed_rank);
                               }),
                reports.end());
  std::vector<std::pair<std::string, std::vector<int>>> distinct;  // in rank order
  for (const auto& r : reports) {
    const std::string line = r.program + ": error: " + r.message;
    auto it = std::find_if(distinct.begin(), distinct.end(),
                           [&](const auto& d) { return d.first == line; });
    if (it == distinct.end()) distinct.push_back({line, {r.rank}});
    else it->second.push_back(r.rank);
  }
  for (const auto& [line, ranks] : distinct) {
    const bool everyone = distinct.size() == 1 && int(ranks.size()) == count && count > 1;
    const std::string who = everyone ? "every rank" : rank_list(ranks);
    std::fprintf(stderr, "%s [%s]\n", line.c_str(), who.c_str());
  }
  if (distinct.size() == 1 && int(reports.size()) == count &&
      std::all_of(reports.begin(), reports.end(),
                  [&](const RankReport& r) { return r.exit_code == reports[0].exit_code; }))
    printed.every_rank_exit_code = reports[0].exit_code;
  return printed;
}

bool report_error_to_launcher(const std::string& program, const std::exception& error,
                              int exit_code) {
  const char* dir = std::getenv(RankErrors::kEnvVar);
  const char* rank = std::getenv("RANK");
  if (!dir || !*dir || !rank || !*rank) return false;
  nlohmann::json j = {{"program", program}, {"message", error.what()}, {"exit_code", exit_code}};
  if (const auto* pf = dynamic_cast<const PeerFailure*>(&error)) j["silent"] = pf->ranks();
  try {
    write_file_atomically(fmt::format("{}/rank{}.json", dir, rank), j.dump() + "\n");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace replica
