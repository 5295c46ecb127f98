#include "engine/data/image_decode.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
// clang-format off: jpeglib.h needs FILE and size_t declared before it
#include <jpeglib.h>
#include <jerror.h>  // JWRN_JPEG_EOF
// clang-format on
#include <png.h>

#include "engine/error.h"
#include "engine/file_io.h"

namespace replica {

namespace {

// PIL's decompression-bomb limit: a few bytes of a file can declare an image of gigabytes.
constexpr int64_t kMaxPixels = 89478485;

bool plausible_size(int64_t width, int64_t height) {
  return width >= 1 && height >= 1 && width * height <= kMaxPixels;
}

// libjpeg reports a fatal error by calling error_exit, whose default ends the process: ours
// jumps back to the decoder instead. Warnings are not printed; the one that matters, data that
// end before the image does (a truncated file, which libjpeg would fill with gray), is kept
// and made an error, as PIL makes it one.
struct JpegErrors {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  bool truncated = false;
  char message[JMSG_LENGTH_MAX] = {};
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

void jpeg_note(j_common_ptr cinfo, int level) {
  auto* e = reinterpret_cast<JpegErrors*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) e->truncated = true;
}

// Adobe's CMYK JPEGs store the inks inverted (255 = no ink); PIL turns CMYK into RGB as
// (255 - c)(255 - k) / 255 per channel.
void cmyk_to_rgb(const uint8_t* cmyk, int width, bool inverted, uint8_t* rgb) {
  for (int x = 0; x < width; ++x, cmyk += 4, rgb += 3) {
    const int k = inverted ? cmyk[3] : 255 - cmyk[3];
    for (int c = 0; c < 3; ++c) {
      const int ink = inverted ? cmyk[c] : 255 - cmyk[c];
      rgb[c] = uint8_t((ink * k + 127) / 255);
    }
  }
}

// No C++ object is made between the setjmp and the end of the decode: a longjmp skips
// destructors. The buffers live in `out` and `row`, made by the caller.
bool decode_jpeg(const std::vector<uint8_t>& bytes, RgbImage& out, std::vector<uint8_t>& row,
                 JpegErrors& errors) {
  jpeg_decompress_struct cinfo;
  cinfo.err = jpeg_std_error(&errors.mgr);
  errors.mgr.error_exit = jpeg_fail;
  errors.mgr.emit_message = jpeg_note;
  if (setjmp(errors.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, bytes.data(), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&cinfo, TRUE);
  if (!plausible_size(cinfo.image_width, cinfo.image_height)) {  // before any pixel memory
    std::snprintf(errors.message, sizeof errors.message,
                  "%ux%u pixels, more than the %lld an image may have", cinfo.image_width,
                  cinfo.image_height, (long long)kMaxPixels);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  out.width = int(cinfo.output_width);
  out.height = int(cinfo.output_height);
  out.pixels.resize(size_t(out.width) * size_t(out.height) * 3);
  row.resize(size_t(out.width) * 4);
  while (cinfo.output_scanline < cinfo.output_height) {
    uint8_t* dst = out.pixels.data() + size_t(cinfo.output_scanline) * size_t(out.width) * 3;
    JSAMPROW target = cmyk ? row.data() : dst;
    jpeg_read_scanlines(&cinfo, &target, 1);
    if (cmyk) cmyk_to_rgb(row.data(), out.width, cinfo.saw_Adobe_marker, dst);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (errors.truncated) {
    std::snprintf(errors.message, sizeof errors.message, "the data end before the image does");
    return false;
  }
  return true;
}

// PIL's convert("RGB") drops an alpha channel (no compositing): read RGBA, keep RGB.
RgbImage decode_png(const std::vector<uint8_t>& bytes, const std::string& name) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size()))
    throw Error(fmt::format("{}: corrupt PNG image: {}", name, image.message));
  if (!plausible_size(image.width, image.height)) {
    png_image_free(&image);
    throw Error(fmt::format("{}: corrupt PNG image: {}x{} pixels, more than the {} an image may "
                            "have",
                            name, image.width, image.height, kMaxPixels));
  }
  const int width = int(image.width), height = int(image.height);
  image.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, rgba.data(), 0, nullptr))
    throw Error(fmt::format("{}: corrupt PNG image: {}", name, image.message));
  RgbImage out;
  out.width = width;
  out.height = height;
  out.pixels.resize(size_t(width) * size_t(height) * 3);
  for (size_t i = 0, n = size_t(width) * size_t(height); i < n; ++i)
    std::memcpy(&out.pixels[3 * i], &rgba[4 * i], 3);
  return out;
}

}  // namespace

RgbImage decode_image(const std::vector<uint8_t>& bytes, const std::string& name) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return decode_png(bytes, name);
  REPLICA_CHECK(bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF,
                "{}: not a JPEG or PNG image ({} bytes{})", name, bytes.size(),
                bytes.empty() ? ", empty" : "");
  RgbImage out;
  std::vector<uint8_t> row;
  JpegErrors errors;
  if (!decode_jpeg(bytes, out, row, errors))
    throw Error(fmt::format("{}: corrupt JPEG image: {}", name, errors.message));
  return out;
}

RgbImage decode_image(const std::string& path) {
  return decode_image(read_file_bytes(path, "an image file"), path);
}

}  // namespace replica
