// libFuzzer target for image decoding and the crops (engine/data/image_decode.h,
// image_transform.h), built and run by tools/fuzz.sh. Every input is decoded as a file (JPEG or
// PNG by its first bytes); an image that decodes is cropped both ways (centre, and random with a
// key taken from the input) to a small odd shape and must give finite numbers. Bad input may
// only throw replica::Error.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "engine/data/image_decode.h"
#include "engine/data/image_transform.h"
#include "engine/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  replica::RgbImage image;
  try {
    image = replica::decode_image(std::vector<uint8_t>(data, data + size), "input");
  } catch (const replica::Error&) {
    return 0;
  }
  if (image.width < 1 || image.height < 1 ||
      image.pixels.size() != size_t(image.width) * size_t(image.height) * 3) {
    std::fprintf(stderr, "fuzz_image: a %dx%d image with %zu bytes\n", image.width, image.height,
                 image.pixels.size());
    std::abort();
  }
  replica::ImageTransform t;
  t.out_h = 7;
  t.out_w = 5;
  std::vector<float> out(3 * 7 * 5);
  for (const bool augment : {false, true}) {
    t.augment = augment;
    replica::transform_image(image, t, size, out.data());
    for (float v : out)
      if (!std::isfinite(v) || std::abs(v) > 3) {  // (x/255 - mean) / std stays within +-2.7
        std::fprintf(stderr, "fuzz_image: output %g\n", double(v));
        std::abort();
      }
  }
  return 0;
}
