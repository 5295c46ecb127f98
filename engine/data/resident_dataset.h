// ResidentDataset: a whole training set read once into device memory, so that a step cuts its
// batch out on the device (gather_rows by the batch's sample indices) instead of having a host
// thread prepare it and the bus carry it. Fashion-MNIST is 188 MB as floats; a synthetic
// 3x224x224 set of 10,000 samples is 6 GB, made once instead of once per step.
//
// The batches are the same bits as the host path's (a gather is a copy), so a run trains
// identically either way; only where the copy happens, and who waits for it, changes.
//
// One copy per memory: logical devices of one GPU share it, and so do virtual CPU devices (on a
// CPU the "upload" is a host copy, which moves the per-batch work from the loader thread into
// the step). The copies belong to the contexts that made them: destroy the ResidentDataset
// before those contexts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/data/dataset.h"
#include "engine/tensor.h"

namespace replica {

// Where a training set lives during training (--data-placement).
//   Host    a loader thread reads each batch into pinned host memory; the step copies it in
//   Device  the whole set is held on every device (ResidentDataset); the step gathers its batch
//   Auto    Device on GPUs when the set fits (see data_fits_on_device), Host otherwise
enum class DataPlacement { Auto, Host, Device };
DataPlacement parse_data_placement(const std::string& flag);  // UsageError for anything else
const char* data_placement_name(DataPlacement p);             // "auto", "host", "device"

// Bytes of one copy of `data` on a device: images as F32 and labels as I32.
int64_t resident_bytes(const Dataset& data);

// Whether `copies` copies of `bytes` fit on `device` under auto placement: a quarter of a GPU's
// memory at most, so models and activations keep the rest. False for CPU devices: there the
// loader thread prepares batches beside the step just as fast (the main job on 2 cores: 1,511-
// 1,536 samples/s either way), and the copy would only cost memory.
bool data_fits_on_device(int64_t bytes, const Device& device, int copies);

// The placement a run uses: `wanted` resolved for `devices` (the devices this process drives)
// and the number of processes that hold a copy on the same GPU (DDP ranks sharing one). A set
// that augments() stays on the host (UsageError if `wanted` is Device).
DataPlacement resolve_data_placement(DataPlacement wanted, const Dataset& data,
                                     const std::vector<Device>& devices, int copies_per_gpu);

class ResidentDataset {
 public:
  // `data` must outlive this object; its samples must be fewer than 2^31 (I32 row indices).
  explicit ResidentDataset(const Dataset& data);
  ResidentDataset(const ResidentDataset&) = delete;
  ResidentDataset& operator=(const ResidentDataset&) = delete;

  // Makes sure ctx's memory holds the set: reads the dataset in chunks through a pinned staging
  // buffer and copies it in, unless a context on the same memory already did. Returns when the
  // copy is complete (every stream may read it from then on). Call before training, from one
  // thread, while no other thread uses ctx.
  void hold_on(DeviceContext& ctx);

  // The samples `rows` (I32 [n] sample indices on ctx's device, each in [0, size)) as a batch
  // on ctx's device: images F32 [n, C, H, W], labels I32 [n]. Enqueued on ctx's stream; ctx's
  // memory must hold the set (hold_on).
  Tensor images(DeviceContext& ctx, const Tensor& rows) const;
  Tensor labels(DeviceContext& ctx, const Tensor& rows) const;

  const Dataset& dataset() const { return data_; }
  int64_t bytes() const { return resident_bytes(data_); }
  int copies() const { return static_cast<int>(copies_.size()); }

 private:
  struct Copy {
    Device memory;  // CPU, or the GPU (index) every logical device of it shares
    Tensor images, labels;
  };
  const Copy& copy_for(const DeviceContext& ctx) const;
  static Tensor gather(DeviceContext& ctx, const Tensor& table, const Tensor& rows);

  const Dataset& data_;
  std::vector<Copy> copies_;
};

}  // namespace replica
