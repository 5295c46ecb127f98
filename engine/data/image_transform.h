// From a decoded image to a model's input, as torchvision's ImageNet recipe transforms it:
//   evaluation (and training without augmentation): Resize(S * 256 / 224) then CenterCrop(S)
//   training with augmentation: RandomResizedCrop(S) (area 8-100%, aspect 3/4-4/3) and
//     RandomHorizontalFlip(0.5)
// then ToTensor() and Normalize(mean, std). The crop and the resize are one resampling of the
// crop's box (PIL's antialiased bilinear filter: a triangle as wide as the scale when
// shrinking), which is what resizing the whole image and then cropping computes.
#pragma once
#include <array>
#include <cstdint>

#include "engine/data/dataset.h"
#include "engine/data/image_decode.h"

namespace replica {

// A box of the source image, in source pixels: left, top, width, height. A random crop's are
// whole pixels (torchvision crops, then resizes); a centre crop's are the resized image's crop
// mapped back (fractions of source pixels).
struct CropBox {
  double x = 0, y = 0, w = 0, h = 0;
};

// Resize(short side -> S = round(min(out_h, out_w) * 256 / 224)) then CenterCrop(out_h x out_w)
// as a box of the source, with torchvision's numbers: the long side int(S * long / short), the
// offsets rounded half to even as Python rounds. A crop larger than the resized image (an
// output far from the image's aspect) takes the whole side; its edge pixels then extend.
CropBox center_crop_box(int width, int height, int out_h, int out_w);

// RandomResizedCrop's box (torchvision's get_params: 10 tries at a random area and aspect,
// then the whole image's centre clamped to the aspect range), drawn from `rng`.
CropBox random_crop_box(int width, int height, SplitMix64& rng);

struct ImageTransform {
  int channels = 3, out_h = 224, out_w = 224;  // channels 1: luminance (PIL's "L" weights)
  bool augment = false;                        // random crop and flip instead of the centre
  std::array<float, 3> mean = {0.485f, 0.456f, 0.406f};  // ImageNet's, as the recipes use
  std::array<float, 3> std = {0.229f, 0.224f, 0.225f};
};

// Writes channels x out_h x out_w floats for `image`. With augmentation the crop and the flip
// come from `random_key` (the same key, the same sample: a pure function).
void transform_image(const RgbImage& image, const ImageTransform& t, uint64_t random_key,
                     float* out);

}  // namespace replica
