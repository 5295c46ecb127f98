// torchvision's crops as replica computes them: Resize + CenterCrop (with its padding) and
// RandomResizedCrop's boxes, PIL's antialiased bilinear weights worked by hand, the random crop
// reading its box alone, the flip, normalisation, and a sample as a pure function of its key.
#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "image_files.h"

#include <vector>

#include "engine/data/image_transform.h"

using namespace replica;
using namespace test;

TEST_CASE("crops: torchvision's Resize + CenterCrop, its padding, RandomResizedCrop's ranges") {
  // Resize(256) of 500x375: 341x256; CenterCrop(224) at (round(58.5) = 58, 16) in it.
  CropPlan p = center_crop_plan(500, 375, 224, 224);
  const double s = 500.0 / 341;
  CHECK(p.x.start == doctest::Approx(58 * s));
  CHECK(p.x.length == doctest::Approx(224 * s));
  CHECK(p.y.start == doctest::Approx(16 * 375.0 / 256));
  CHECK(p.y.length == doctest::Approx(224 * 375.0 / 256));
  CHECK((p.x.lo == 0 && p.x.hi == 500 && p.x.out_first == 0 && p.x.out_count == 224));
  p = center_crop_plan(300, 600, 32, 32);  // tall: Resize(37) gives 37x74
  CHECK(p.x.start == doctest::Approx(2 * 300.0 / 37));  // round(2.5) = 2, half to even
  CHECK(p.y.start == doctest::Approx(21 * 600.0 / 74));
  // CenterCrop(224x448) of the 341x256 image pads it: (448 - 341) // 2 = 53 columns on the left.
  p = center_crop_plan(500, 375, 224, 448);
  CHECK(p.x.out_first == 53);
  CHECK(p.x.out_count == 341);
  CHECK(p.x.start == 0);
  CHECK(p.x.length == 500);
  CHECK(p.y.out_count == 224);
  SplitMix64 rng(7);
  for (const auto& [w, h] : std::vector<std::pair<int, int>>{{500, 375}, {64, 64}, {1000, 10}}) {
    for (int i = 0; i < 500; ++i) {
      const CropPlan r = random_crop_plan(w, h, 8, 8, rng);
      CHECK(r.x.start >= 0);
      CHECK(r.y.start >= 0);
      CHECK(r.x.start + r.x.length <= w);
      CHECK(r.y.start + r.y.length <= h);
      CHECK((r.x.lo == int(r.x.start) && r.x.hi == int(r.x.start + r.x.length)));
      CHECK((r.y.lo == int(r.y.start) && r.y.hi == int(r.y.start + r.y.length)));
      CHECK(r.x.length >= 1);
      if (w == 500) {  // always found within 10 tries here: torchvision's ranges
        CHECK(r.x.length * r.y.length >= 0.079 * w * h);
        CHECK(r.x.length / r.y.length >= 0.74);
        CHECK(r.x.length / r.y.length <= 1.34);
      }
    }
  }
  const CropPlan wide = random_crop_plan(1000, 10, 8, 8, rng);  // no try fits: the centre, 4/3
  CHECK(wide.x.length == 13);
  CHECK(wide.y.length == 10);
  CHECK(wide.x.start == (1000 - 13) / 2);
}

// PIL's antialiased bilinear weights, worked by hand from its precompute_coeffs: halving takes
// four source pixels at 1/8, 3/8, 3/8, 1/8 (a filter without antialiasing would take two at
// 1/2); doubling a cropped box never reads past the box (torchvision crops, then resizes).
TEST_CASE("resampling: PIL's weights when shrinking, the crop's box alone when enlarging") {
  RgbImage im = solid(512, 512, 0, 0, 0);
  const auto v = [](int x) { return float((x * 37) % 256); };
  for (int y = 0; y < 512; ++y)
    for (int x = 0; x < 512; ++x) im.pixels[(size_t(y) * 512 + size_t(x)) * 3] = uint8_t(v(x));
  ImageTransform t;  // 224x224 from 512x512: Resize(256) halves, the crop starts at 16 (32)
  t.mean = {0, 0, 0};
  t.std = {1, 1, 1};
  std::vector<float> out(3 * 224 * 224);
  transform_image(im, t, 0, out.data());
  for (int i = 0; i < 224; i += 17) {
    const float want = (v(31 + 2 * i) + 3 * v(32 + 2 * i) + 3 * v(33 + 2 * i) + v(34 + 2 * i)) / 8;
    CHECK(out[size_t(100) * 224 + size_t(i)] * 255 == doctest::Approx(want).epsilon(1e-4));
  }
  // A 4-pixel box at x = 2 enlarged to 8: output 0 is pixel 2 alone, output 1 3/4 of pixel 2
  // and 1/4 of pixel 3; pixels 1 and 6 (beside the box) never count.
  const CropPlan plan{{0, 8, 2, 4, 2, 6}, {0, 8, 2, 4, 2, 6}};
  t.out_h = t.out_w = 8;
  std::vector<float> a(3 * 64), b(3 * 64), flipped(3 * 64);
  crop_resize(im, plan, false, t, a.data());
  CHECK(a[0] * 255 == doctest::Approx(v(2)));
  CHECK(a[1] * 255 == doctest::Approx(0.75 * v(2) + 0.25 * v(3)));
  CHECK(a[7] * 255 == doctest::Approx(v(5)));
  RgbImage changed = im;
  for (int y = 0; y < 512; ++y)
    for (int x : {0, 1, 6, 7}) changed.pixels[(size_t(y) * 512 + size_t(x)) * 3] = 255;
  crop_resize(changed, plan, false, t, b.data());
  CHECK(a == b);
  // The flip mirrors each row.
  crop_resize(im, plan, true, t, flipped.data());
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < 8; ++x)
      CHECK(flipped[size_t(y) * 8 + size_t(x)] == a[size_t(y) * 8 + size_t(7 - x)]);
  // Padding is zero before normalisation.
  t.out_h = 4;
  t.out_w = 16;
  t.mean = {0.5f, 0.5f, 0.5f};
  std::vector<float> padded(3 * 4 * 16);
  crop_resize(im, CropPlan{{3, 10, 0, 512, 0, 512}, {0, 4, 0, 512, 0, 512}}, false, t,
              padded.data());
  CHECK(padded[0] == -0.5f);
  CHECK(padded[2] == -0.5f);
  CHECK(padded[13] == -0.5f);
  CHECK(padded[3] != -0.5f);
}

TEST_CASE("transform: exact copies at scale 1, normalisation, the same key the same sample") {
  ImageTransform t;
  t.out_h = t.out_w = 224;
  // 256x256 resizes to itself: the centre crop is pixels 16..239, copied exactly.
  const RgbImage im = pattern(256, 256);
  std::vector<float> out(3 * 224 * 224);
  transform_image(im, t, 0, out.data());
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 224; y += 37)
      for (int x = 0; x < 224; x += 13) {
        const float v = im.pixels[(size_t(y + 16) * 256 + size_t(x + 16)) * 3 + size_t(c)];
        CHECK(out[(size_t(c) * 224 + size_t(y)) * 224 + size_t(x)] ==
              doctest::Approx((v / 255.f - t.mean[c]) / t.std[c]).epsilon(1e-5));
      }
  // A solid image stays solid whatever the crop; one channel is its luminance.
  t.channels = 1;
  t.out_h = 20;
  t.out_w = 30;
  t.augment = true;
  std::vector<float> one(20 * 30);
  transform_image(solid(97, 61, 200, 100, 50), t, 3, one.data());
  const float l = (0.299f * 200 + 0.587f * 100 + 0.114f * 50) / 255.f;
  for (float v : one) CHECK(v == doctest::Approx((l - t.mean[0]) / t.std[0]).epsilon(1e-5));
  // Augmented: a pure function of the key; other keys crop and flip otherwise.
  t.channels = 3;
  const RgbImage p = pattern(97, 61);
  std::vector<float> a(3 * 20 * 30), b(a.size()), c(a.size());
  transform_image(p, t, 11, a.data());
  transform_image(p, t, 11, b.data());
  CHECK(a == b);
  int differ = 0;
  for (uint64_t key = 12; key < 20; ++key) {
    transform_image(p, t, key, c.data());
    differ += c != a;
  }
  CHECK(differ == 8);
}
