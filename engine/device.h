// Devices and the device strings users type.
//   cpu           one CPU device
//   cpu*4         four virtual CPU devices (each its own TBB arena and replica)
//   cuda          every GPU found;   cuda:K   GPU K;   cuda:0,1,3   a list
//   cuda:0*4      four logical devices sharing GPU 0 (correctness runs, not scaling)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica {

enum class DeviceType { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;  // GPU ordinal for CUDA; virtual device number for CPU
  int slot = 0;   // which logical device on the same GPU / which virtual CPU device

  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  std::string str() const;  // "cpu:1", "cuda:0", "cuda:0#1" for the 2nd logical device on GPU 0
  bool operator==(const Device& o) const {
    return type == o.type && index == o.index && slot == o.slot;
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// Cores of this machine (at least 1): virtual CPU devices share them.
int cpu_cores();

// The most devices a device string may name: virtual CPU devices (8 per core, at least 16) and
// logical devices per GPU. Beyond them the devices only time-share the hardware.
int max_virtual_cpu_devices();
constexpr int kMaxLogicalDevicesPerGpu = 16;

// The most CPU threads one device (or one measurement) may be given: 8 per core, at least 64.
// Beyond them threads only time-share the cores, and a count in the tens of thousands makes
// thread creation fail inside TBB, which ends the process with no message.
int max_cpu_threads();
// UsageError naming `flag` when n is outside [1, max_cpu_threads()] (0: "every core" where the
// flag allows it, so callers pass only counts they will create).
void check_cpu_threads(const std::string& flag, int64_t n);

// Number of usable GPUs. A missing driver, no GPU or a CUDA backend that is not built or does
// not load is zero, never an error.
int cuda_device_count();

// For messages about CUDA devices that cannot be had: "" when the CUDA backend loads, else
// " (no NVIDIA driver on this machine)", " (the CUDA backend is not built: ...)", ...
std::string cuda_backend_note();

// Parses a device string. `allow_multi` false rejects lists and `*N` (single-device programs).
// Errors (UsageError): unknown kind, GPU index out of range, cpu*0, a device listed twice.
std::vector<Device> parse_devices(const std::string& spec, bool allow_multi = true);

// Whether devices share hardware (logical devices on one GPU): reports label such runs.
bool devices_share_hardware(const std::vector<Device>& devices);

// Human-readable lines describing what is found (for --list-devices).
std::vector<std::string> describe_devices();

}  // namespace replica
