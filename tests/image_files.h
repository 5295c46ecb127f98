// Image files for the image tests: JPEG and PNG writers (libjpeg, libpng) and test pictures.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
// clang-format off: jpeglib.h needs FILE and size_t declared before it
#include <jpeglib.h>
// clang-format on
#include <png.h>

#include "engine/data/image_decode.h"
#include "engine/error.h"

namespace test {

using replica::RgbImage;

// A JPEG of `image` (3 components), of its luminance (1), or of inverted CMYK inks (4: Adobe's
// convention, for which `image` holds what the decoder must return with no black ink), with or
// without the Adobe marker that says so.
inline void write_jpeg(const std::string& path, const RgbImage& image, int components,
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
inline void write_png(const std::string& path, const RgbImage& image, bool gray) {
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

inline RgbImage pattern(int w, int h, int seed = 0) {
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

inline RgbImage solid(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  RgbImage im;
  im.width = w;
  im.height = h;
  for (int i = 0; i < w * h; ++i) im.pixels.insert(im.pixels.end(), {r, g, b});
  return im;
}

inline int max_difference(const RgbImage& a, const RgbImage& b) {
  REQUIRE(a.pixels.size() == b.pixels.size());
  int d = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) d = std::max(d, std::abs(a.pixels[i] - b.pixels[i]));
  return d;
}

}  // namespace test
