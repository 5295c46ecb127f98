#!/usr/bin/env python3
"""Holds replica's image-folder pipeline against torchvision's, on the same files.

Makes an image folder with PIL (RGB JPEGs of several sizes and aspects, a grayscale and a CMYK
JPEG, a PNG with alpha, a palette PNG, a PNG named .JPEG), then reads its val/ split twice:
`replica-data --split test` (decoding, Resize(256) + CenterCrop(224), normalisation) and
torchvision's ImageFolder with the ImageNet example's validation transform. For each image it
prints the largest difference in pixel levels (1/255 before normalisation): PIL rounds to bytes
between its two resampling passes, replica does not, so up to about 1 level is expected.

    python3 tools/compare_transforms.py --bin build/bin [--keep DIR] [--tolerance 1.5]

Exit 0 within the tolerance (and the same labels in the same order), 1 beyond it, 2 when
replica-data fails, 77 where torch, torchvision or PIL is missing (the GPU machine's image has
them).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def make_folder(root, Image):
    """val/<class>/ and the same files in train/ (replica's reader wants both splits)."""
    import random
    rng = random.Random(5)

    def picture(w, h, mode="RGB"):
        img = Image.new("RGB", (w, h))
        img.putdata([((x * 255) // max(1, w - 1), (y * 255) // max(1, h - 1),
                      rng.randrange(256)) for y in range(h) for x in range(w)])
        if mode == "CMYK":  # black ink as well (PIL's RGB -> CMYK leaves K at 0)
            c, m, y, _ = img.convert("CMYK").split()
            k = Image.new("L", (w, h))
            k.putdata([(x * 200) // max(1, w - 1) for _ in range(h) for x in range(w)])
            return Image.merge("CMYK", (c, m, y, k))
        if mode == "RGBA":  # alpha that varies: dropped, not blended
            img = img.convert("RGBA")
            a = Image.new("L", (w, h))
            a.putdata([(y * 255) // max(1, h - 1) for y in range(h) for _ in range(w)])
            img.putalpha(a)
            return img
        return img.convert(mode) if mode != "RGB" else img

    files = {
        "ant": [("a1.jpg", picture(500, 375), "JPEG"), ("a2.jpg", picture(375, 500), "JPEG"),
                ("a3.jpg", picture(256, 256), "JPEG"), ("a4.jpg", picture(1000, 60), "JPEG")],
        "bee": [("b1.jpg", picture(300, 200, "L"), "JPEG"),
                ("b2.jpg", picture(300, 200, "CMYK"), "JPEG"),
                ("b3.png", picture(120, 90, "RGBA"), "PNG")],
        "cat": [("c1.png", picture(97, 131, "P"), "PNG"), ("c2.png", picture(64, 48, "L"), "PNG"),
                ("c3.JPEG", picture(80, 80), "PNG")],  # a PNG named .JPEG, as ImageNet has
    }
    for split in ("train", "val"):
        for cls, items in files.items():
            os.makedirs(os.path.join(root, split, cls), exist_ok=True)
            for name, img, fmt in items:
                kwargs = {"quality": 90} if fmt == "JPEG" else {}
                img.save(os.path.join(root, split, cls, name), fmt, **kwargs)


def read_safetensors(path, torch):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        dtype = {"F32": torch.float32, "I32": torch.int32}[t["dtype"]]
        buf = bytearray(raw[8 + n + begin:8 + n + end])
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(t["shape"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="build/bin", help="where replica-data is")
    ap.add_argument("--keep", help="make the folder here and keep it (default: a temporary one)")
    ap.add_argument("--tolerance", type=float, default=1.5, help="pixel levels (default 1.5)")
    a = ap.parse_args()
    try:
        import torch
        from PIL import Image
        from torchvision import datasets, transforms
    except ImportError as e:
        print(f"compare_transforms: needs torch, torchvision and PIL ({e})", file=sys.stderr)
        return 77
    root = a.keep or tempfile.mkdtemp(prefix="replica-transforms-")
    try:
        make_folder(root, Image)
        out = os.path.join(root, "replica.safetensors")
        try:
            subprocess.run([os.path.join(a.bin, "replica-data"), "--data", root, "--split",
                            "test", "--count", "1000", "--out", out], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"compare_transforms: replica-data failed: {e}", file=sys.stderr)
            return 2
        mine = read_safetensors(out, torch)
        if tuple(mine["images"].shape[1:]) != (3, 224, 224) or \
                not torch.isfinite(mine["images"]).all():
            print(f"compare_transforms: replica-data wrote {tuple(mine['images'].shape)} images "
                  "(expected 3x224x224, all finite)")
            return 1
        tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        theirs = datasets.ImageFolder(os.path.join(root, "val"), transform=tf)
        if len(theirs) != mine["images"].shape[0]:
            print(f"compare_transforms: torchvision reads {len(theirs)} images, replica "
                  f"{mine['images'].shape[0]}")
            return 1
        scale = torch.tensor(STD).view(3, 1, 1) * 255  # normalised units -> pixel levels
        worst, bad = 0.0, 0
        for i, (path, label) in enumerate(theirs.samples):
            image, _ = theirs[i]
            diff = (mine["images"][i] - image).abs() * scale
            levels, mean = diff.max().item(), diff.mean().item()
            same_label = int(mine["labels"][i]) == label
            worst = max(worst, levels)
            bad += not (levels <= a.tolerance) or not same_label  # a NaN is beyond it too
            print(f"{os.path.relpath(path, root):24} largest {levels:6.2f}  mean {mean:5.2f} levels"
                  f"{'' if same_label else '  LABEL ' + str(int(mine['labels'][i]))}")
        print(f"{len(theirs)} images, largest difference {worst:.2f} pixel levels "
              f"(tolerance {a.tolerance}): {'ok' if not bad else f'{bad} beyond it'}")
        return 0 if not bad else 1
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
