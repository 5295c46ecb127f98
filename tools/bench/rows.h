// Result rows: one JSON object per measured configuration (mode x device count x model x batch),
// the same fields for DP, DDP and PyTorch's rows, written as JSON lines and CSV.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/device.h"
#include "tools/bench/harness.h"

namespace replica::bench {

// What a configuration ran: mode, its n devices, the harness options.
struct Config {
  std::string mode;              // "dp" | "ddp"
  std::vector<Device> devices;   // the n devices (DDP: rank r on devices[r])
  RunOptions run;
  std::string reduce = "root";   // DP reduction strategy
  std::string backend = "gloo";  // DDP process group
};

// Sizes of the model that the byte counts and the projection need.
struct ModelFacts {
  int64_t params = 0;
  int64_t buffer_elements = 0;
  std::vector<int64_t> bucket_bytes;  // gradient buckets in launch order (1 MB, then 25 MB caps)
};
ModelFacts model_facts(const std::string& model, const Shape& input_shape);

// The track whose phases make up a step: DP device 0, DDP rank 0's device.
std::string primary_track(const Config& c);

// One row from the measurements of a configuration (DP: one; DDP: one per rank, rank order).
nlohmann::json make_row(const Config& c, const ModelFacts& facts,
                        const std::vector<Measurement>& ranks, const nlohmann::json& env);

// Fills speedup and efficiency of every row against the 1-device row of the same engine, mode,
// model, input shape and batch per device (null when there is none).
void add_scaling(std::vector<nlohmann::json>& rows);

// Appends rows to a JSON-lines file (--json: a user's file that grows run after run).
void append_rows(const std::string& path, const std::vector<nlohmann::json>& rows);
// Writes rows as a whole JSON-lines file / as CSV, through write_file_atomically.
void write_rows(const std::string& path, const std::vector<nlohmann::json>& rows);
void write_csv(const std::string& path, const std::vector<nlohmann::json>& rows);

// How rows and the all-reduce fit name what DDP's collectives ran over: `backend`, or
// "nccl-sockets" where NCCL's ranks share a GPU (parallel/comm/nccl_placement.h), "gloo-shm"
// where Gloo's ranks all-reduced through shared memory (`collectives`: the group's describe()).
std::string ddp_transport(const std::string& backend, const std::string& collectives,
                          bool share_gpu);

// The fields every row has (replica's and PyTorch's).
const std::vector<std::string>& required_fields();

}  // namespace replica::bench
