// Image folders (ImageNet's layout): classes, labels shared with val, ImageFolder's file order,
// augmentation draws, what is missing named before training, and the programs on a folder:
// replica-train (DP, DDP, --preset imagenet), replica-bench --suite loader --data and
// replica-data.
#include <doctest/doctest.h>

#include "cli_helpers.h"
#include "image_files.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/data/image_folder.h"
#include "engine/data/resident_dataset.h"
#include "engine/error.h"

using namespace replica;
using namespace test;

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
  CHECK(error_of([&] { open_image_folder(dir, false, o); }) ==
        tmp.str("set/val/zebra") + ": no images in it (.jpg, .jpeg or .png files)");
  write_jpeg(tmp.str("set/val/zebra/z.jpg"), pattern(20, 20), 3);
  CHECK(error_of([&] { open_image_folder(dir, false, o); }) ==
        tmp.str("set/val") + ": class 'zebra' is not among the 3 classes of " +
            tmp.str("set/train"));
  CHECK(error_of([&] { open_image_folder(tmp.str("set/train/ant"), true, o); })
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
  // A pipe named like an image is refused when listed: opening it would block for good.
  REQUIRE(mkfifo(tmp.str("set/train/cat/pipe.jpg").c_str(), 0600) == 0);
  CHECK(error_of([&] { open_image_folder(dir, true, o); }) ==
        tmp.str("set/train/cat/pipe.jpg") +
            ": not a regular file (a pipe, socket or device), so not an image");
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
    const auto m = read_json(tmp.str(mode + ".json"));
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
                           "--input-shape applies to --synthetic data and image folders, and " +
                               tmp.str("mnist") + " has no train/ directory of class directories");
  // A missing directory is named as such, before a flag that needs an image folder; a split
  // given for the folder says what an image folder is.
  test::expect_clean_error("replica-train", "--data " + tmp.str("nowhere") + " --input-shape 3x8x8",
                           "data directory '" + tmp.str("nowhere") + "' does not exist");
  test::expect_clean_error("replica-train", "--data " + tmp.str("set/train") + " --max-steps 1",
                           "; or, for an image folder, give the directory that holds "
                           "train/<class>/ and val/<class>/");
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
  const auto m = read_json(tmp.str("m.json"));
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
  // A batch larger than the folder (it has 5 images) is refused, at any size.
  for (const char* batch : {"6", "1000", "100000000"})
    test::expect_clean_error("replica-bench",
                             "--suite loader --data " + tmp.str("set") +
                                 " --input-shape 3x32x32 --steps 1 --warmup 0 --batch " + batch,
                             "has 5 samples; a batch may hold at most that many");
}

TEST_CASE("replica-data writes the samples the training reads, as safetensors") {
  test::TempDir tmp;
  write_folder(tmp.path / "set");
  const std::string dir = tmp.str("set");
  auto r = test::run(test::bin("replica-data") + " --data " + dir + " --split test" +
                     " --input-shape 3x16x16 --out " + tmp.str("val.safetensors"));
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output == "2 samples of set val: 2 x 3x16x16, 3 classes, centre crops (from 0, epoch "
                    "1) written to " + tmp.str("val.safetensors") + "\n");
  const Checkpoint c = load_checkpoint(tmp.str("val.safetensors"));
  CHECK(c.metadata.at("format") == "replica-samples-v1");
  const Tensor* images = c.find("images");
  const Tensor* labels = c.find("labels");
  REQUIRE(images != nullptr);
  REQUIRE(labels != nullptr);
  CHECK(images->shape() == Shape{2, 3, 16, 16});
  ImageFolderOptions o;
  o.sample_shape = {3, 16, 16};
  auto val = open_image_folder(dir, false, o);
  std::vector<float> want(2 * 3 * 16 * 16);
  std::vector<int32_t> want_labels(2);
  const int64_t both[2] = {0, 1};
  val->read(both, 2, want.data(), want_labels.data());
  CHECK(std::vector<float>(images->f32(), images->f32() + images->numel()) == want);
  CHECK(std::vector<int32_t>(labels->i32(), labels->i32() + 2) == want_labels);
  // An epoch's random crops: another epoch, other crops.
  const std::string train = test::bin("replica-data") + " --data " + dir +
                            " --input-shape 3x16x16 --count 5 --out ";
  REQUIRE(test::run(train + tmp.str("e1") + " --epoch 1").exit_code == 0);
  REQUIRE(test::run(train + tmp.str("e2") + " --epoch 2").exit_code == 0);
  const Checkpoint e1 = load_checkpoint(tmp.str("e1")), e2 = load_checkpoint(tmp.str("e2"));
  CHECK(e1.find("images")->shape() == Shape{5, 3, 16, 16});
  CHECK_FALSE(std::equal(e1.find("images")->f32(), e1.find("images")->f32() + 5 * 768,
                         e2.find("images")->f32()));
  // Epoch 1 is the loader's first: what the training's first epoch reads.
  ImageFolderOptions crops;
  crops.sample_shape = {3, 16, 16};
  auto train_set = open_image_folder(dir, true, crops);
  std::vector<float> first_epoch(5 * 768);
  std::vector<int32_t> five(5);
  const int64_t all[5] = {0, 1, 2, 3, 4};
  train_set->read(all, 5, first_epoch.data(), five.data(), 0);
  CHECK(std::equal(first_epoch.begin(), first_epoch.end(), e1.find("images")->f32()));
  test::expect_clean_error("replica-data", "--data " + dir + " --epoch 0 --out x",
                           "--epoch counts from 1, got 0");
  test::expect_clean_error("replica-data", "--data " + dir + " --split val --out x",
                           "unknown --split 'val' (train, test)");
  test::expect_clean_error("replica-data", "--data " + dir + " --first 5 --out x",
                           "--first 5: the train split has 5 samples");
  test::write_mnist_dir(tmp.path / "mnist", 16, 8);
  test::expect_clean_error("replica-data",
                           "--data " + tmp.str("mnist") + " --no-augment --out " + tmp.str("y"),
                           "--input-shape and --no-augment apply to image folders");
}
