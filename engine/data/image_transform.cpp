#include "engine/data/image_transform.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/error.h"

namespace replica {

namespace {

// Output pixel i of a span reads source pixels [first[i], first[i] + count[i]) with these
// weights: PIL's precompute_coeffs for its bilinear filter, bounded by the span's [lo, hi).
struct Taps {
  std::vector<int> first, count;
  std::vector<float> weights;  // `stride` per output pixel
  int stride = 0;
};

Taps make_taps(const CropSpan& s) {
  const double scale = s.length / s.out_count;
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter_scale;  // the triangle reaches one source pixel, scaled
  Taps t;
  t.stride = int(std::ceil(support)) * 2 + 1;
  t.first.resize(size_t(s.out_count));
  t.count.resize(size_t(s.out_count));
  t.weights.assign(size_t(s.out_count) * size_t(t.stride), 0.f);
  for (int i = 0; i < s.out_count; ++i) {
    const double center = s.start + (i + 0.5) * scale;
    // PIL truncates toward zero in the cropped image's coordinates, where lo is 0.
    const int lo = s.lo + std::max(int(center - s.lo - support + 0.5), 0);
    const int hi = std::min(s.lo + int(center - s.lo + support + 0.5), s.hi);
    const int n = std::clamp(hi - lo, 1, t.stride);
    float* w = &t.weights[size_t(i) * size_t(t.stride)];
    double sum = 0;
    for (int j = 0; j < n; ++j) {
      const double d = std::abs((lo + j - center + 0.5) / filter_scale);
      w[j] = float(d < 1 ? 1 - d : 0);
      sum += w[j];
    }
    for (int j = 0; j < n && sum > 0; ++j) w[j] = float(w[j] / sum);
    t.first[size_t(i)] = std::min(lo, s.hi - 1);
    t.count[size_t(i)] = n;
  }
  return t;
}

// One axis of torchvision's Resize then CenterCrop: `size` source pixels resized to `resized`,
// `out` of them kept from the middle, or all of them padded on both sides to `out`.
CropSpan center_span(int size, int64_t resized, int out) {
  const double scale = double(size) / double(resized);
  CropSpan s;
  s.lo = 0;
  s.hi = size;
  if (out <= resized) {
    s.out_first = 0;
    s.out_count = out;
    s.start = std::nearbyint(double(resized - out) / 2.0) * scale;
    s.length = out * scale;
  } else {
    s.out_first = int((out - resized) / 2);
    s.out_count = int(resized);
    s.start = 0;
    s.length = size;
  }
  return s;
}

}  // namespace

CropPlan center_crop_plan(int width, int height, int out_h, int out_w) {
  const int64_t target = int64_t(std::nearbyint(std::min(out_h, out_w) * 256.0 / 224.0));
  const bool wide = width >= height;
  const int64_t short_side = wide ? height : width, long_side = wide ? width : height;
  const int64_t resized_long = int64_t(double(target) * double(long_side) / double(short_side));
  const int64_t rw = wide ? resized_long : target, rh = wide ? target : resized_long;
  return {center_span(width, rw, out_w), center_span(height, rh, out_h)};
}

CropPlan random_crop_plan(int width, int height, int out_h, int out_w, SplitMix64& rng) {
  const double area = double(width) * height;
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  int left = 0, top = 0, w = 0, h = 0;
  for (int attempt = 0; attempt < 10 && w == 0; ++attempt) {
    const double target = area * (0.08 + 0.92 * rng.uniform01());
    const double aspect = std::exp(log_lo + (log_hi - log_lo) * rng.uniform01());
    const int cw = int(std::nearbyint(std::sqrt(target * aspect)));
    const int ch = int(std::nearbyint(std::sqrt(target / aspect)));
    if (cw > 0 && cw <= width && ch > 0 && ch <= height) {
      w = cw;
      h = ch;
      top = int(rng.below(uint64_t(height - h + 1)));
      left = int(rng.below(uint64_t(width - w + 1)));
    }
  }
  if (w == 0) {  // no try fitted: the centre, its aspect clamped
    const double ratio = double(width) / height;
    w = width;
    h = height;
    if (ratio < 3.0 / 4.0) h = std::min(height, int(std::nearbyint(width / (3.0 / 4.0))));
    if (ratio > 4.0 / 3.0) w = std::min(width, int(std::nearbyint(height * (4.0 / 3.0))));
    left = (width - w) / 2;
    top = (height - h) / 2;
  }
  return {{0, out_w, double(left), double(w), left, left + w},
          {0, out_h, double(top), double(h), top, top + h}};
}

void crop_resize(const RgbImage& image, const CropPlan& plan, bool flip, const ImageTransform& t,
                 float* out) {
  REPLICA_CHECK(image.width > 0 && image.height > 0, "crop_resize: an empty image");
  REPLICA_CHECK(t.channels == 1 || t.channels == 3, "crop_resize: {} channels", t.channels);
  const CropSpan& sx = plan.x;
  const CropSpan& sy = plan.y;
  const Taps cols = make_taps(sx), rows = make_taps(sy);
  const size_t plane = size_t(t.out_h) * size_t(t.out_w);
  // Zero pixels (padding) first; then the span, its rows resampled across, then down.
  for (int c = 0; c < t.channels; ++c)
    std::fill(out + c * plane, out + (c + 1) * plane, (0.f - t.mean[c]) / t.std[c]);
  const int row_lo = rows.first.front();
  const int row_hi = rows.first.back() + rows.count.back();
  std::vector<float> across(size_t(row_hi - row_lo) * size_t(sx.out_count) * 3);
  for (int y = row_lo; y < row_hi; ++y) {
    const uint8_t* src = &image.pixels[size_t(y) * size_t(image.width) * 3];
    float* dst = &across[size_t(y - row_lo) * size_t(sx.out_count) * 3];
    for (int x = 0; x < sx.out_count; ++x) {
      const float* w = &cols.weights[size_t(x) * size_t(cols.stride)];
      const uint8_t* p = src + size_t(cols.first[size_t(x)]) * 3;
      float r = 0, g = 0, b = 0;
      for (int j = 0; j < cols.count[size_t(x)]; ++j, p += 3) {
        r += w[j] * p[0];
        g += w[j] * p[1];
        b += w[j] * p[2];
      }
      dst[3 * x] = r;
      dst[3 * x + 1] = g;
      dst[3 * x + 2] = b;
    }
  }
  for (int y = 0; y < sy.out_count; ++y) {
    const float* w = &rows.weights[size_t(y) * size_t(rows.stride)];
    const int first = rows.first[size_t(y)] - row_lo, n = rows.count[size_t(y)];
    for (int x = 0; x < sx.out_count; ++x) {
      float rgb[3] = {0, 0, 0};
      for (int j = 0; j < n; ++j) {
        const float* p = &across[(size_t(first + j) * size_t(sx.out_count) + size_t(x)) * 3];
        for (int c = 0; c < 3; ++c) rgb[c] += w[j] * p[c];
      }
      const int ox = sx.out_first + (flip ? sx.out_count - 1 - x : x);
      const size_t at = size_t(sy.out_first + y) * size_t(t.out_w) + size_t(ox);
      if (t.channels == 1) {
        const float l = (0.299f * rgb[0] + 0.587f * rgb[1] + 0.114f * rgb[2]) / 255.f;
        out[at] = (l - t.mean[0]) / t.std[0];
        continue;
      }
      for (int c = 0; c < 3; ++c)
        out[size_t(c) * plane + at] = (rgb[c] / 255.f - t.mean[c]) / t.std[c];
    }
  }
}

void transform_image(const RgbImage& image, const ImageTransform& t, uint64_t random_key,
                     float* out) {
  SplitMix64 rng(random_key);
  if (!t.augment) {
    crop_resize(image, center_crop_plan(image.width, image.height, t.out_h, t.out_w), false, t,
                out);
    return;
  }
  const CropPlan plan = random_crop_plan(image.width, image.height, t.out_h, t.out_w, rng);
  crop_resize(image, plan, rng.uniform01() < 0.5, t, out);
}

}  // namespace replica
