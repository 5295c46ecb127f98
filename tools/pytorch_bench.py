#!/usr/bin/env python3
"""PyTorch's DataParallel and DistributedDataParallel on the same model, batch and synthetic data
as `replica-bench --suite dp,ddp`, writing JSON lines with replica-bench's field names (and
"engine": "pytorch"), for `replica-bench --report DIR --compare FILE`.

    python3 tools/pytorch_bench.py --out pytorch.jsonl                   # CNN, all GPUs (else CPU)
    python3 tools/pytorch_bench.py --devices cuda:0*4 --out pytorch.jsonl
                                                          # 4 ranks on GPU 0 (DDP, gloo)
    python3 tools/pytorch_bench.py --model resnet50 --batch-per-device 32 --devices cuda \
        --out p.jsonl

Models as replica defines them: the CNN (conv 1->20 k5, ReLU, conv 20->20 k5, ReLU, maxpool 2,
flatten, fc 2000->50, ReLU, fc 50->10) and torchvision's ResNets with 10 classes (a C-channel
conv1 when the input has C != 3 channels). Adam (lr 1e-3), cross-entropy, weak scaling: every
device trains --batch-per-device samples per step. Warm-up steps, then --repeat windows of
--steps steps (median), then a short window whose forward/backward/step are timed separately
(synchronised: phase_ms).

DataParallel needs distinct GPUs, so DP rows exist for one device (the plain module) and for
distinct GPUs; DDP runs one process per device (torch.multiprocessing), NCCL with a GPU per rank,
Gloo on CPU or when ranks share a GPU (cuda:0*N, labelled devices_share_gpu).

--precision, for like-with-like rows beside replica's (`replica-bench --precision`):
    fp32  TF32 off for matmuls and cuDNN (torch.backends.{cuda.matmul,cudnn}.allow_tf32 = False)
    tf32  TF32 on for both
    bf16  torch.autocast(bfloat16) around forward and loss, model and inputs channels_last
          (unless --memory-format nchw)
    auto  (default) tf32 when every GPU has TF32 tensor cores (compute capability 8.0+), else fp32
--cudnn-benchmark sets torch.backends.cudnn.benchmark (cuDNN times its algorithms per shape).
--profile-ops FILE (one device, DP mode): after the timed windows, 10 more steps under
torch.profiler, written to FILE as a table of ops with their self device time per step (the
kernels each op launched) and to FILE.jsonl, to hold beside `replica-bench --suite ops` on the
same model, batch and precision.
--memory-format nchw keeps bf16 in NCHW (auto: channels_last for bf16 images on GPUs, as
PyTorch's recipes do; channels_last forces it in every precision). Rows say which.
replica-bench takes the same flag with the same default, for its convolutions' operands.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

from pytorch_workload import (apply_precision, batches, channels_last, fail, make_model, nn,
                              parse_counts, parse_devices, parse_shape, prepare_model,
                              resolve_precision, torch, torch_device)

# Past the import above PyTorch is here (else it said so and stopped).
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_op_profile(step, first, device, args, path):
    """Runs 10 steps from step index `first` under torch.profiler; writes each op's calls and
    self device (kernel) and CPU milliseconds per step to path (a table, busiest first) and
    path.jsonl. Self time: an op's own kernels, not its children's."""
    from torch.profiler import ProfilerActivity, profile
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    n = min(args.steps, 10)
    with profile(activities=activities) as prof:
        for k in range(n):
            step(first + k)
        sync(device)

    def self_device_us(e):  # renamed from the CUDA-only name in PyTorch 2.4
        v = getattr(e, "self_device_time_total", None)
        return v if v is not None else getattr(e, "self_cuda_time_total", 0)

    rows = [{"op": e.key, "calls_per_step": e.count / n,
             "self_device_ms_per_step": self_device_us(e) / 1e3 / n,
             "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / n}
            for e in prof.key_averages()]
    by = "self_device_ms_per_step" if gpu else "self_cpu_ms_per_step"
    rows.sort(key=lambda r: -r[by])
    total = sum(r[by] for r in rows)
    with open(path, "w") as f:
        f.write("PyTorch %s: %s %s, batch %d, %s, %s, %d steps under torch.profiler\n"
                % (torch.__version__, args.model, "x".join(map(str, args.shape)),
                   args.batch_per_device, args.precision,
                   "channels_last" if channels_last(args) else "nchw", n))
        f.write("%-52s %10s %14s %7s %12s\n" % ("op", "calls/step", "self dev ms/step", "share",
                                                "cpu ms/step"))
        for r in rows[:40]:
            f.write("%-52s %10.1f %14.3f %6.1f%% %12.3f\n"
                    % (r["op"][:52], r["calls_per_step"], r["self_device_ms_per_step"],
                       100 * r[by] / total if total else 0, r["self_cpu_ms_per_step"]))
        f.write("%s time %.3f ms per step, all ops\n" % ("device" if gpu else "cpu", total))
    with open(path + ".jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("pytorch_bench: op profile of %d steps written to %s" % (n, path))


def measure(model, data, device, args, out_device=None, profile_to=None):
    """Warm-up, timed windows (seconds each), then a phase window -> (windows, phase_ms, loss,
    kept): kept is what a training forward left allocated on `device` for its backward (the
    bytes in use after forward and loss less those before, the largest of the phase window's
    steps; replica's forward_kept_bytes), None on a CPU, which has no allocator to ask."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    out_device = out_device or device

    def forward_loss(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            return loss_fn(model(x), y.to(out_device))

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=False)
        loss = forward_loss(x, y)
        loss.backward()
        opt.step()
        return loss

    i = 0
    for _ in range(args.warmup):
        step(i)
        i += 1
    sync(device)
    windows = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step(i)
            i += 1
        sync(device)
        windows.append(time.perf_counter() - t0)
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    kept = None
    n = min(args.steps, 10)
    for _ in range(n):
        x, y = data[i % len(data)]
        i += 1
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        loss = forward_loss(x, y)
        sync(device)
        t1 = time.perf_counter()
        if before is not None:
            kept = max(kept or 0, int(torch.cuda.memory_allocated(device)) - int(before))
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        sync(device)
        t3 = time.perf_counter()
        phases["forward"] += (t1 - t0) * 1e3 / n
        phases["backward"] += (t2 - t1) * 1e3 / n
        phases["step"] += (t3 - t2) * 1e3 / n
    if profile_to:
        write_op_profile(step, i, device, args, profile_to)
    return windows, phases, float(loss.item()), kept


def peak_memory(device):
    """(bytes in use, bytes held) at their peaks: on a GPU the caching allocator's
    max_memory_allocated and max_memory_reserved, as replica's peak_memory_bytes and
    peak_held_bytes; on a CPU the process's max RSS, and nothing held to compare."""
    if device.type == "cuda":
        return (int(torch.cuda.max_memory_allocated(device)),
                int(torch.cuda.max_memory_reserved(device)))
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, None


def environment(args):
    env = {"engine": "pytorch", "torch": torch.__version__, "cores": os.cpu_count(),
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        v = torch.cuda.nccl.version()  # a tuple in recent releases, an int (2181) in old ones
        env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        env["nccl"] = None
    return env


def row(args, mode, devs, shared, params, windows, phases, loss, peaks, kept, backend=None):
    """peaks: each device's peak_memory() pair; kept: what a forward kept on each device
    measured (DP: device 0 alone), None where nothing was measured."""
    n = len(devs)
    sps = [n * args.batch_per_device * args.steps / w for w in windows]
    med = statistics.median(sps)
    grad = 4 * params
    return {
        "engine": "pytorch", "mode": mode, "devices": n,
        "device_list": ["%s:%d" % d for d in devs], "devices_share_gpu": shared,
        "model": args.model, "input_shape": "x".join(map(str, args.shape)), "params": params,
        "batch_per_device": args.batch_per_device, "global_batch": n * args.batch_per_device,
        "threads_per_device": args.threads_per_device, "precision": args.precision,
        "memory_format": "channels_last" if channels_last(args) else "nchw",
        "cudnn_benchmark": args.cudnn_benchmark, "warmup_steps": args.warmup,
        "timed_steps": args.steps, "repeats": args.repeat,
        "data": "synthetic, preloaded on the device", "samples_per_sec": med,
        "samples_per_sec_runs": sps, "ms_per_step": 1e3 * n * args.batch_per_device / med,
        "speedup": None, "efficiency": None, "phase_ms": phases,
        "comm_bytes": (grad if n > 1 else 0) if mode == "ddp" else (n - 1) * grad,
        "busbw_gbps": None, "peak_memory_bytes": [p[0] for p in peaks],
        "peak_held_bytes": [p[1] for p in peaks] if peaks[0][1] is not None else None,
        "peak_memory_kind": ("cuda max_memory_allocated" if devs[0][0] == "cuda"
                             else "process max RSS"),
        "forward_kept_bytes": kept if kept and kept[0] is not None else None,
        "backend": backend, "final_loss": loss, "env": environment(args),
    }


def run_dp(args, devs, shared):
    if len(devs) > 1 and (devs[0][0] != "cuda" or shared):
        print("pytorch_bench: DataParallel needs distinct GPUs: no DP row for %d devices of %s"
              % (len(devs), args.devices), file=sys.stderr)
        return None
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads_per_device * len(devs) if devs[0][0] == "cpu" else 1)
    apply_precision(args)
    device = torch_device(devs[0])
    model = prepare_model(make_model(args.model, args.shape).to(device), args)
    params = sum(p.numel() for p in model.parameters())
    if len(devs) > 1:
        model = nn.DataParallel(model, device_ids=[d[1] for d in devs])
    if device.type == "cuda":
        for d in devs:
            torch.cuda.reset_peak_memory_stats(torch_device(d))
    data = batches(args, len(devs) * args.batch_per_device, args.seed, device)
    windows, phases, loss, kept = measure(model, data, device, args,
                                          profile_to=args.profile_ops if len(devs) == 1 else None)
    peaks = [peak_memory(torch_device(d)) for d in devs]
    return row(args, "dp", devs, shared, params, windows, phases, loss, peaks, [kept])


def ddp_rank(rank, args, devs, port, backend, out):
    torch.set_num_threads(args.threads_per_device)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=len(devs))
    device = torch_device(devs[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    apply_precision(args)
    model = prepare_model(make_model(args.model, args.shape).to(device), args)
    params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=25)
    data = batches(args, args.batch_per_device, args.seed + 7919 * (rank + 1), device)
    windows, phases, loss, kept = measure(ddp, data, device, args)
    result = {"windows": windows, "phases": phases, "loss": loss, "params": params,
              "peak": peak_memory(device), "kept": kept}
    with open("%s.rank%d.json" % (out, rank), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def ddp_backend(devs):
    """One backend for every device count of a run, chosen from the whole --devices set, so the
    rows' speed-ups never divide Gloo by NCCL: NCCL where each rank has a GPU of its own, Gloo
    where ranks share GPUs (NCCL refuses two ranks on one GPU) or run on CPUs."""
    own_gpu = devs[0][0] == "cuda" and len({d[1] for d in devs}) == len(devs)
    return "nccl" if own_gpu else "gloo"


def run_ddp(args, devs, shared, backend):
    n = len(devs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(ddp_rank, args=(args, devs, port, backend, out), nprocs=n, join=True)
        ranks = []
        for r in range(n):
            with open("%s.rank%d.json" % (out, r)) as f:
                ranks.append(json.load(f))
    windows = [max(rk["windows"][w] for rk in ranks) for w in range(args.repeat)]
    return row(args, "ddp", devs, shared, ranks[0]["params"], windows, ranks[0]["phases"],
               ranks[0]["loss"], [tuple(rk["peak"]) for rk in ranks], [rk["kept"] for rk in ranks],
               backend)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="dp,ddp", help="dp, ddp or dp,ddp")
    p.add_argument("--model", default="cnn", help="cnn | resnet18 | resnet50 | ... (torchvision)")
    p.add_argument("--input-shape", default="",
                   help="CxHxW (default 1x28x28 for cnn, 3x224x224 otherwise)")
    p.add_argument("--batch-per-device", type=int, default=64)
    p.add_argument("--devices", default="",
                   help="cpu*N, cuda, cuda:0,1, cuda:0*N (default: cuda if any, else cpu*cores)")
    p.add_argument("--device-counts", default="", help="comma list (default 1,2,4,...,N)")
    p.add_argument("--threads-per-device", type=int, default=0,
                   help="CPU threads per device (default cores / N)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto",
                   help="auto | fp32 | tf32 | bf16 (autocast; channels_last unless "
                        "--memory-format nchw)")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True")
    p.add_argument("--memory-format", default="auto", choices=["auto", "nchw", "channels_last"],
                   help="images' layout: auto (channels_last for bf16 on GPUs), nchw, "
                        "channels_last")
    p.add_argument("--profile-ops", default="",
                   help="FILE: one device's ops under torch.profiler, self device ms per step")
    p.add_argument("--out", required=True, help="JSON-lines file to write (replaced)")
    args = p.parse_args()
    if not args.devices:
        args.devices = "cuda" if torch.cuda.is_available() else "cpu*%d" % (os.cpu_count() or 1)
    devs, shared = parse_devices(args.devices)
    args.precision = resolve_precision(args, devs)
    args.shape = parse_shape(args.input_shape, args.model)
    counts = parse_counts(args.device_counts) if args.device_counts else \
        sorted({c for c in [1, 2, 4, 8, 16, 32, 64] if c < len(devs)} | {len(devs)})
    if max(counts) > len(devs) or min(counts) < 1:
        fail("--device-counts %s: --devices %s has %d devices"
             % (args.device_counts, args.devices, len(devs)))
    if args.batch_per_device < 1 or args.steps < 1 or args.repeat < 1 or args.warmup < 0:
        fail("--batch-per-device, --steps and --repeat must be >= 1, --warmup >= 0")
    if args.threads_per_device <= 0:
        on_cpu = devs[0][0] == "cpu"
        args.threads_per_device = max(1, (os.cpu_count() or 1) // max(counts)) if on_cpu else 1
    modes = args.mode.split(",")
    if any(m not in ("dp", "ddp") for m in modes):
        fail("--mode '%s': expected dp, ddp or dp,ddp" % args.mode)
    rows = []
    backend = ddp_backend(devs)
    for mode in modes:
        for n in counts:
            if mode == "dp":
                r = run_dp(args, devs[:n], shared and n > 1)
            else:
                r = run_ddp(args, devs[:n], shared and n > 1, backend)
            if r:
                print("pytorch %-3s %2d device(s): %.1f samples/s"
                      % (mode, n, r["samples_per_sec"]))
                rows.append(r)
    for r in rows:
        base = [b for b in rows if b["mode"] == r["mode"] and b["devices"] == 1]
        if base:
            r["speedup"] = r["samples_per_sec"] / base[0]["samples_per_sec"]
            r["efficiency"] = r["speedup"] / r["devices"]
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("wrote %d rows to %s" % (len(rows), args.out))


if __name__ == "__main__":
    main()
