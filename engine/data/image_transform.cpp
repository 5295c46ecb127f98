#include "engine/data/image_transform.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/error.h"

namespace replica {

namespace {

// Output pixel i of `out_size` reads source pixels [first[i], first[i] + count[i]) of the box
// [start, start + len) with these weights (PIL's precompute_coeffs for its bilinear filter).
struct Taps {
  std::vector<int> first, count;
  std::vector<float> weights;  // count.max() per output pixel
  int stride = 0;
};

Taps make_taps(double start, double len, int in_size, int out_size) {
  const double scale = len / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter_scale;  // the triangle reaches one source pixel, scaled
  Taps t;
  t.stride = int(std::ceil(support)) * 2 + 1;
  t.first.resize(size_t(out_size));
  t.count.resize(size_t(out_size));
  t.weights.assign(size_t(out_size) * size_t(t.stride), 0.f);
  for (int i = 0; i < out_size; ++i) {
    const double center = start + (i + 0.5) * scale;
    const int lo = std::max(int(center - support + 0.5), 0);
    const int hi = std::min(int(center + support + 0.5), in_size);
    double sum = 0;
    float* w = &t.weights[size_t(i) * size_t(t.stride)];
    const int n = std::min(hi - lo, t.stride);
    for (int j = 0; j < n; ++j) {
      const double d = std::abs((lo + j - center + 0.5) / filter_scale);
      w[j] = float(d < 1 ? 1 - d : 0);
      sum += w[j];
    }
    for (int j = 0; j < n && sum > 0; ++j) w[j] = float(w[j] / sum);
    t.first[size_t(i)] = lo;
    t.count[size_t(i)] = n;
  }
  return t;
}

}  // namespace

CropBox center_crop_box(int width, int height, int out_h, int out_w) {
  const int target = int(std::nearbyint(std::min(out_h, out_w) * 256.0 / 224.0));
  const bool wide = width >= height;
  const int short_side = wide ? height : width, long_side = wide ? width : height;
  const int resized_long = int(double(target) * long_side / short_side);
  const int rw = wide ? resized_long : target, rh = wide ? target : resized_long;
  const double sx = double(width) / rw, sy = double(height) / rh;
  CropBox b;
  b.x = std::max(0.0, std::nearbyint((rw - out_w) / 2.0)) * sx;
  b.y = std::max(0.0, std::nearbyint((rh - out_h) / 2.0)) * sy;
  b.w = std::min(out_w, rw) * sx;
  b.h = std::min(out_h, rh) * sy;
  return b;
}

CropBox random_crop_box(int width, int height, SplitMix64& rng) {
  const double area = double(width) * height;
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (0.08 + 0.92 * rng.uniform01());
    const double aspect = std::exp(log_lo + (log_hi - log_lo) * rng.uniform01());
    const int w = int(std::nearbyint(std::sqrt(target * aspect)));
    const int h = int(std::nearbyint(std::sqrt(target / aspect)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int top = int(rng.below(uint64_t(height - h + 1)));
      const int left = int(rng.below(uint64_t(width - w + 1)));
      return {double(left), double(top), double(w), double(h)};
    }
  }
  const double ratio = double(width) / height;  // the centre, its aspect clamped
  int w = width, h = height;
  if (ratio < 3.0 / 4.0) h = std::min(height, int(std::nearbyint(width / (3.0 / 4.0))));
  if (ratio > 4.0 / 3.0) w = std::min(width, int(std::nearbyint(height * (4.0 / 3.0))));
  return {double((width - w) / 2), double((height - h) / 2), double(w), double(h)};
}

void transform_image(const RgbImage& image, const ImageTransform& t, uint64_t random_key,
                     float* out) {
  REPLICA_CHECK(image.width > 0 && image.height > 0, "transform_image: an empty image");
  REPLICA_CHECK(t.channels == 1 || t.channels == 3, "transform_image: {} channels", t.channels);
  SplitMix64 rng(random_key);
  const CropBox box = t.augment ? random_crop_box(image.width, image.height, rng)
                                : center_crop_box(image.width, image.height, t.out_h, t.out_w);
  const bool flip = t.augment && rng.uniform01() < 0.5;
  const Taps cols = make_taps(box.x, box.w, image.width, t.out_w);
  const Taps rows = make_taps(box.y, box.h, image.height, t.out_h);
  // Horizontal pass over the source rows the vertical pass reads, then the vertical pass.
  const int row_lo = rows.first.front();
  const int row_hi = rows.first.back() + rows.count.back();
  std::vector<float> wide(size_t(row_hi - row_lo) * size_t(t.out_w) * 3);
  for (int y = row_lo; y < row_hi; ++y) {
    const uint8_t* src = &image.pixels[size_t(y) * size_t(image.width) * 3];
    float* dst = &wide[size_t(y - row_lo) * size_t(t.out_w) * 3];
    for (int x = 0; x < t.out_w; ++x) {
      const float* w = &cols.weights[size_t(x) * size_t(cols.stride)];
      const uint8_t* p = src + size_t(cols.first[size_t(x)]) * 3;
      float r = 0, g = 0, b = 0;
      for (int j = 0; j < cols.count[size_t(x)]; ++j, p += 3) {
        r += w[j] * p[0];
        g += w[j] * p[1];
        b += w[j] * p[2];
      }
      const int ox = flip ? t.out_w - 1 - x : x;
      dst[3 * ox] = r;
      dst[3 * ox + 1] = g;
      dst[3 * ox + 2] = b;
    }
  }
  const size_t plane = size_t(t.out_h) * size_t(t.out_w);
  for (int y = 0; y < t.out_h; ++y) {
    const float* w = &rows.weights[size_t(y) * size_t(rows.stride)];
    const int first = rows.first[size_t(y)] - row_lo, n = rows.count[size_t(y)];
    for (int x = 0; x < t.out_w; ++x) {
      float rgb[3] = {0, 0, 0};
      for (int j = 0; j < n; ++j) {
        const float* p = &wide[(size_t(first + j) * size_t(t.out_w) + size_t(x)) * 3];
        for (int c = 0; c < 3; ++c) rgb[c] += w[j] * p[c];
      }
      const size_t at = size_t(y) * size_t(t.out_w) + size_t(x);
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

}  // namespace replica
