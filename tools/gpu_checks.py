#!/usr/bin/env python3
"""The checks that need a GPU, in a few calls: time on a GPU machine that one has only for a short
while (a shared node, a short allocation) goes to measuring, not typing. Each part runs its programs, checks what it can
(exit 1 when a check fails), writes its logs, traces and JSON under OUT/PART/ and ends with a
short summary (OUT/PART/summary.md):

    python3 tools/gpu_checks.py accuracy --out OUT   # one epoch of the main job: DP, DDP over Gloo
                                                     # and over NCCL, one device; accuracies within
                                                     # 0.5 points of each other
    python3 tools/gpu_checks.py overlap --out OUT    # DP on 2 and 4 logical devices and NCCL DDP on
                                                     # 2: ResNet-18 traces (reduce/all-reduce
                                                     # started during backward,
                                                     # tools/trace_overlap.py) and DP's CNN
                                                     # samples/s at 1, 2, 4 devices
    python3 tools/gpu_checks.py report --out OUT     # replica-bench --report on 1, 2, 4 logical
                                                     # devices, DDP over Gloo and over NCCL, with
                                                     # PyTorch's rows beside replica's
    python3 tools/gpu_checks.py speed --out OUT      # replica against PyTorch per precision
                                                     # (tools/replica_vs_pytorch.py --with-train,
                                                     # the training set on the GPU and copied
                                                     # from the host a step ahead;
                                                     # --case MODEL:CxHxW:BATCH to pick cases)
    python3 tools/gpu_checks.py ops --out OUT        # ResNet-50 bf16 batch 256 op by op, each
                                                     # convolution's cuDNN time apart from its
                                                     # operand copies, beside PyTorch's
                                                     # torch.profiler table of the same step;
                                                     # ResNet-50 batch 64, op by op (replica-bench
                                                     # --suite ops) in fp32, tf32 and bf16, NCHW
                                                     # and channels_last, cuDNN's legacy calls
                                                     # and its graph API: which layout and which
                                                     # interface pay, and where each step's time
                                                     # goes; the CNN at batch 32 and 256 and
                                                     # the seed recipe's ResNet-101 (1x28x28,
                                                     # 256) in fp32 and tf32
    python3 tools/gpu_checks.py graphs --out OUT     # one GPU's step issued kernel by kernel
                                                     # and replayed as a CUDA Graph
                                                     # (--cuda-graphs): the CNN at batch 32 and
                                                     # 256, ResNet-50 at 64, fp32 and tf32
    python3 tools/gpu_checks.py tests --out OUT      # the test suites: the gpu-labelled ones one
                                                     # at a time (a GPU suite that skips on a GPU
                                                     # fails the check; a case inside one that
                                                     # returns early, e.g. no TF32, does not),
                                                     # then the other unit suites in parallel
    python3 tools/gpu_checks.py accuracy overlap --out OUT   # several parts in one call

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
        code, out = p.run(name + "-overlap", [sys.executable, os.path.join(HERE, "trace_overlap.py"),
                                              trace, "--require-overlap"])
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
        p.note(f"- report-{backend}: {'written' if os.path.exists(os.path.join(out_dir, 'report.md')) else 'missing'} "
               f"({os.path.relpath(out_dir, p.args.out)}/report.md)")


# (precision, memory format[, cuDNN interface or environment]) runs the ops part measures on a
# GPU; CPU devices run fp32 NCHW only. The interface is REPLICA_CUDNN_API's word (auto when
# absent: the graph API, the legacy calls for a shape it has no engine for): fp32, tf32 NCHW and
# bf16 both ways, tf32 channels_last on the graph API only (to keep the part short). A dict sets
# those variables for the run instead (the run's name ends with their values).
OPS_RUNS = [("fp32", "nchw", "legacy"), ("fp32", "nchw"), ("tf32", "nchw", "legacy"),
            ("tf32", "nchw"), ("tf32", "channels_last", "graph"),
            ("bf16", "nchw", "legacy"), ("bf16", "nchw"), ("bf16", "channels_last", "legacy"),
            ("bf16", "channels_last")]
# (model, input, batch, runs): ResNet-50 in every precision and layout; the CNN, whose step is
# about a millisecond, at the main job's batch and at the largest the speed cases time: where the
# sum of its ops falls short of an ordinary step, launches and host work take the rest (what
# CUDA Graphs would remove). On CPU devices a rehearsal on a model small enough to finish.
# First: ResNet-50 bf16 at batch 256, 0.49x PyTorch on an H200 (2026-11-27) with its
# convolutions 74% of the step; their parts say how much of that is the NHWC/bf16 copies that
# stage each convolution's operands, and how much cuDNN.
# Where a run names environment variables, it times a switch that turns one change off, in the
# same call: REPLICA_PAD_CHANNELS=0 the stem's channels padded to 8 (engine/cuda/conv_padded.cu),
# REPLICA_CUDA_SLICED_SUMS=1 BatchNorm's one-block passes (engine/cuda/norm_block.cu).
OPS_GPU_CASES = [("resnet50", "3x224x224", 256,
                  [("bf16", "channels_last"),
                   ("bf16", "channels_last", {"REPLICA_PAD_CHANNELS": "0"})]),
                 ("resnet50", "3x224x224", 64, OPS_RUNS),
                 ("cnn", "1x28x28", 32, [("fp32", "nchw"), ("tf32", "nchw")]),
                 ("cnn", "1x28x28", 256, [("fp32", "nchw"), ("tf32", "nchw")]),
                 # the seed recipe's model: 0.94x PyTorch on 2026-11-25, 0.75x on 2026-11-27.
                 # Its fp32 step was 17 ms longer than its tf32 one (PyTorch's: 3 ms): fp32 on
                 # the legacy calls too (their heuristics' picks took twice the graph API's
                 # time on an H200, 2026-11-27, which made the graph API the default), with the
                 # residual sum in an add of its own, as before 357c5a4 moved it into the
                 # convolution (cuDNN's beta 1) between the two measurements, without the
                 # one-block BatchNorm passes its 2x2 and 4x4 stages take, and on channels_last.
                 ("resnet101", "1x28x28", 256,
                  [("fp32", "nchw", "legacy"), ("fp32", "nchw"),
                   ("fp32", "nchw", {"REPLICA_RESIDUAL_SUM": "add"}),
                   ("fp32", "nchw", {"REPLICA_CUDA_SLICED_SUMS": "1"}),
                   ("fp32", "channels_last"), ("tf32", "nchw")])]
OPS_CPU_CASES = [("resnet18", "3x32x32", 64, [("fp32", "nchw"), ("bf16", "nchw")])]


MEMORY_BOUND_OPS = ("batchnorm", "relu", "add", "maxpool", "adaptive_avgpool", "scale", "fill",
                    "copy", "gather_rows", "mul", "dropout", "sgd", "adam")


def ops_case(p, model, shape, batch, runs):
    steps = "3" if p.args.quick else "10"
    by_run = {}
    for precision, layout, *api in runs:
        env = api[0] if api and isinstance(api[0], dict) else (
            {"REPLICA_CUDNN_API": api[0]} if api else None)
        # Named by what the run sets: -legacy for the cuDNN API, -name=value for a switch.
        name = f"{model}-b{batch}-{precision}-{layout}" + "".join(
            f"-{v}" if k == "REPLICA_CUDNN_API" else f"-{k.removeprefix('REPLICA_').lower()}={v}"
            for k, v in (env or {}).items())
        out_json = os.path.join(p.dir, name + ".jsonl")
        if os.path.exists(out_json):
            os.remove(out_json)  # --json appends
        p.run(name, [p.bin("replica-bench"), "--suite", "ops", "--devices", p.args.device,
                     "--model", model, "--input-shape", shape, "--batch-per-device", str(batch),
                     "--steps", steps, "--precision", precision, "--memory-format", layout,
                     "--json", out_json], env=env)
        if os.path.exists(out_json):
            with open(out_json) as f:
                by_run[name.split(f"-b{batch}-", 1)[1]] = [json.loads(l) for l in f if l.strip()]
    if not by_run:
        return
    names = list(by_run)
    step = {n: (rows[0].get("step_ms") if rows else None) for n, rows in by_run.items()}
    op_ms = {n: {r["op"]: r["ms_per_step"] for r in rows} for n, rows in by_run.items()}
    top = sorted({op for m in op_ms.values() for op in m},
                 key=lambda op: -max(m.get(op, 0) for m in op_ms.values()))[:12]
    p.note(f"\n{model} {shape}, batch {batch}, ms per step (ops timed one by one; the step line "
           f"is an ordinary step, the sum line the ops' times added up):\n")
    p.note("| op | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    p.note("| **step** | " + " | ".join(f"{step[n]:.2f}" if step[n] else "-" for n in names)
           + " |")
    p.note("| sum of ops | " + " | ".join(f"{sum(op_ms[n].values()):.2f}" for n in names) + " |")
    for op in top:
        p.note(f"| {op} | " + " | ".join(
            f"{op_ms[n][op]:.2f}" if op in op_ms[n] else "-" for n in names) + " |")
    # Inside each op, the parts it timed (a convolution's cuDNN calls and operand copies).
    parts = {n: {(r["op"], part): ms for r in rows
                 for part, ms in (r.get("parts_ms_per_step") or {}).items()}
             for n, rows in by_run.items()}
    keys = sorted({k for m in parts.values() for k in m}, key=lambda k: (k[0], k[1]))
    if keys:
        p.note("\nParts of ops, ms per step (inside the op's own time):\n")
        p.note("| op: part | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
        for op, part in keys:
            p.note(f"| {op}: {part} | " + " | ".join(
                f"{parts[n][(op, part)]:.2f}" if (op, part) in parts[n] else "-"
                for n in names) + " |")
    # The ops bound by memory: their tensors' bytes over their time, against the bandwidth.
    gbs = {n: {r["op"]: r.get("tensor_gb_per_s") for r in rows} for n, rows in by_run.items()}
    bound = [op for op in top if op.startswith(MEMORY_BOUND_OPS)]
    if bound:
        p.note("\nGB/s of the memory-bound ops (tensor bytes, each once, over the op's time: a "
               "floor on what it moved; hold against the device's bandwidth):\n")
        p.note("| op | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
        for op in bound:
            p.note(f"| {op} | " + " | ".join(
                f"{gbs[n][op]:.0f}" if gbs[n].get(op) is not None else "-" for n in names) + " |")


def ops(p):
    for case in (OPS_GPU_CASES if p.gpu else OPS_CPU_CASES):
        ops_case(p, *case)
    if not p.gpu:
        p.note("\n- not run: PyTorch's op profile (on the GPU machine)")
        return
    # PyTorch's own op profile of the first case, to set its convolutions' time beside replica's.
    model, shape, batch, runs = OPS_GPU_CASES[0]
    precision, layout = runs[0][:2]
    table = os.path.join(p.dir, f"pytorch-{model}-b{batch}-{precision}-{layout}.txt")
    p.run("pytorch-profile", [sys.executable, os.path.join(HERE, "pytorch_bench.py"), "--mode",
                              "dp", "--device-counts", "1", "--devices", p.args.device,
                              "--model", model, "--input-shape", shape, "--batch-per-device",
                              str(batch), "--precision", precision, "--memory-format", layout,
                              "--steps", "10", "--repeat", "1", "--profile-ops", table,
                              "--out", os.path.join(p.dir, "pytorch-profile-rows.jsonl")])
    if os.path.exists(table):
        with open(table) as f:
            p.note(f"\nPyTorch, {model} {shape}, batch {batch}, {precision}, {layout} "
                   "(torch.profiler, self device time):\n\n```\n" + "".join(f.readlines()[:26])
                   + "```")


def speed(p):
    if not p.gpu:
        p.note("- not run: replica against PyTorch is measured on the GPU machine")
        return
    out_dir = os.path.join(p.dir, "vs-pytorch")
    code, out = p.run("vs-pytorch", [sys.executable, os.path.join(HERE, "replica_vs_pytorch.py"),
                                     "--out", out_dir, "--with-train",
                                     "--train-placements", "auto,host", "--bin", p.args.bin]
                      + (["--cuda-graphs"] if p.args.cuda_graphs else [])
                      + ["--rounds", str(p.args.rounds)]
                      + [a for c in p.args.case for a in ("--case", c)],
                      timeout=3000)
    table = os.path.join(out_dir, "table.md")
    if os.path.exists(table):
        with open(table) as f:
            p.note(f.read())


# (model, input, batch): the launch-bound CNN at the main job's batch and at 256, and ResNet-50,
# whose step is long enough that CUDA Graphs should change little.
# The seed recipe's ResNet-101 at 1x28x28: some 1,500 small kernels a step, where launches may
# be what bounds it.
GRAPH_CASES = [("cnn", "1x28x28", 32), ("cnn", "1x28x28", 256), ("resnet50", "3x224x224", 64),
               ("resnet101", "1x28x28", 256)]


def graphs(p):
    if not p.gpu:
        p.note("- not run: CUDA Graphs need a GPU (test_step_graph checks captured steps on CPU)")
        return
    p.note("replica-bench --suite dp --device-counts 1, each step issued kernel by kernel and "
           "replayed as a CUDA Graph (--cuda-graphs), alternated in one call:\n")
    p.note("| model | input | batch | precision | eager samples/s | graph samples/s | graph / "
           "eager |\n|---|---|---:|---|---:|---:|---:|")
    for model, shape, batch in GRAPH_CASES:
        for precision in ("fp32", "tf32"):
            sps = {}
            for mode in ("eager", "graph", "eager-again", "graph-again"):
                name = f"{model}-b{batch}-{precision}-{mode}"
                out_json = os.path.join(p.dir, name + ".jsonl")
                if os.path.exists(out_json):
                    os.remove(out_json)  # --json appends
                p.run(name, [p.bin("replica-bench"), "--suite", "dp", "--devices",
                             p.args.device, "--device-counts", "1", "--model", model,
                             "--input-shape", shape, "--batch", str(batch), "--precision",
                             precision, "--json", out_json]
                      + (["--cuda-graphs"] if mode.startswith("graph") else []))
                if os.path.exists(out_json):
                    with open(out_json) as f:
                        rows = [json.loads(l) for l in f if l.strip()]
                    if rows:
                        sps.setdefault(mode.split("-")[0], []).append(rows[-1]["samples_per_sec"])
            if len(sps.get("eager", [])) and len(sps.get("graph", [])):
                e, g = max(sps["eager"]), max(sps["graph"])
                p.note(f"| {model} | {shape} | {batch} | {precision} | {e:,.0f} | {g:,.0f} | "
                       f"{g / e:.2f}x |")


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
