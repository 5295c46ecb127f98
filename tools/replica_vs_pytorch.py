#!/usr/bin/env python3
"""replica against PyTorch eager on one device, case by case and precision by precision: the same
model, input, batch, optimizer (Adam 1e-3) and synthetic data, measured in one run.

    python3 tools/replica_vs_pytorch.py --out DIR                          # the default cases
    python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:64 --precisions fp32,tf32 --out DIR

Each case MODEL:CxHxW:BATCH runs `replica-bench --suite dp --device-counts 1` and
`tools/pytorch_bench.py --mode dp --device-counts 1` at every precision (fp32: strict; tf32:
tensor-core GEMMs and convolutions; bf16: mixed precision, PyTorch's autocast and replica's bf16
products, both on channels_last convolutions: each engine's --memory-format auto). Writes
DIR/rows.jsonl (every row of both engines) and DIR/table.md (samples/s side by side, the ratio,
peak memory), and prints the table.
Without PyTorch (or without a GPU for tf32) the cells it cannot fill say why.

--cudnn-benchmark has both engines pick each convolution's algorithms by timing them
(replica-bench --cudnn-benchmark, torch.backends.cudnn.benchmark); without it both use cuDNN's
heuristics. The tables say which.

--cuda-graphs has replica capture its step as a CUDA Graph and replay it (replica-bench and
replica-train --cuda-graphs); PyTorch stays eager, the comparison issue 12 sets. The tables say
so.

--rounds N runs each case's two engines N times, alternated (replica first in odd rounds,
PyTorch first in even ones), so that a machine whose speed drifts during the call (clocks,
other tenants, a warm GPU) weighs on both alike. The table gives each engine's median round,
the median of the rounds' paired ratios and, beside it, every round's ratio: a spread that
says how far one ratio can be trusted. Every round's rows go to DIR/rows.jsonl ("round": k).

--with-train also runs `replica-train --synthetic` on each case, with its
input pipeline, and puts its samples/s beside the benchmark's (preloaded batches) with the share
of a step spent waiting for data: a second table in DIR/table.md. --train-placements host,device
runs it once per --data-placement (default: auto): `host` copies each batch from pinned memory,
a step ahead on a copy stream on GPUs, so train / bench there says what those copies cost.

Defaults: on a machine with an NVIDIA GPU (cuda:0), the CNN at batch 32, 64 and 256, the seed
recipe's ResNet-101 (1x28x28, batch 256) and ResNet-50 (3x224x224) at 64, 128 and 256, each in
fp32, tf32 and bf16; on CPU only the CNN at batch 32 and 64 in fp32.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from replica_vs_pytorch_tables import report_text

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_CASES = ["cnn:1x28x28:32", "cnn:1x28x28:64", "cnn:1x28x28:256", "resnet101:1x28x28:256",
             "resnet50:3x224x224:64", "resnet50:3x224x224:128", "resnet50:3x224x224:256"]
CPU_CASES = ["cnn:1x28x28:32", "cnn:1x28x28:64"]


def fail(msg):
    print("replica_vs_pytorch: error: " + msg, file=sys.stderr)
    sys.exit(2)


def have_gpu():
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


# MODEL:CxHxW:BATCH, every number positive; gpu_checks.py checks its --case with it too.
CASE = re.compile(r"(\w+):([1-9]\d*x[1-9]\d*x[1-9]\d*):([1-9]\d*)")


def parse_case(text):
    """MODEL:CxHxW:BATCH -> (model, shape, batch)."""
    m = CASE.fullmatch(text)
    if not m:
        fail("--case '%s': expected MODEL:CxHxW:BATCH, e.g. resnet50:3x224x224:64" % text)
    return m.group(1), m.group(2), int(m.group(3))


def first_row(path):
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    return rows[0] if rows else None


def whole_json(path):
    with open(path) as f:
        return json.load(f)


def run_one(cmd, out_file, read=first_row):
    """Runs a program that writes out_file (removed first: replica-bench appends to it);
    returns (read(out_file), None), or (None, the reason there is nothing)."""
    if os.path.exists(out_file):
        os.remove(out_file)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        # The error line is stderr's last; stdout ends with progress lines ("round 1/1: ... failed").
        lines = [l for l in (p.stderr.strip() or p.stdout).splitlines() if l.strip()]
        return None, lines[-1] if lines else "exit %d" % p.returncode
    result = read(out_file)
    return (result, None) if result else (None, "%s wrote nothing" % os.path.basename(cmd[0]))


def measure_round(args, model, shape, batch, precision, tmp, pytorch_first):
    """One run of each engine on a case: {"replica": (row, why), "pytorch": (row, why)}."""
    common = ["--model", model, "--input-shape", shape, "--seed", "0"]
    if args.cudnn_benchmark:
        common.append("--cudnn-benchmark")
    graphs = ["--cuda-graphs"] if args.cuda_graphs else []  # replica's side only
    timing = []
    for flag in ("steps", "warmup", "repeat"):
        if getattr(args, flag) is not None:
            timing += ["--" + flag, str(getattr(args, flag))]
    runs = {
        "replica": lambda out: run_one(
            [os.path.join(args.bin, "replica-bench"), "--suite", "dp", "--devices", args.device,
             "--device-counts", "1", "--batch", str(batch), "--precision", precision,
             "--json", out] + common + graphs + timing, out),
        "pytorch": lambda out: run_one(
            [sys.executable, os.path.join(HERE, "pytorch_bench.py"), "--mode", "dp",
             "--devices", args.device, "--device-counts", "1", "--batch-per-device", str(batch),
             "--precision", precision, "--out", out] + common + timing, out),
    }
    order = ["pytorch", "replica"] if pytorch_first else ["replica", "pytorch"]
    return {name: runs[name](os.path.join(tmp, name + ".jsonl")) for name in order}


def combine_rounds(rounds):
    """Each engine's rounds in one cell: (the median round's row, with samples_per_sec the
    median over the rounds and samples_per_sec_rounds every round's, or None and why), and
    "ratios": replica / PyTorch of each round where both ran, in round order."""
    cells = {"ratios": []}
    for name in ("replica", "pytorch"):
        rows = [r[name][0] for r in rounds if r[name][0]]
        whys = [r[name][1] for r in rounds if not r[name][0]]
        if not rows:
            cells[name] = (None, whys[0] if whys else "not run")
            continue
        speeds = [row["samples_per_sec"] for row in rows]
        middle = sorted(rows, key=lambda row: row["samples_per_sec"])[(len(rows) - 1) // 2]
        cells[name] = (dict(middle, samples_per_sec=statistics.median(speeds),
                            samples_per_sec_rounds=speeds), None)
    for r in rounds:
        if r["replica"][0] and r["pytorch"][0]:
            cells["ratios"].append(r["replica"][0]["samples_per_sec"]
                                   / r["pytorch"][0]["samples_per_sec"])
    return cells


def measure(args, model, shape, batch, precision, tmp):
    """args.rounds rounds of both engines on a case, combined (combine_rounds); the rows of
    every round, marked with it, under "rows"."""
    rounds = []
    for k in range(args.rounds):
        cells = measure_round(args, model, shape, batch, precision, tmp, pytorch_first=k % 2 == 1)
        for row, _ in cells.values():
            if row and args.rounds > 1:
                row["round"] = k + 1
        rounds.append(cells)
        if args.rounds > 1:
            print("  round %d/%d: %s" % (k + 1, args.rounds, ", ".join(
                "%s %s" % (name, "%.1f" % row["samples_per_sec"] if row else "-")
                for name, (row, _) in sorted(cells.items(), reverse=True))), flush=True)
    combined = combine_rounds(rounds)
    combined["rows"] = [row for cells in rounds for (row, _) in cells.values() if row]
    return combined


def run_train(args, model, shape, batch, precision, placement, tmp):
    """replica-train on synthetic data: (its metrics, None) or (None, why)."""
    out = os.path.join(tmp, "train.json")
    cmd = [os.path.join(args.bin, "replica-train"), "--synthetic", "--model", model,
           "--input-shape", shape, "--batch-size", str(batch), "--devices", args.device,
           "--precision", precision, "--data-placement", placement,
           "--max-steps", str(args.train_steps),
           "--synthetic-size", str(batch * args.train_steps), "--no-eval", "--quiet",
           "--metrics-json", out] + (["--cudnn-benchmark"] if args.cudnn_benchmark else [])
    cmd += ["--cuda-graphs"] if args.cuda_graphs else []
    return run_one(cmd, out, read=whole_json)


def write_atomically(path, text):
    tmp = path + ".tmp-%d" % os.getpid()
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def parse_args():
    """The command line, checked before anything runs; fills in the device, cases, precisions
    and placements a run without them gets."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", action="append", default=[], help="MODEL:CxHxW:BATCH (repeatable)")
    p.add_argument("--precisions", default="", help="comma list of fp32, tf32, bf16")
    p.add_argument("--device", default="", help="cuda:K or cpu (default: cuda:0 if a GPU is found)")
    p.add_argument("--steps", type=int, help="timed steps per window (both engines)")
    p.add_argument("--warmup", type=int, help="untimed steps first (both engines)")
    p.add_argument("--repeat", type=int, help="timed windows, median reported (both engines)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each engine per case, alternated; the median ratio is reported")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="both engines time cuDNN's algorithms per shape (GPU only)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replica replays its step as a CUDA Graph; PyTorch stays eager (GPU only)")
    p.add_argument("--with-train", action="store_true",
                   help="also run replica-train --synthetic on each case")
    p.add_argument("--train-steps", type=int, default=100, help="replica-train's --max-steps")
    p.add_argument("--train-placements", default="auto",
                   help="comma list of replica-train's --data-placement: auto, host, device")
    p.add_argument("--bin", default=os.path.join(os.path.dirname(HERE), "build", "bin"))
    p.add_argument("--out", required=True, help="directory for rows.jsonl and table.md")
    args = p.parse_args()
    args.gpu = args.device.startswith("cuda") if args.device else have_gpu()
    args.device = args.device or ("cuda:0" if args.gpu else "cpu")
    if args.device != "cpu" and not args.device.startswith("cuda:"):
        fail("--device '%s': expected cuda:K or cpu" % args.device)
    if args.cudnn_benchmark and not args.gpu:
        fail("--cudnn-benchmark needs a GPU (--device cuda:K)")
    if args.cuda_graphs and not args.gpu:
        fail("--cuda-graphs needs a GPU (--device cuda:K)")
    args.cases = [parse_case(c) for c in (args.case or (GPU_CASES if args.gpu else CPU_CASES))]
    args.precisions = (args.precisions or ("fp32,tf32,bf16" if args.gpu else "fp32")).split(",")
    for x in args.precisions:
        if x not in ("fp32", "tf32", "bf16"):
            fail("--precisions: '%s' is not fp32, tf32 or bf16" % x)
    if args.rounds < 1:
        fail("--rounds must be at least 1")
    if args.train_steps < 1:
        fail("--train-steps must be at least 1")
    args.placements = args.train_placements.split(",")
    for x in args.placements:
        if x not in ("auto", "host", "device"):
            fail("--train-placements: '%s' is not auto, host or device" % x)
    if not os.access(os.path.join(args.bin, "replica-bench"), os.X_OK):
        fail("%s/replica-bench not found: build it (tools/setup.sh --all) or give --bin" % args.bin)
    return args


def measure_case(args, model, shape, batch, precision, tmp):
    """Both engines on one case, and replica-train on it where asked: the case's cells and the
    JSON rows it measured."""
    cells = measure(args, model, shape, batch, precision, tmp)
    rows = cells.pop("rows")
    if args.with_train:
        cells["train"] = {}
        for placement in args.placements:
            train = run_train(args, model, shape, batch, precision, placement, tmp)
            cells["train"][placement] = train
            if train[0]:
                rows.append(dict(train[0], engine="replica-train"))
    r, p = cells["replica"][0], cells["pytorch"][0]
    print("%s %s batch %d %s: replica %s, PyTorch %s" % (
        model, shape, batch, precision, "%.1f" % r["samples_per_sec"] if r else "-",
        "%.1f" % p["samples_per_sec"] if p else "-"), flush=True)
    return cells, rows


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    results, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model, shape, batch in args.cases:
            for precision in args.precisions:
                cells, case_rows = measure_case(args, model, shape, batch, precision, tmp)
                results.append(((model, shape, batch, precision), cells))
                rows += case_rows
                # After every case, so a run cut short (a time limit) keeps what it measured.
                text = report_text(args, results)
                write_atomically(os.path.join(args.out, "rows.jsonl"),
                                 "".join(json.dumps(r) + "\n" for r in rows))
                write_atomically(os.path.join(args.out, "table.md"), text)
    print()
    print(text, end="")
    print("wrote %s/rows.jsonl and %s/table.md" % (args.out, args.out))
    if not any(cells["replica"][0] for _, cells in results):
        print("replica_vs_pytorch: error: replica measured no case (table.md says why)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
