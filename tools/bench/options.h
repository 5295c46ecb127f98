// replica-bench's command line, parsed (tools/replica_bench.cpp) and then resolved against the
// machine: values not given (std::nullopt, empty) get the defaults of the chosen suite.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/parse_flags.h"  // parse_positive_list, parse_input_shape

namespace replica::bench {

struct BenchOptions {
  // single | loader | dp | ddp | dp,ddp (empty: single, or dp,ddp with --report)
  std::string suite;
  std::string model = "cnn";
  std::string input_shape;       // empty: 1x28x28 for cnn, 3x224x224 otherwise
  std::string data;              // loader: an image folder instead of synthetic samples
  int64_t batch = 64;            // single: the batch; dp/ddp: the batch per device
  std::string threads;           // single, loader: comma list of thread counts
  std::string devices;           // dp/ddp: the largest device set (cpu*N, cuda, cuda:0*N)
  std::string device_counts;     // dp/ddp: comma list (default 1, 2, 4, ..., N)
  // Not given: std::nullopt, never a number a user can type, so every typed value is checked
  // (-1 and 0 stood for "not given" and passed as it). run_suite() fills warmup, steps and
  // repeat for single, loader and ops; dp/ddp choose warmup and steps from a measured step time.
  std::optional<int> threads_per_device;  // dp/ddp CPU: cores / largest count; ops: every core
  std::optional<int64_t> warmup, steps;
  std::optional<int> repeat;
  std::optional<int64_t> trace_steps;  // steps in each traced window (with --trace-dir: 5)
  double sgemm_seconds = 1.0;
  int64_t seed = 0;  // >= 0 (checked): the unsigned seed of weights and data
  std::string reduce = "root";
  std::string backend = "auto";
  std::string precision = "auto";  // dp/ddp/ops: auto | fp32 | tf32 | bf16 (engine/context.h)
  bool cudnn_benchmark = false;    // dp/ddp/ops on GPUs: convolution algorithms timed per shape
  bool cuda_graphs = false;        // dp on one GPU: the step captured and replayed
  std::string memory_format = "auto";  // dp/ddp/ops on GPUs: auto | nchw | channels_last
  bool by_shape = false;           // ops: each op split by its tensors' shapes
  double timeout_s = 300;
  std::string json, csv, trace_dir;
  std::string report_dir;
  std::vector<std::string> compare;  // JSON-lines files of other engines' rows
  std::string from_results;          // re-render a report from this directory's results
  std::string link;                  // declared interconnect for the projection (link.h)
  bool skip_alpha_beta = false;
  std::string worker, worker_out;    // hidden: a DDP rank of this program
  std::string command_line;          // for the report
};

// The per-sample input shape: --input-shape CxHxW, else 1x28x28 for cnn, 3x224x224 otherwise.
std::vector<int64_t> resolve_input_shape(const BenchOptions& o);
// Checks the options every suite shares (model, batch, steps, ...): UsageError on the first problem.
void validate_common(const BenchOptions& o);

// The "single" suite (one device per thread count, against the sgemm ceiling).
int run_single_suite(const BenchOptions& o);
// The "loader" suite (the input pipeline's samples/s, 1 thread against every core).
int run_loader_suite(const BenchOptions& o);
// The "ops" suite (one device's step, op by op).
int run_ops_suite(const BenchOptions& o);
// The "dp"/"ddp" suites, optionally with a report (--report DIR).
int run_parallel_suites(const BenchOptions& o);
// A hidden DDP rank worker (--worker).
int run_worker(const BenchOptions& o);

}  // namespace replica::bench
