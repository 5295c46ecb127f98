// Image folders (ImageNet's layout): decoding JPEG and PNG files into RGB (grayscale, CMYK and
// alpha as PIL converts them; corrupt files as one-line errors, never a crash or a gray
// image), torchvision's crops (Resize + CenterCrop, RandomResizedCrop + flip) and the dataset
// (classes, labels, augmentation draws) and replica-train on it.
#include <doctest/doctest.h>

#include "cli_helpers.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
// clang-format off: jpeglib.h needs FILE and size_t declared before it
#include <jpeglib.h>
// clang-format on
#include <png.h>

#include <nlohmann/json.hpp>

#include "engine/data/image_decode.h"
#include "engine/data/image_folder.h"
#include "engine/data/image_transform.h"
#include "engine/data/resident_dataset.h"
#include "engine/error.h"

using namespace replica;

namespace {

// A JPEG of `image` (3 components), of its luminance (1), or of inverted CMYK inks (4: Adobe's
// convention, for which `image` holds what the decoder must return with no black ink), with or
// without the Adobe marker that says so.
void write_jpeg(const std::string& path, const RgbImage& image, int components,
                int quality = 100, bool adobe_marker = true) {
  std::vector<uint8_t> data;
  const size_t n = size_t(image.width) * size_t(image.height);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = &image.pixels[3 * i];
    if (components == 1) data.push_back(p[0]);
    if (components == 3) data.insert(data.end(), p, p + 3);
    if (components == 4) data.insert(data.end(), {p[0], p[1], p[2], 255});  // inverted, no black
  }
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  jpeg_stdio_dest(&cinfo, f);
  cinfo.image_width = JDIMENSION(image.width);
  cinfo.image_height = JDIMENSION(image.height);
  cinfo.input_components = components;
  cinfo.in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  cinfo.write_Adobe_marker = adobe_marker && components == 4;
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = &data[size_t(cinfo.next_scanline) * size_t(image.width) * size_t(components)];
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(f);
}

// A PNG of `image` with an alpha channel that must be dropped (`gray`: its red channel alone).
void write_png(const std::string& path, const RgbImage& image, bool gray) {
  png_image p;
  std::memset(&p, 0, sizeof p);
  p.version = PNG_IMAGE_VERSION;
  p.width = png_uint_32(image.width);
  p.height = png_uint_32(image.height);
  p.format = gray ? PNG_FORMAT_GRAY : PNG_FORMAT_RGBA;
  std::vector<uint8_t> data;
  for (size_t i = 0; i < size_t(image.width) * size_t(image.height); ++i) {
    const uint8_t* px = &image.pixels[3 * i];
    if (gray) data.push_back(px[0]);
    else data.insert(data.end(), {px[0], px[1], px[2], uint8_t(i * 37)});
  }
  REQUIRE(png_image_write_to_file(&p, path.c_str(), 0, data.data(), 0, nullptr) != 0);
}

RgbImage pattern(int w, int h, int seed = 0) {
  RgbImage im;
  im.width = w;
  im.height = h;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      im.pixels.insert(im.pixels.end(), {uint8_t((x * 255) / std::max(1, w - 1)),
                                         uint8_t((y * 255) / std::max(1, h - 1)),
                                         uint8_t((x + y + seed * 40) % 256)});
  return im;
}

RgbImage solid(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  RgbImage im;
  im.width = w;
  im.height = h;
  for (int i = 0; i < w * h; ++i) im.pixels.insert(im.pixels.end(), {r, g, b});
  return im;
}

int max_difference(const RgbImage& a, const RgbImage& b) {
  REQUIRE(a.pixels.size() == b.pixels.size());
  int d = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) d = std::max(d, std::abs(a.pixels[i] - b.pixels[i]));
  return d;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("decode: JPEG (RGB, gray, CMYK) and PNG (alpha, gray) become RGB, told by content") {
  test::TempDir tmp;
  const RgbImage im = pattern(40, 30);
  write_jpeg(tmp.str("rgb.jpg"), im, 3);
  const RgbImage rgb = decode_image(tmp.str("rgb.jpg"));
  CHECK(rgb.width == 40);
  CHECK(rgb.height == 30);
  CHECK(max_difference(rgb, im) <= 12);  // quality 100 and 4:2:0 chroma: close, not exact

  write_jpeg(tmp.str("gray.jpg"), im, 1);
  const RgbImage gray = decode_image(tmp.str("gray.jpg"));
  for (size_t i = 0; i < gray.pixels.size(); i += 3) {
    CHECK(gray.pixels[i] == gray.pixels[i + 1]);
    CHECK(gray.pixels[i] == gray.pixels[i + 2]);
    CHECK(std::abs(gray.pixels[i] - im.pixels[i]) <= 2);  // the red channel was written
  }
  write_jpeg(tmp.str("cmyk.jpg"), im, 4);
  CHECK(max_difference(decode_image(tmp.str("cmyk.jpg")), im) <= 3);
  // Without the marker the inks are taken as inverted all the same, as PIL takes them.
  write_jpeg(tmp.str("cmyk-plain.jpg"), im, 4, 100, false);
  CHECK(max_difference(decode_image(tmp.str("cmyk-plain.jpg")), im) <= 3);

  // A PNG named .JPEG (ImageNet has one): the content decides. Alpha is dropped, not blended.
  write_png(tmp.str("png.JPEG"), im, false);
  CHECK(max_difference(decode_image(tmp.str("png.JPEG")), im) == 0);
  write_png(tmp.str("gray.png"), im, true);
  const RgbImage g = decode_image(tmp.str("gray.png"));
  for (size_t i = 0; i < g.pixels.size(); i += 3) {
    CHECK(g.pixels[i] == im.pixels[i]);
    CHECK(g.pixels[i + 2] == im.pixels[i]);
  }
  // 16-bit samples, stored with a gAMA of 1.0 (linear): no gamma is applied, as PIL applies
  // none; each sample keeps its high byte (0x80xx: 128, where gamma would make 188).
  png_image p16;
  std::memset(&p16, 0, sizeof p16);
  p16.version = PNG_IMAGE_VERSION;
  p16.width = 3;
  p16.height = 2;
  p16.format = PNG_FORMAT_LINEAR_Y;
  const uint16_t samples[6] = {0x8040, 0x0000, 0xFFFF, 0x1234, 0x80FF, 0x7F00};
  REQUIRE(png_image_write_to_file(&p16, tmp.str("deep.png").c_str(), 0, samples, 0, nullptr));
  const RgbImage deep = decode_image(tmp.str("deep.png"));
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK(deep.pixels[size_t(3 * i)] == samples[i] >> 8);
    CHECK(deep.pixels[size_t(3 * i + 1)] == samples[i] >> 8);
  }
}

TEST_CASE("decode: bad files are errors naming the file, never a crash or a gray image") {
  test::TempDir tmp;
  write_jpeg(tmp.str("ok.jpg"), pattern(64, 48), 3, 90);
  write_png(tmp.str("ok.png"), pattern(64, 48), false);
  const auto jpg = test::file_bytes(tmp.str("ok.jpg"));
  const auto png = test::file_bytes(tmp.str("ok.png"));
  // A decompression bomb: the frame header (JPEG has no checksum) says 15000x15000 pixels.
  std::vector<uint8_t> bomb = jpg;
  for (size_t i = 0; i + 9 < bomb.size(); ++i)
    if (bomb[i] == 0xFF && bomb[i + 1] == 0xC0) {
      bomb[i + 5] = bomb[i + 7] = 15000 >> 8;
      bomb[i + 6] = bomb[i + 8] = 15000 & 0xFF;
      break;
    }
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string says;
  };
  std::vector<Case> cases = {
      {"cut.jpg", {jpg.begin(), jpg.begin() + long(jpg.size() * 9 / 10)},
       "corrupt JPEG image: the data end before the image does"},
      {"header.jpg", {jpg.begin(), jpg.begin() + 20}, "corrupt JPEG image"},
      {"noise.jpg", {0xFF, 0xD8, 0xFF, 0x00, 0x12, 0x34, 0x56}, "corrupt JPEG image"},
      {"text.jpg", {'h', 'e', 'l', 'l', 'o'}, "not a JPEG or PNG image (5 bytes)"},
      {"empty.jpg", {}, "not a JPEG or PNG image (0 bytes, empty)"},
      {"half.png", {png.begin(), png.begin() + long(png.size() / 2)}, "corrupt PNG image"},
      {"bomb.jpg", bomb,
       "corrupt JPEG image: 15000x15000 pixels, more than the 178956970 an image may have"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    test::put_bytes(tmp.str(c.name), c.bytes);
    const std::string e = error_of([&] { decode_image(tmp.str(c.name)); });
    CHECK_MESSAGE(e.rfind(tmp.str(c.name) + ": " + c.says, 0) == 0, e);
    CHECK(e.find('\n') == std::string::npos);
  }
  CHECK(error_of([&] { decode_image(tmp.str("missing.jpg")); }).find("no such file") !=
        std::string::npos);
  // Every cut of a JPEG and PNG, and bytes changed at random: an error or an image of the
  // right size, nothing else (no crash, no abort, no message on stderr).
  std::fflush(stderr);
  const int saved_stderr = dup(2);
  {
    FILE* sink = std::fopen(tmp.str("stderr").c_str(), "w");
    REQUIRE(sink != nullptr);
    dup2(fileno(sink), 2);
    std::fclose(sink);
  }
  std::mt19937 rng(3);
  for (const auto* file : {&jpg, &png}) {
    std::vector<std::vector<uint8_t>> variants;
    for (size_t cut = 0; cut < file->size(); cut += 7)
      variants.emplace_back(file->begin(), file->begin() + long(cut));
    for (int i = 0; i < 300; ++i) {
      std::vector<uint8_t> b = *file;
      for (int k = 0; k < 4; ++k) b[rng() % b.size()] = uint8_t(rng());
      variants.push_back(std::move(b));
    }
    for (const auto& v : variants) {
      try {
        const RgbImage im = decode_image(v, "variant");
        CHECK(im.pixels.size() == size_t(im.width) * size_t(im.height) * 3);
      } catch (const Error&) {
      }
    }
  }
  std::fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  CHECK(test::fs::file_size(tmp.str("stderr")) == 0);
}

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

namespace {

// train/{ant,cat,dog} and val/{cat,dog}: JPEG, PNG, an upper-case name, a nested directory and
// a file that is not an image.
void write_folder(const test::fs::path& root) {
  for (const char* c : {"train/ant", "train/cat", "train/dog/more", "val/cat", "val/dog"})
    test::fs::create_directories(root / c);
  write_jpeg((root / "train/ant/a1.jpg").string(), pattern(50, 40, 1), 3, 90);
  write_png((root / "train/ant/a2.png").string(), pattern(30, 60, 2), false);
  write_jpeg((root / "train/cat/c1.JPEG").string(), pattern(64, 64, 3), 3, 90);
  write_jpeg((root / "train/dog/d1.jpeg").string(), pattern(45, 45, 4), 1, 90);
  write_jpeg((root / "train/dog/more/d2.jpg").string(), pattern(80, 20, 5), 3, 90);
  std::ofstream((root / "train/dog/notes.txt").string()) << "not an image";
  write_jpeg((root / "val/cat/v1.jpg").string(), pattern(40, 40, 6), 3, 90);
  write_jpeg((root / "val/dog/v2.jpg").string(), pattern(40, 40, 7), 3, 90);
}

}  // namespace

TEST_CASE("image folder: sorted classes and files, labels shared with val, augmentation draws") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  const std::string dir = tmp.str("set");
  CHECK(is_image_folder(dir));
  CHECK_FALSE(is_image_folder(tmp.str("nothing")));
  check_image_folder(dir, true);
  ImageFolderOptions o;
  o.sample_shape = {3, 16, 24};
  o.seed = 5;
  auto train = open_image_folder(dir, true, o);
  auto val = open_image_folder(dir, false, o);
  CHECK(train->size() == 5);
  CHECK(train->num_classes() == 3);
  CHECK(train->sample_shape() == Shape{3, 16, 24});
  CHECK(train->augments());
  CHECK_FALSE(val->augments());
  CHECK(train->describe() == "set train: 5 x 3x16x24, 3 classes, random crops and flips");
  CHECK(val->describe() == "set val: 2 x 3x16x24, 3 classes, centre crops");
  const int64_t all[5] = {0, 1, 2, 3, 4};
  std::vector<float> images(5 * 3 * 16 * 24), again(images.size()), next(images.size());
  std::vector<int32_t> labels(5);
  train->read(all, 5, images.data(), labels.data(), 0);
  CHECK(labels == std::vector<int32_t>{0, 0, 1, 2, 2});  // ant ant cat dog dog
  train->read(all, 5, again.data(), labels.data(), 0);
  CHECK(again == images);
  train->read(all, 5, next.data(), labels.data(), 1);
  CHECK(next != images);
  const int64_t both[2] = {0, 1};
  val->read(both, 2, images.data(), labels.data());
  CHECK(labels[0] == 1);  // val's cat is train's class 1, not val's own 0
  CHECK(labels[1] == 2);
  // Where the set lives: an augmenting set cannot be held on a device.
  CHECK(resolve_data_placement(DataPlacement::Auto, *train, {Device{}}, 1) ==
        DataPlacement::Host);
  CHECK(error_of([&] {
          resolve_data_placement(DataPlacement::Device, *train, {Device{}}, 1);
        }).find("draws new random crops every epoch") != std::string::npos);

  // ImageFolder's order within a class: a directory's own files before its sub-directories'
  // (sorted(os.walk)), not the full paths sorted (which would put more/ before z.jpg).
  write_jpeg(tmp.str("set/train/dog/z.jpg"), solid(20, 20, 250, 0, 0), 3);
  write_jpeg(tmp.str("set/train/dog/more/a.jpg"), solid(20, 20, 0, 250, 0), 3);
  o.augment = false;
  o.sample_shape = {3, 4, 4};
  auto more = open_image_folder(dir, true, o);
  REQUIRE(more->size() == 7);  // ant: 2, cat: 1, dog: d1, z, more/a, more/d2
  std::vector<float> px(2 * 3 * 16);
  const int64_t z_then_a[2] = {4, 5};
  more->read(z_then_a, 2, px.data(), labels.data());
  const auto red = [&](int sample) { return px[size_t(sample) * 48 + 5] * 0.229f + 0.485f; };
  CHECK(red(0) > 0.9f);  // z.jpg: red
  CHECK(red(1) < 0.1f);  // more/a.jpg: green
}

TEST_CASE("image folder: what is missing or wrong is named before training") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  const std::string dir = tmp.str("set");
  ImageFolderOptions o;
  test::fs::create_directories(tmp.path / "set/val/zebra");
  CHECK(error_of([&] { check_image_folder(dir, true); }) ==
        tmp.str("set/val/zebra") + ": no images in it (.jpg, .jpeg or .png files)");
  write_jpeg(tmp.str("set/val/zebra/z.jpg"), pattern(20, 20), 3);
  CHECK(error_of([&] { open_image_folder(dir, false, o); }) ==
        tmp.str("set/val") + ": class 'zebra' is not among the 3 classes of " +
            tmp.str("set/train"));
  CHECK(error_of([&] { check_image_folder(tmp.str("set/train/ant"), false); })
            .find("no such directory") != std::string::npos);
  o.sample_shape = {2, 8, 8};
  CHECK(error_of([&] { open_image_folder(dir, true, o); }).find("1 or 3 channels") !=
        std::string::npos);
  // A corrupt image fails the read that meets it, naming it.
  test::put_bytes(tmp.str("set/train/cat/c1.JPEG"), {0xFF, 0xD8, 0xFF, 0x01});
  o.sample_shape = {3, 8, 8};
  auto train = open_image_folder(dir, true, o);
  const int64_t cat = 2;
  std::vector<float> img(3 * 8 * 8);
  int32_t label = 0;
  CHECK(error_of([&] { train->read(&cat, 1, img.data(), &label); })
            .rfind(tmp.str("set/train/cat/c1.JPEG") + ": corrupt JPEG image", 0) == 0);
}

TEST_CASE("replica-train on an image folder: DP and DDP, flags that do not apply") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  const std::string train = test::bin("replica-train") + " --data " + tmp.str("set") +
                            " --model resnet18 --input-shape 3x32x32 --batch-size 4" +
                            " --drop-last --threads-per-device 1";
  for (const std::string mode : {"dp", "ddp"}) {
    CAPTURE(mode);
    auto r = test::run(train + " --epochs 2 --mode " + mode + " --devices cpu*2 --metrics-json " +
                           tmp.str(mode + ".json"),
                       300);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("set train: 5 x 3x32x32, 3 classes, random crops and flips") !=
          std::string::npos);
    std::ifstream in(tmp.str(mode + ".json"));
    const auto m = nlohmann::json::parse(in);
    CHECK(m["steps"] == 2);  // one batch of 4 an epoch (DDP: 2 of each rank's 3)
    CHECK(m["config"]["input_shape"] == "3x32x32");
    CHECK(m.contains("test_accuracy"));
    CHECK_FALSE(m.contains("test_top5_accuracy"));  // 3 classes
    CHECK(r.output.find("resnet18: 11.18M parameters, input [3, 32, 32], 3 classes") !=
          std::string::npos);
  }
  auto centre = test::run(train + " --no-augment --quiet --data-placement device --devices cpu");
  CHECK_MESSAGE(centre.exit_code == 0, centre.output);
  test::expect_clean_error("replica-train", "--data " + tmp.str("set") +
                                                " --data-placement device --devices cpu",
                           "draws new random crops every epoch");
  test::write_mnist_dir(tmp.path / "mnist", 64, 16);
  test::expect_clean_error("replica-train", "--data " + tmp.str("mnist") + " --no-augment",
                           "--no-augment applies to image folders");
  test::expect_clean_error("replica-train", "--data " + tmp.str("mnist") + " --input-shape 1x8x8",
                           "--input-shape applies to --synthetic data and image folders");
  test::fs::remove_all(tmp.path / "set/val");
  test::expect_clean_error("replica-train", "--data " + tmp.str("set"),
                           tmp.str("set/val") + ": no such directory");
}

TEST_CASE("--preset imagenet trains on an image folder: DDP, StepLR, checkpoint and best model") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  auto r = test::run(test::bin("replica-train") + " --preset imagenet --data " + tmp.str("set") +
                         " --input-shape 3x32x32 --batch-size 4 --drop-last --epochs 2" +
                         " --devices cpu*2 --threads-per-device 1 --checkpoint " + tmp.str("ck") +
                         " --save-best " + tmp.str("best.safetensors") + " --metrics-json " +
                         tmp.str("m.json"),
                     300);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("on 2 ranks (ddp mode") != std::string::npos);
  CHECK(test::fs::exists(tmp.path / "ck/checkpoint.safetensors"));
  CHECK(test::fs::exists(tmp.path / "best.safetensors"));
  std::ifstream in(tmp.str("m.json"));
  const auto m = nlohmann::json::parse(in);
  CHECK(m["config"]["lr_schedule"] == "step:30");
  CHECK(m["epoch_summaries"][1]["lr"] == doctest::Approx(0.1));
  CHECK(m["config"]["weight_decay"] == 0.0001);
  CHECK(m["best_epoch"].get<int>() >= 1);
}

TEST_CASE("replica-bench --suite loader --data: an image folder's decoding rate") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  // 5 images, 8 samples timed and warmed: the epochs' orders follow one another.
  const auto r = test::run(test::bin("replica-bench") + " --suite loader --data " +
                           tmp.str("set") + " --input-shape 3x32x32 --batch 2 --warmup 1" +
                           " --steps 3 --repeat 1 --threads 1 --json " + tmp.str("l.jsonl"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("suite loader, set train: 5 x 3x32x32, 3 classes, random crops and flips") !=
        std::string::npos);
  std::ifstream in(tmp.str("l.jsonl"));
  std::string line;
  REQUIRE(std::getline(in, line));
  const auto row = nlohmann::json::parse(line);
  CHECK(row["dataset"] == tmp.str("set"));
  CHECK(row["input_shape"] == "3x32x32");
  CHECK(row["samples_per_sec"].get<double>() > 0);
  test::expect_clean_error("replica-bench", "--suite single --data " + tmp.str("set"),
                           "--data is read by --suite loader");
  test::expect_clean_error("replica-bench", "--suite loader --data " + tmp.str("set/train"),
                           "not an image folder");
}
