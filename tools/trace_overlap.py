#!/usr/bin/env python3
"""Does gradient communication overlap backward? Reads a replica trace (replica-train --trace,
replica-bench --trace-dir; a DDP run's merged trace has one process per rank) and prints, per
process, how many reduce / all-reduce spans started while backward was still running and how
much of their time backward hid.

    python3 tools/trace_overlap.py dp.json
    python3 tools/trace_overlap.py ddp.json --require-overlap    # exit 1 if a process has none

Which spans: `backward` on any track of the process (DP: every device's worker); the
communication spans are `reduce` / `allreduce` on the track that times them on the device (a
GPU's "... stream" track, from CUDA events) where the process has one, else on `comm` (the
communication thread's host spans: CPU devices, Gloo). The wait for the last bucket on device
0's own track (`reduce` there) is not communication and is left out.

A span "started during backward" begins inside some backward span of its process; "hidden" is
the part of its duration that lies inside the union of the process's backward spans. The last
bucket holds the first layers' gradients, computed last: it starts in backward's final moments
at best and is hardly ever hidden, whatever the bucket size.
"""
import argparse
import collections
import json
import sys

COMM_NAMES = ("reduce", "allreduce")


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(start, end, merged):
    return sum(max(0, min(end, b) - max(start, a)) for a, b in merged)


def inside(t, merged):
    return any(a <= t < b for a, b in merged)


def analyse(events):
    tracks = {}
    processes = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tracks[(e["pid"], e["tid"])] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
    backward = collections.defaultdict(list)
    comm = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        if e.get("ph") != "X":
            continue
        span = (e["ts"], e["ts"] + e["dur"])
        track = tracks.get((e["pid"], e["tid"]), "")
        if e["name"] == "backward":
            backward[e["pid"]].append(span)
        elif e["name"] in COMM_NAMES and (track == "comm" or track.endswith("stream")):
            comm[e["pid"]][track].append(span)
    rows = []
    for pid in sorted(set(backward) | set(comm)):
        by_track = comm.get(pid, {})
        device_timed = [t for t in by_track if t.endswith("stream")]
        track = device_timed[0] if device_timed else ("comm" if "comm" in by_track else None)
        spans = by_track.get(track, []) if track else []
        merged = union(backward.get(pid, []))
        started = sum(1 for s, _ in spans if inside(s, merged))
        total = sum(e - s for s, e in spans)
        hidden = sum(covered(s, e, merged) for s, e in spans)
        rows.append({"process": processes.get(pid, str(pid)), "track": track or "-",
                     "spans": len(spans), "started": started, "comm_ms": total / 1000.0,
                     "hidden_ms": hidden / 1000.0, "backward_spans": len(backward.get(pid, []))})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace written by replica (--trace)")
    ap.add_argument("--require-overlap", action="store_true",
                    help="exit 1 unless every process has a communication span that started "
                         "during backward")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"trace_overlap.py: error: cannot read {args.trace} as a trace: {e}")
    rows = analyse(events)
    if not rows:
        sys.exit(f"trace_overlap.py: error: {args.trace} has no backward or communication spans")
    print(f"{'process':10} {'communication track':28} {'spans':>6} {'started in backward':>20} "
          f"{'comm ms':>9} {'hidden by backward':>19}")
    missing = []
    for r in rows:
        pct = 100.0 * r["started"] / r["spans"] if r["spans"] else 0.0
        hid = 100.0 * r["hidden_ms"] / r["comm_ms"] if r["comm_ms"] else 0.0
        started = f"{r['started']} ({pct:.1f}%)"
        hidden = f"{r['hidden_ms']:.2f} ({hid:.1f}%)"
        print(f"{r['process']:10} {r['track']:28} {r['spans']:6} {started:>20} "
              f"{r['comm_ms']:9.2f} {hidden:>19}")
        if r["started"] == 0:
            missing.append(r["process"])
    if args.require_overlap and missing:
        sys.exit(f"trace_overlap.py: no communication span started during backward in "
                 f"{', '.join(missing)}")


if __name__ == "__main__":
    main()
