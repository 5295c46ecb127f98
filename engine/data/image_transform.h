// From a decoded image to a model's input, as torchvision's ImageNet recipe transforms it:
//   evaluation (and training without augmentation): Resize(S * 256 / 224) then CenterCrop(S)
//   training with augmentation: RandomResizedCrop(S) (area 8-100%, aspect 3/4-4/3) and
//     RandomHorizontalFlip(0.5)
// then ToTensor() and Normalize(mean, std). Each is one resampling per axis with PIL's
// antialiased bilinear filter (a triangle as wide as the scale when shrinking) that computes
// what torchvision's two steps do: the centre crop reads the whole image resized (pixels beside
// the crop weigh in at its edges, as they do in the resized image), the random crop only its
// box (cropped first, then resized). Values stay in floats between the two passes, where PIL
// rounds them to bytes: within 1/255 of torchvision's.
#pragma once
#include <array>
#include <cstdint>

#include "engine/data/dataset.h"
#include "engine/data/image_decode.h"

namespace replica {

// One axis of a crop: output pixels [out_first, out_first + out_count) resample the source
// interval [start, start + length) (source pixels, fractions allowed), reading only source
// pixels in [lo, hi). Output pixels outside the span are zero before normalisation: the
// padding CenterCrop adds when the crop is larger than the resized image.
struct CropSpan {
  int out_first = 0, out_count = 0;
  double start = 0, length = 0;
  int lo = 0, hi = 0;
};
struct CropPlan {
  CropSpan x, y;
};

// Resize(short side -> S = round(min(out_h, out_w) * 256 / 224)) then CenterCrop(out_h x
// out_w), with torchvision's numbers: the long side int(S * long / short), the offsets rounded
// half to even as Python rounds, zero padding where the crop is larger (split as it splits it).
CropPlan center_crop_plan(int width, int height, int out_h, int out_w);

// RandomResizedCrop's box (torchvision's get_params: 10 tries at a random area and aspect,
// then the whole image's centre clamped to the aspect range), drawn from `rng`, resized to
// out_h x out_w reading the box alone.
CropPlan random_crop_plan(int width, int height, int out_h, int out_w, SplitMix64& rng);

struct ImageTransform {
  int channels = 3, out_h = 224, out_w = 224;  // channels 1: luminance (PIL's "L" weights)
  bool augment = false;                        // random crop and flip instead of the centre
  std::array<float, 3> mean = {0.485f, 0.456f, 0.406f};  // ImageNet's, as the recipes use
  std::array<float, 3> std = {0.229f, 0.224f, 0.225f};
};

// Resamples `image` as `plan` says (mirrored left to right with `flip`) and writes channels x
// out_h x out_w normalised floats.
void crop_resize(const RgbImage& image, const CropPlan& plan, bool flip, const ImageTransform& t,
                 float* out);

// The centre crop, or with augmentation a random crop and flip drawn from `random_key` (the
// same key, the same sample: a pure function), through crop_resize.
void transform_image(const RgbImage& image, const ImageTransform& t, uint64_t random_key,
                     float* out);

}  // namespace replica
