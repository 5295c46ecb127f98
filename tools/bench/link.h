// A declared interconnect between separate GPUs (replica-bench --link), for projecting what was
// measured on one GPU (or on CPU devices) to GPUs joined by that link. A one-GPU machine cannot
// measure NVLink or PCIe between GPUs; the projection then takes the link's published bandwidth
// instead, says which figure it used, and keeps the latency that was measured.
#pragma once
#include <string>
#include <vector>

namespace replica::bench {

struct Link {
  std::string name;         // "nvlink4", "pcie5", or "25 GB/s" for a figure given by hand
  double bytes_per_s = 0;   // one direction, into (or out of) one GPU
  std::string published;    // where the figure comes from
};

// "nvlink3" | "nvlink4" | "pcie4" | "pcie5" | a bandwidth per direction in GB/s ("25",
// "25GB/s"). UsageError naming the known links otherwise.
Link parse_link(const std::string& text);

// The named links, for --help and messages.
const std::vector<Link>& known_links();

}  // namespace replica::bench
