// Image files as 8-bit RGB pixels: what an image-folder dataset reads (image_folder.h). The
// format is told by the file's first bytes, not its name (ImageNet holds a PNG named .JPEG):
// JPEG through libjpeg-turbo (grayscale, YCbCr, CMYK and YCCK all become RGB, as PIL's
// convert("RGB") makes them; CMYK taken as Adobe's inverted inks, as PIL takes it) and PNG
// through libpng (palette, gray and alpha become RGB with alpha dropped, no gamma applied, as
// PIL does; a 16-bit sample keeps its high byte, where PIL clips 16-bit gray instead).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica {

struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;  // height rows of width x (R, G, B)
};

// Decodes the file at `path`. Errors (replica::Error) name the file and say what is wrong: not
// readable, neither JPEG nor PNG, truncated or corrupt data, more than 178,956,970 pixels
// (PIL's decompression-bomb limit: a few bytes can declare gigabytes of image).
RgbImage decode_image(const std::string& path);

// The same from bytes in memory; `name` is what errors call them.
RgbImage decode_image(const std::vector<uint8_t>& bytes, const std::string& name);

}  // namespace replica
