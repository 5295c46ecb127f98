"""The speed parts of tools/gpu_checks.py (its docstring says how they are called): ops (each
op's time in a step, per precision, layout and cuDNN interface, beside PyTorch's profile), speed
(replica against PyTorch, tools/replica_vs_pytorch.py) and graphs (a step issued kernel by kernel
against the same step replayed as a CUDA Graph). Each takes the Part of gpu_checks.py that runs
its programs and collects its summary."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))



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
# Where a run names environment variables, it times a switch in the same call:
# REPLICA_PAD_CHANNELS=1 the stem's channels padded to 8 (engine/cuda/conv_padded.cu; off by
# default until its training step's loss agrees with NCHW's), REPLICA_CUDA_SLICED_SUMS=1
# BatchNorm's one-block passes off (engine/cuda/norm_block.cu).
OPS_GPU_CASES = [("resnet50", "3x224x224", 256,
                  [("bf16", "channels_last"),
                   ("bf16", "channels_last", {"REPLICA_PAD_CHANNELS": "1"})]),
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
