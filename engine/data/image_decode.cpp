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

// PIL's decompression-bomb limit (it refuses twice its warning threshold of 89,478,485): a few
// bytes of a file can declare an image of gigabytes.
constexpr int64_t kMaxPixels = 2 * 89478485;

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

// CMYK JPEGs store the inks inverted (255 = no ink: Adobe's convention, which PIL assumes for
// every CMYK JPEG, marker or not); PIL's CMYK to RGB is (255 - c)(255 - k) / 255 a channel.
void cmyk_to_rgb(const uint8_t* inverted, int width, uint8_t* rgb) {
  for (int x = 0; x < width; ++x, inverted += 4, rgb += 3)
    for (int c = 0; c < 3; ++c) rgb[c] = uint8_t((inverted[c] * inverted[3] + 127) / 255);
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
    if (cmyk) cmyk_to_rgb(row.data(), out.width, dst);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (errors.truncated) {
    std::snprintf(errors.message, sizeof errors.message, "the data end before the image does");
    return false;
  }
  return true;
}

// libpng's simplified API would apply gamma (a 16-bit file counts as linear light, and is
// re-encoded to sRGB); PIL applies none. So the plain API, told to expand palettes and low bit
// depths, keep each 16-bit sample's high byte, make gray RGB and drop alpha: PIL's
// convert("RGB"). Errors jump back here, as libjpeg's do.
struct PngRead {
  const std::vector<uint8_t>* bytes;
  size_t at = 0;
  char message[200] = {};
};

void png_fail(png_structp png, png_const_charp message) {
  auto* r = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof r->message, "%s", message);
  png_longjmp(png, 1);
}

void png_quiet(png_structp, png_const_charp) {}

void png_source(png_structp png, png_bytep data, png_size_t n) {
  auto* r = static_cast<PngRead*>(png_get_io_ptr(png));
  if (r->bytes->size() - r->at < n) png_error(png, "the data end before the image does");
  std::memcpy(data, r->bytes->data() + r->at, n);
  r->at += n;
}

// Whether every chunk's length fits in the bytes after it. libpng allocates a text chunk whole
// before reading it, and only warns where its length is beyond its limits: a 44-byte file whose
// tEXt chunk claims 2 GB took 2 GB per decoding thread before its bytes ran out.
bool chunks_fit(const std::vector<uint8_t>& bytes) {
  size_t at = 8;  // after the signature
  while (bytes.size() - at >= 8) {
    const uint64_t length = uint64_t(bytes[at]) << 24 | uint64_t(bytes[at + 1]) << 16 |
                            uint64_t(bytes[at + 2]) << 8 | uint64_t(bytes[at + 3]);
    if (length + 12 > bytes.size() - at) return false;  // length, type, data, CRC
    if (std::memcmp(&bytes[at + 4], "IEND", 4) == 0) return true;
    at += size_t(length) + 12;
  }
  return true;  // cut between chunks: libpng says where the data ended
}

// As decode_jpeg: no C++ object is made between the setjmp and its end.
bool decode_png(PngRead& r, RgbImage& out, std::vector<png_bytep>& rows) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, png_fail, png_quiet);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) {
    std::snprintf(r.message, sizeof r.message, "out of memory");
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  png_set_read_fn(png, &r, png_source);
  png_read_info(png, info);
  const png_uint_32 width = png_get_image_width(png, info);
  const png_uint_32 height = png_get_image_height(png, info);
  if (!plausible_size(width, height)) {
    char message[120];  // an array: no destructor for the jump to skip
    std::snprintf(message, sizeof message, "%ux%u pixels, more than the %lld an image may have",
                  width, height, (long long)kMaxPixels);
    png_error(png, message);
  }
  png_set_expand(png);  // palette to RGB, gray below 8 bits to 8, tRNS to alpha
  png_set_strip_16(png);
  png_set_gray_to_rgb(png);
  png_set_strip_alpha(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != size_t(width) * 3)
    png_error(png, "not convertible to 8-bit RGB");
  out.width = int(width);
  out.height = int(height);
  out.pixels.resize(size_t(width) * size_t(height) * 3);
  rows.resize(height);
  for (png_uint_32 y = 0; y < height; ++y) rows[y] = &out.pixels[size_t(y) * size_t(width) * 3];
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

}  // namespace

RgbImage decode_image(const std::vector<uint8_t>& bytes, const std::string& name) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) {
    RgbImage out;
    std::vector<png_bytep> rows;
    PngRead r{&bytes};
    if (!chunks_fit(bytes))
      throw Error(fmt::format("{}: corrupt PNG image: the data end before the image does", name));
    if (!decode_png(r, out, rows))
      throw Error(fmt::format("{}: corrupt PNG image: {}", name, r.message));
    return out;
  }
  if (bytes.size() < 3 || bytes[0] != 0xFF || bytes[1] != 0xD8 || bytes[2] != 0xFF)
    throw Error(fmt::format("{}: not a JPEG or PNG image ({} bytes{})", name, bytes.size(),
                            bytes.empty() ? ", empty" : ""));
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
