// Image files as RGB pixels: JPEG (RGB, grayscale, CMYK with and without Adobe's marker) and
// PNG (alpha, gray, 16-bit) made RGB as PIL's convert("RGB") makes them, told by content; bad
// files (cut, corrupted at random, declaring gigabytes) one-line errors naming the file, never
// a crash, a gray image or a message on stderr.
#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "image_files.h"

#include <sys/resource.h>
#include <unistd.h>

#include <random>

#include "engine/data/image_decode.h"
#include "engine/error.h"

using namespace replica;
using namespace test;

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
    CHECK_MESSAGE(e.find(".cpp:") == std::string::npos, e);  // the file's fault, not a source line
  }
  CHECK(error_of([&] { decode_image(tmp.str("missing.jpg")); }).find("no such file") !=
        std::string::npos);
  {
    // A 44-byte PNG whose text chunk (after IHDR's 33 bytes) says it is 2 GB long: an error,
    // and not 2 GB of memory first (a loader decodes one such file per core).
    std::vector<uint8_t> liar(png.begin(), png.begin() + 33);
    for (const int b : {0x7F, 0xFF, 0xFF, 0xFF, int('t'), int('E'), int('X'), int('t'), 1, 2, 3})
      liar.push_back(uint8_t(b));
    test::put_bytes(tmp.str("liar.png"), liar);
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    const std::string e = error_of([&] { decode_image(tmp.str("liar.png")); });
    getrusage(RUSAGE_SELF, &after);
    CHECK_MESSAGE(e.rfind(tmp.str("liar.png") + ": corrupt PNG image", 0) == 0, e);
    CHECK((after.ru_maxrss - before.ru_maxrss) / 1024 < 256);  // MB more at the peak
  }
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
