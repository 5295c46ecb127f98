#include "engine/device.h"

#include <algorithm>
#include <set>
#include <thread>

#include "engine/cudart.h"
#include "engine/error.h"

namespace replica {

std::string Device::str() const {
  if (type == DeviceType::CPU) return fmt::format("cpu:{}", index);
  if (slot == 0) return fmt::format("cuda:{}", index);
  return fmt::format("cuda:{}#{}", index, slot);
}

int cpu_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int max_virtual_cpu_devices() { return std::max(16, 8 * cpu_cores()); }

int max_cpu_threads() { return std::max(64, 8 * cpu_cores()); }

void check_cpu_threads(const std::string& flag, int64_t n) {
  REPLICA_USAGE_CHECK(n >= 1 && n <= max_cpu_threads(),
                      "{} {}: give 1 to {} threads ({} cores here; more threads only "
                      "time-share them)",
                      flag, n, max_cpu_threads(), cpu_cores());
}

int cuda_device_count() { return cudart::device_count(); }

namespace {

// Non-negative decimal text; anything at or above `too_many` comes back as `too_many` (the
// callers' limit check then says so), so a long number is "too many", not "not a number".
int parse_count(const std::string& text, const std::string& spec, int too_many) {
  REPLICA_USAGE_CHECK(!text.empty() && std::all_of(text.begin(), text.end(), ::isdigit),
                      "invalid device string '{}': '{}' is not a number", spec, text);
  int64_t v = 0;
  for (char c : text) {
    v = v * 10 + (c - '0');
    if (v >= too_many) return too_many;
  }
  return int(v);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

}  // namespace

std::vector<Device> parse_devices(const std::string& spec_in, bool allow_multi) {
  std::string spec = spec_in;
  spec.erase(std::remove_if(spec.begin(), spec.end(), ::isspace), spec.end());
  REPLICA_USAGE_CHECK(!spec.empty(), "empty device string (try cpu, cpu*4, cuda, cuda:0,1)");
  std::string base = spec;
  int copies = 1;
  bool starred = false;
  if (auto star = spec.find('*'); star != std::string::npos) {
    base = spec.substr(0, star);
    copies = parse_count(spec.substr(star + 1), spec, 1 << 30);
    starred = true;
    REPLICA_USAGE_CHECK(copies >= 1, "invalid device string '{}': the count after * must be >= 1",
                        spec);
    // Every device is a thread with a replica of its own (on a GPU also a stream, cuBLAS and
    // cuDNN handles and a workspace): far past the hardware they only time-share it.
    const bool cpu = base == "cpu";
    const int most = cpu ? max_virtual_cpu_devices() : kMaxLogicalDevicesPerGpu;
    REPLICA_USAGE_CHECK(copies <= most,
                        "invalid device string '{}': {} {} devices{}; at most {} (each is a thread "
                        "with a replica of its own)",
                        spec, spec.substr(star + 1), cpu ? "virtual CPU" : "logical",
                        cpu ? fmt::format(" on {} core{}", cpu_cores(), cpu_cores() == 1 ? "" : "s")
                            : " on one GPU",
                        most);
  }
  std::vector<Device> devices;
  if (base == "cpu") {
    for (int i = 0; i < copies; ++i) devices.push_back({DeviceType::CPU, i, i});
  } else if (base.rfind("cuda", 0) == 0) {
    int count = cuda_device_count();
    std::vector<int> ordinals;
    if (base == "cuda") {
      REPLICA_USAGE_CHECK(count > 0, "device '{}': no CUDA GPU found{}", spec,
                          cuda_backend_note());
      for (int i = 0; i < count; ++i) ordinals.push_back(i);
    } else {
      REPLICA_USAGE_CHECK(base.size() > 5 && base[4] == ':',
                          "unknown device '{}' (try cpu, cpu*4, cuda, cuda:0, cuda:0,1, cuda:0*2)",
                          spec);
      const std::vector<std::string> parts = split(base.substr(5), ',');
      for (const auto& part : parts) ordinals.push_back(parse_count(part, spec, 1 << 20));
      REPLICA_USAGE_CHECK(!(starred && ordinals.size() > 1),
                          "device '{}': '*N' applies to a single GPU (e.g. cuda:0*2)", spec);
      std::set<int> seen;
      for (int o : ordinals)
        REPLICA_USAGE_CHECK(seen.insert(o).second,
                            "device '{}': GPU {} is listed twice; to run several logical devices "
                            "on one GPU write cuda:{}*N",
                            spec, o, o);
      for (size_t i = 0; i < ordinals.size(); ++i)  // the text: a huge number is not clamped
        REPLICA_USAGE_CHECK(ordinals[i] < count,
                            "device '{}': GPU {} does not exist ({} GPU{} found{})", spec,
                            parts[i], count, count == 1 ? "" : "s", cuda_backend_note());
    }
    for (int o : ordinals)
      for (int c = 0; c < copies; ++c) devices.push_back({DeviceType::CUDA, o, c});
  } else if (base.rfind("cpu:", 0) == 0) {
    // The tables name virtual CPU devices cpu:0, cpu:1, ...; the flag counts them instead.
    throw UsageError(fmt::format("unknown device '{}': CPU devices are counted, not numbered: "
                                 "cpu for one, cpu*N for N (cpu:0 .. cpu:N-1 in the tables)",
                                 spec));
  } else {
    throw UsageError(fmt::format(
        "unknown device '{}' (try cpu, cpu*4, cuda, cuda:0, cuda:0,1, cuda:0*2)", spec));
  }
  REPLICA_USAGE_CHECK(allow_multi || devices.size() == 1,
                      "device '{}' names {} devices; this program uses one", spec, devices.size());
  return devices;
}

bool devices_share_hardware(const std::vector<Device>& devices) {
  std::set<int> gpus;
  size_t n_gpu = 0;
  for (const auto& d : devices)
    if (d.is_cuda()) {
      gpus.insert(d.index);
      ++n_gpu;
    }
  return gpus.size() != n_gpu;
}

std::vector<std::string> describe_devices() {
  std::vector<std::string> lines;
  const int cores = cpu_cores();
  lines.push_back(fmt::format("cpu      {} core{} (virtual devices: cpu*N)", cores,
                              cores == 1 ? "" : "s"));
  // Loaded here even without a driver, so --list-devices also says whether the backend works.
  const std::string problem = cudart::load_problem();
  if (!problem.empty()) lines.push_back("cuda     the CUDA backend " + problem);
  int n = cuda_device_count();
  if (n == 0 && problem.empty())
    lines.push_back("cuda     backend loaded; no GPU found" + cuda_backend_note());
  for (int i = 0; i < n; ++i) {
    const int cc = cudart::compute_capability(i);
    lines.push_back(fmt::format("cuda:{}   {}, {:.1f} GiB, compute capability {}.{}{}", i,
                                cudart::device_name(i),
                                cudart::device_total_memory(i) / double(1ull << 30), cc / 10,
                                cc % 10, cc >= 80 ? " (TF32 tensor cores)" : ""));
  }
  if (n > 0) lines.push_back("         " + cudart::versions());
  return lines;
}

}  // namespace replica
