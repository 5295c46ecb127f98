#!/usr/bin/env python3
"""The checks that need a GPU, in a few calls: time on a GPU machine that one has only for a
short while (a shared node, a short allocation) goes to measuring, not typing. Each part runs its
programs, checks what it can (exit 1 when a check fails), writes its logs, traces and JSON under
OUT/PART/ and ends with a short summary (OUT/PART/summary.md):

    python3 tools/gpu_checks.py PART [PART...] --out OUT   # several parts in one call

  accuracy  one epoch of the main job: DP, DDP over Gloo and over NCCL, one device; accuracies
            within 0.5 points of each other
  overlap   DP on 2 and 4 logical devices and NCCL DDP on 2: ResNet-18 traces (reduce and
            all-reduce started during backward, tools/trace_overlap.py) and DP's CNN samples/s
            at 1, 2, 4 devices
  report    replica-bench --report on 1, 2, 4 logical devices, DDP over Gloo and over NCCL, with
            PyTorch's rows beside replica's
  speed     replica against PyTorch per precision (tools/replica_vs_pytorch.py --with-train, the
            training set on the GPU and copied from the host a step ahead; --case
            MODEL:CxHxW:BATCH to pick cases)
  ops       ResNet-50 bf16 batch 256 op by op, each convolution's cuDNN time apart from its
            operand copies, beside PyTorch's torch.profiler table of the same step; ResNet-50
            batch 64 op by op (replica-bench --suite ops) in fp32, tf32 and bf16, NCHW and
            channels_last, cuDNN's legacy calls and its graph API: which layout and interface
            pay, and where each step's time goes; the CNN at batch 32 and 256 and the seed
            recipe's ResNet-101 (1x28x28, 256) in fp32 and tf32
  graphs    one GPU's step issued kernel by kernel and replayed as a CUDA Graph (--cuda-graphs):
            the CNN at batch 32 and 256, ResNet-50 at 64, fp32 and tf32
  tests     the test suites: the gpu-labelled ones one at a time (a GPU suite that skips on a GPU
            fails the check; a case inside one that returns early, e.g. no TF32, does not), then
            the other unit suites in parallel

The speed parts (ops, speed, graphs) are in tools/gpu_speed_checks.py.

--budget SECONDS bounds the whole call (a short lease of a GPU machine): a program still running
when it ends is cut, and it and those that would start later are listed as not run; the exit
code is then 3 unless a check failed (1). Give the parts in the order they matter.

On a GPU, nvidia-smi samples the clocks, power, temperature and clock-event (throttle) reasons
once a second into OUT/gpu-clocks.csv (tools/gpu_clocks.py), and each part's summary ends with
what the GPU did while that part ran: a slow window beside a power-capped GPU is the GPU's.
--rounds N has speed alternate replica and PyTorch N times per case (replica_vs_pytorch.py).

--device cuda:0 (default) runs on GPU 0 and its logical devices (cuda:0*2, cuda:0*4); --device
cpu runs the same commands on virtual CPU devices, the parts that need a GPU (NCCL, PyTorch
rows) skipped with the reason: a rehearsal of the script on a machine without one. --quick
shortens every run (a few hundred steps instead of an epoch). Programs come from --bin (default
$B, else build/bin).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

from gpu_clocks import ClockLog
from gpu_speed_checks import graphs, ops, speed
from replica_vs_pytorch import CASE

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def kill_tree(pid):
    """SIGKILLs pid and every process descended from it (found through /proc). They stay in
    this script's process group, so whatever stops this script stops them too."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


class Part:
    def __init__(self, args, name):
        self.args, self.name = args, name
        self.dir = os.path.join(args.out, name)
        os.makedirs(self.dir, exist_ok=True)
        self.lines, self.failed, self.skipped = [], [], []
        self.gpu = args.device.startswith("cuda")

    def devices(self, n):
        return self.args.device if n == 1 else f"{self.args.device}*{n}"

    def run(self, label, argv, timeout=600, env=None):
        """Runs argv, its output straight into DIR/label.log (kept if this script is killed);
        returns (exit code, output). At the timeout, or where --budget ends first, the program
        and its descendants are killed: its ranks or PyTorch workers must not hold the GPU
        afterwards. A program the budget cut, or one it left no time to start (exit code None),
        is listed as not run, not as a failure: it checked nothing."""
        t0 = time.time()
        cut_by_budget = False
        if self.args.deadline is not None:
            left = int(self.args.deadline - t0)
            if left < 10:
                return self.not_run(label, "--budget spent"), ""
            cut_by_budget = left < timeout
            timeout = min(timeout, left)
        log = os.path.join(self.dir, label + ".log")
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=self.dir,
                                 env=dict(os.environ, **env) if env else None)
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()
                code = 124
                f.write(f"\n(timed out after {timeout} s)\n")
        with open(log, errors="replace") as f:
            f.readline()  # the command line
            out = f.read()
        if code == 124 and cut_by_budget:
            return self.not_run(label, f"cut by --budget after {timeout} s"), out
        print(f"  {label}: exit {code} in {time.time() - t0:.0f} s", flush=True)
        if code != 0:
            self.fail(f"{label} exited {code}: {last_line(out)}")
        return code, out

    def not_run(self, label, why):
        self.note(f"- {label}: not run, {why}")
        self.skipped.append(label)
        print(f"  {label}: not run, {why}", flush=True)
        return None

    def bin(self, program):
        return os.path.join(self.args.bin, program)

    def note(self, line):
        self.lines.append(line)

    def fail(self, why):
        self.failed.append(why)

    def finish(self):
        text = f"# {self.name} ({self.args.device}{', quick' if self.args.quick else ''})\n\n"
        text += "\n".join(self.lines) + "\n"
        if self.failed:
            text += "\nFAILED:\n" + "\n".join("- " + f for f in self.failed) + "\n"
        elif self.skipped:
            text += f"\nthe checks that ran passed; {len(self.skipped)} not run (--budget)\n"
        else:
            text += "\nall checks passed\n"
        with open(os.path.join(self.dir, "summary.md"), "w") as f:
            f.write(text)
        print(text)
        return 1 if self.failed else 0


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else "(no output)"


def metrics(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def test_accuracy(m):
    for e in reversed((m or {}).get("epoch_summaries", [])):
        if e.get("test_accuracy") is not None:
            return e["test_accuracy"]
    return None


CTEST_LINE = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) \.*\s*(?:\*+)?(\w+).*?([\d.]+) sec")


def tests(p):
    build = os.path.dirname(p.args.bin)
    if not os.path.exists(os.path.join(build, "CTestTestfile.cmake")):
        p.fail(f"no ctest tree in {build} (--bin names the build's bin/ folder)")
        return
    listing = subprocess.run(["ctest", "--test-dir", build, "-N", "-L", "gpu"],
                             capture_output=True, text=True).stdout
    # The GPU suites one at a time, each under its own limit (a hung one costs 300 s, not the
    # rest): they share the GPU, and NCCL's timeouts are part of what they check. Then the
    # others in parallel, without the GPU suites a second time.
    runs = [("gpu-" + name, ["-R", f"^{name}$"], 300)
            for name in re.findall(r"Test\s+#\d+: (\S+)", listing)]
    jobs = str(max(2, (os.cpu_count() or 2) // 2))
    runs.append(("unit-suites", ["-L", "unit", "-LE", "gpu", "-j", jobs], 900))
    p.note("| suite | result | seconds |\n|---|---|---:|")
    for label, select, limit in runs:
        code, out = p.run(label, ["ctest", "--test-dir", build, "--output-on-failure"] + select,
                          timeout=limit)
        for line in out.splitlines():
            m = CTEST_LINE.match(line)
            if not m:
                continue
            name, result, seconds = m.groups()
            p.note(f"| {name} | {result} | {float(seconds):.1f} |")
            if label.startswith("gpu-") and p.gpu and result == "Skipped":
                p.fail(f"{name} skipped on {p.args.device}: a GPU check that did not run")


def accuracy(p):
    length = ["--max-steps", "300"] if p.args.quick else ["--epochs", "1"]
    runs = [("single", ["--mode", "single", "--devices", p.devices(1)]),
            ("dp", ["--mode", "dp", "--devices", p.devices(2)]),
            ("ddp-gloo", ["--mode", "ddp", "--devices", p.devices(2), "--backend", "gloo"])]
    if p.gpu:
        runs.append(("ddp-nccl", ["--mode", "ddp", "--devices", p.devices(2), "--backend", "nccl"]))
    else:
        p.note("- ddp-nccl: not run (NCCL needs a GPU)")
    p.note("| run | test accuracy | samples/s | collectives |\n|---|---:|---:|---|")
    acc = {}
    for name, flags in runs:
        out_json = os.path.join(p.dir, name + ".json")
        p.run(name, [p.bin("replica-train"), "--seed", "0", "--metrics-json", out_json]
              + length + flags)
        m = metrics(out_json)
        acc[name] = test_accuracy(m)
        shown = f"{acc[name]:.4f}" if acc[name] is not None else "-"
        p.note(f"| {name} | {shown} | {(m or {}).get('samples_per_sec', 0):.0f} | "
               f"{(m or {}).get('collectives') or '-'} |")
    ref = acc.get("ddp-nccl") if p.gpu else acc.get("ddp-gloo")
    for other in ("dp", "ddp-gloo"):
        if ref is None or acc.get(other) is None:
            p.fail(f"no test accuracy to compare ({other})")
        elif abs(ref - acc[other]) > 0.005:
            p.fail(f"test accuracy {ref:.4f} vs {other}'s {acc[other]:.4f}: more than 0.5 points")


def overlap(p):
    steps = "60" if p.args.quick else "200"
    cases = [("dp-2", ["--mode", "dp", "--devices", p.devices(2)]),
             ("dp-4", ["--mode", "dp", "--devices", p.devices(4)])]
    if p.gpu:
        cases.append(("ddp-nccl-2", ["--mode", "ddp", "--devices", p.devices(2),
                                     "--backend", "nccl"]))
    else:
        cases.append(("ddp-gloo-2", ["--mode", "ddp", "--devices", p.devices(2)]))
    # ResNet-18, not the CNN: the CNN's 0.11M parameters fill one bucket, which can only start
    # once backward is over; ResNet-18's 11M fill three (1 MB first, then 25 MB), so a bucket
    # launched while backward still runs shows in the trace.
    for name, flags in cases:
        trace = os.path.join(p.dir, name + ".json")
        p.run(name, [p.bin("replica-train"), "--model", "resnet18", "--batch-per-device", "64",
                     "--max-steps", steps, "--no-eval", "--trace", trace] + flags)
        code, out = p.run(name + "-overlap", [sys.executable,
                                              os.path.join(HERE, "trace_overlap.py"), trace,
                                              "--require-overlap"])
        p.note(f"{name}:\n```text\n{out.strip()}\n```")
    bench_json = os.path.join(p.dir, "dp-bench.jsonl")
    p.run("dp-bench", [p.bin("replica-bench"), "--suite", "dp", "--devices", p.devices(4),
                       "--device-counts", "1,2,4", "--batch-per-device", "64",
                       "--json", bench_json] + (["--repeat", "1"] if p.args.quick else []))
    rows = []
    if os.path.exists(bench_json):
        with open(bench_json) as f:
            rows = [json.loads(l) for l in f if l.strip()]
    p.note("\nDP, CNN, 64 per device: " + ", ".join(
        f"{r.get('devices')} devices {r.get('samples_per_sec', 0):.0f} samples/s" for r in rows))


def report(p):
    backends = ["gloo", "nccl"] if p.gpu else ["gloo"]
    compare = []
    if p.gpu:
        pt = os.path.join(p.dir, "pytorch.jsonl")
        code, _ = p.run("pytorch", [sys.executable, os.path.join(HERE, "pytorch_bench.py"),
                                    "--devices", p.devices(4), "--out", pt])
        if code == 0:
            compare = ["--compare", pt]
    else:
        p.note("- PyTorch rows: not run (they are measured on the GPU machine)")
    for backend in backends:
        out_dir = os.path.join(p.dir, "report-" + backend)
        quick = ["--device-counts", "1,2", "--repeat", "1"] if p.args.quick else []
        p.run("report-" + backend, [p.bin("replica-bench"), "--report", out_dir, "--devices",
                                    p.devices(4), "--backend", backend] + compare + quick,
              timeout=900)
        written = os.path.exists(os.path.join(out_dir, "report.md"))
        p.note(f"- report-{backend}: {'written' if written else 'missing'} "
               f"({os.path.relpath(out_dir, p.args.out)}/report.md)")


PARTS = {"tests": tests, "accuracy": accuracy, "overlap": overlap, "report": report, "ops": ops,
         "speed": speed, "graphs": graphs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+", choices=sorted(PARTS), metavar="PART",
                    help="one or more of: " + ", ".join(PARTS))
    ap.add_argument("--out", required=True, help="directory for logs, traces and summaries")
    ap.add_argument("--device", default="cuda:0", help="cuda:0 (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--case", action="append", default=[],
                    help="speed: MODEL:CxHxW:BATCH instead of replica_vs_pytorch.py's defaults "
                         "(repeatable)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="speed: replica replays its step as a CUDA Graph (PyTorch eager)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="speed: runs of each engine per case, alternated (replica_vs_pytorch.py)")
    ap.add_argument("--bin", default=os.environ.get("B") or os.path.join(REPO, "build", "bin"))
    ap.add_argument("--budget", type=int, metavar="SECONDS",
                    help="the whole call's time: each program's limit is cut to what is left, "
                         "and what would start later is listed as not run (a short lease of a "
                         "GPU machine: give the parts in the order they matter)")
    args = ap.parse_args()
    for case in args.case:  # before any part runs: a typo must not cost a GPU machine's time
        if not CASE.fullmatch(case):
            sys.exit(f"gpu_checks.py: error: --case '{case}': expected MODEL:CxHxW:BATCH, "
                     "e.g. resnet50:3x224x224:64")
    if args.budget is not None and args.budget < 60:
        sys.exit("gpu_checks.py: error: --budget must be at least 60 seconds")
    args.deadline = time.time() + args.budget if args.budget is not None else None
    if not os.path.exists(os.path.join(args.bin, "replica-train")):
        sys.exit(f"gpu_checks.py: error: no replica-train in {args.bin} (build first, or --bin)")
    args.out = os.path.abspath(args.out)
    args.bin = os.path.abspath(args.bin)
    if args.rounds < 1:
        sys.exit("gpu_checks.py: error: --rounds must be at least 1")
    failed, skipped = 0, []
    os.makedirs(args.out, exist_ok=True)
    # On a GPU the clocks are sampled through every part: its summary says whether the GPU
    # slowed down (power, heat) while it measured.
    clocks = ClockLog(args.device, os.path.join(args.out, "gpu-clocks.csv")) \
        if args.device.startswith("cuda") else None
    try:
        for name in args.parts:
            part = Part(args, name)
            print(f"gpu_checks.py {name}: {args.device}, logs in {part.dir}", flush=True)
            t0 = time.time()
            PARTS[name](part)
            if clocks:
                part.note("\n" + clocks.summary(t0, time.time()))
            failed |= part.finish()
            skipped += [f"{name}/{label}" for label in part.skipped]
    finally:
        if clocks:
            clocks.stop()
    if skipped:
        print(f"not run (--budget {args.budget} s spent): " + ", ".join(skipped))
        if not failed:
            sys.exit(3)  # nothing failed, but not everything was checked
    sys.exit(failed)


if __name__ == "__main__":
    main()
