#!/usr/bin/env python3
"""One training step's kernels, from Nsight Compute's CSV of a run: each kernel's device time,
added up by kernel name, largest first. Where the op profile (replica-bench --suite ops) says
which op takes a step's time, this says which kernel inside it does, cuDNN's included.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
        --log-file run.csv replica-bench --suite dp --device-counts 1 --devices cuda:0 \\
        --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --precision bf16 \\
        --warmup 1 --steps 2 --repeat 1
    python3 tools/ncu_step.py run.csv [--top 40]

A step is what runs between two launches of the optimizer's kernel (the last two found, so the
first steps' one-off work, cuDNN's plan building and the allocator's growth, stays out). ncu
runs kernels one at a time, so the times are each kernel alone: their sum is the step's device
time without overlap, not its wall time.
"""
import argparse
import collections
import csv
import re
import sys

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def kernels(path):
    """(name, ms) of every kernel in the CSV, in launch order."""
    try:
        with open(path, errors="replace") as f:
            lines = [line for line in f if line.startswith('"')]  # ncu's own notes are not CSV
    except OSError as e:
        sys.exit(f"ncu_step: cannot read {path}: {e.strerror}")
    out = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = UNITS.get(row["Metric Unit"])
        if scale is None:
            sys.exit(f"ncu_step: unknown time unit '{row['Metric Unit']}' in {path}")
        name = re.sub(r"\(.*", "", row["Kernel Name"]).strip()  # no argument lists
        out.append((name, float(row["Metric Value"].replace(",", "")) * scale))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --csv --log-file output with gpu__time_duration.sum")
    ap.add_argument("--top", type=int, default=40, help="kernel names to list (default 40)")
    ap.add_argument("--step-marker", default="adam",
                    help="a substring of the kernel launched once per step (default: adam)")
    args = ap.parse_args()
    ks = kernels(args.csv)
    marks = [i for i, (name, _) in enumerate(ks) if args.step_marker in name.lower()]
    if len(marks) < 2:
        sys.exit(f"ncu_step: fewer than two '{args.step_marker}' kernels in {args.csv}: "
                 "no whole step between them (run at least two steps)")
    step = ks[marks[-2] + 1:marks[-1] + 1]
    total = collections.defaultdict(float)
    calls = collections.Counter()
    for name, ms in step:
        total[name] += ms
        calls[name] += 1
    whole = sum(total.values())
    print(f"{len(step)} kernels, {whole:.3f} ms of device time in one step")
    print(f"{'ms':>8} {'share':>6} {'calls':>5}  kernel")
    for name, ms in sorted(total.items(), key=lambda t: -t[1])[:args.top]:
        print(f"{ms:8.3f} {100 * ms / whole:5.1f}% {calls[name]:5d}  {name[:90]}")


if __name__ == "__main__":
    main()
