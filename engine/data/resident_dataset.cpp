#include "engine/data/resident_dataset.h"

#include <algorithm>
#include <climits>
#include <numeric>

#include "engine/allocator.h"
#include "engine/cudart.h"
#include "engine/error.h"
#include "engine/ops.h"

namespace replica {

DataPlacement parse_data_placement(const std::string& flag) {
  if (flag == "auto") return DataPlacement::Auto;
  if (flag == "host") return DataPlacement::Host;
  if (flag == "device") return DataPlacement::Device;
  throw UsageError(fmt::format("--data-placement: expected auto, host or device, got '{}'", flag));
}

const char* data_placement_name(DataPlacement p) {
  switch (p) {
    case DataPlacement::Auto: return "auto";
    case DataPlacement::Host: return "host";
    case DataPlacement::Device: return "device";
  }
  return "?";
}

int64_t resident_bytes(const Dataset& data) {
  Shape sample = data.sample_shape();
  return data.size() * (shape_numel(sample) * int64_t(sizeof(float)) + int64_t(sizeof(int32_t)));
}

bool data_fits_on_device(int64_t bytes, const Device& device, int copies) {
  if (!device.is_cuda()) return false;
  const double total = double(cudart::device_total_memory(device.index));
  return double(bytes) * std::max(copies, 1) <= total / 4;
}

DataPlacement resolve_data_placement(DataPlacement wanted, const Dataset& data,
                                     const std::vector<Device>& devices, int copies_per_gpu) {
  // A set held on the device is read once: random crops would be the same every epoch.
  REPLICA_USAGE_CHECK(wanted != DataPlacement::Device || !data.augments(),
                      "--data-placement device holds each sample as read once, but {} draws "
                      "new random crops every epoch (--no-augment: centre crops, which it can "
                      "hold)",
                      data.describe());
  if (data.augments()) return DataPlacement::Host;
  if (wanted != DataPlacement::Auto) return wanted;
  const int64_t bytes = resident_bytes(data);
  for (const Device& d : devices)
    if (!data_fits_on_device(bytes, d, copies_per_gpu)) return DataPlacement::Host;
  return devices.empty() ? DataPlacement::Host : DataPlacement::Device;
}

ResidentDataset::ResidentDataset(const Dataset& data) : data_(data) {
  REPLICA_USAGE_CHECK(data.size() <= INT32_MAX,
                      "--data-placement device: {} samples are more than a device batch can "
                      "index (2^31 - 1)",
                      data.size());
}

namespace {

// The memory a device's tensors live in: virtual CPU devices share the host's, logical devices
// of one GPU share that GPU's.
Device memory_of(const Device& d) {
  Device m;
  m.type = d.type;
  m.index = d.is_cuda() ? d.index : 0;
  return m;
}

}  // namespace

void ResidentDataset::hold_on(DeviceContext& ctx) {
  const Device memory = memory_of(ctx.device());
  for (const Copy& c : copies_)
    if (c.memory == memory) return;
  const int64_t n = data_.size();
  Shape image_shape = data_.sample_shape();
  const int64_t per = shape_numel(image_shape);
  image_shape.insert(image_shape.begin(), n);
  Copy copy{memory, {}, {}};
  ctx.run([&] {
    try {
      copy.images = ctx.alloc(image_shape);
      copy.labels = ctx.alloc({n}, DType::I32);
    } catch (const Error& e) {
      throw UsageError(fmt::format("--data-placement device: the training set ({:.1f} MB) does "
                                   "not fit on {}: {}",
                                   double(resident_bytes(data_)) / 1e6, ctx.device().str(),
                                   e.what()));
    }
    std::vector<int64_t> indices;
    if (!ctx.is_cuda()) {  // host memory: read straight in
      indices.resize(size_t(n));
      std::iota(indices.begin(), indices.end(), int64_t(0));
      data_.read(indices.data(), n, copy.images.f32(), copy.labels.i32());
      return;
    }
    // Chunks of about 64 MB through two pinned buffers: the dataset fills one while the other
    // is copied in.
    const int64_t chunk = std::clamp<int64_t>((int64_t(64) << 20) / (per * 4), 1, n);
    Shape staging_shape = image_shape;
    staging_shape[0] = chunk;
    struct Staging {
      Tensor images, labels;
      StreamEvent copied;
      bool in_flight = false;
    } staging[2];
    for (Staging& s : staging) {
      s.images = Tensor::empty(pinned_allocator(), staging_shape);
      s.labels = Tensor::empty(pinned_allocator(), {chunk}, DType::I32);
    }
    for (int64_t begin = 0, k = 0; begin < n; begin += chunk, ++k) {
      const int64_t count = std::min(chunk, n - begin);
      Staging& s = staging[k % 2];
      if (s.in_flight) s.copied.host_wait();
      indices.resize(size_t(count));
      std::iota(indices.begin(), indices.end(), begin);
      data_.read(indices.data(), count, s.images.f32(), s.labels.i32());
      Tensor images = copy.images.slice_rows(begin, begin + count);
      Tensor labels = copy.labels.slice_rows(begin, begin + count);
      ctx.ops().copy(ctx, images, s.images.slice_rows(0, count));
      ctx.ops().copy(ctx, labels, s.labels.slice_rows(0, count));
      s.copied.record(ctx);
      s.in_flight = true;
    }
    ctx.synchronize();  // complete before any other stream (another logical device) reads it
  });
  copies_.push_back(std::move(copy));
}

const ResidentDataset::Copy& ResidentDataset::copy_for(const DeviceContext& ctx) const {
  const Device memory = memory_of(ctx.device());
  for (const Copy& c : copies_)
    if (c.memory == memory) return c;
  throw Error(fmt::format("the training set is not held on {} (ResidentDataset::hold_on)",
                          ctx.device().str()));
}

Tensor ResidentDataset::gather(DeviceContext& ctx, const Tensor& table, const Tensor& rows) {
  Shape shape = table.shape();
  shape[0] = rows.numel();
  Tensor out = ctx.alloc(shape, table.dtype());
  ctx.ops().gather_rows(ctx, out, table, rows);
  return out;
}

Tensor ResidentDataset::images(DeviceContext& ctx, const Tensor& rows) const {
  return gather(ctx, copy_for(ctx).images, rows);
}

Tensor ResidentDataset::labels(DeviceContext& ctx, const Tensor& rows) const {
  return gather(ctx, copy_for(ctx).labels, rows);
}

}  // namespace replica
