#!/usr/bin/env python3
"""Plots of a replica-bench report directory (called by `replica-bench --report DIR`).

    python3 tools/bench_plot.py DIR

Reads DIR/results.jsonl (replica's rows), DIR/projection.json (the alpha-beta projection) and
DIR/compare.jsonl (other engines' rows, e.g. PyTorch) and writes, into DIR:
  throughput.png  samples/s against devices: DP, DDP, projections dashed, ideal scaling dotted
  efficiency.png  scaling efficiency against devices (projections dashed)
  phases.png      stacked time per step by phase (DP device 0, DDP rank 0)
  memory.png      peak memory per device: device 0 against the others
Prints "wrote NAME" for each file. Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("bench_plot: error: matplotlib is not installed (Debian: apt-get install python3-matplotlib)")

COLORS = {"dp": "tab:blue", "ddp": "tab:orange"}
NAMES = {"dp": "DP", "ddp": "DDP"}
PHASE_COLORS = {
    "scatter": "#c7e9c0", "prefetch": "#c7e9c0", "h2d": "#c7e9c0", "batch_gather": "#c7e9c0", "forward": "#6baed6", "gather_loss": "#fdae6b",
    "scatter_grad": "#fdd0a2", "backward": "#2171b5", "reduce": "#e6550d",
    "broadcast_buffers": "#fd8d3c", "finalize": "#e6550d", "step": "#756bb1", "other": "#bdbdbd",
}


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def group_label(row):
    return "%s %s, %d/device" % (row["model"], row.get("input_shape", "?"), row["batch_per_device"])


def shared_note(rows):
    if any(r.get("devices_share_gpu") for r in rows):
        return "\n(logical devices sharing one GPU: not a scaling measurement)"
    return ""


def series(rows, mode):
    pts = sorted((r["devices"], r) for r in rows if r["mode"] == mode)
    return [p[0] for p in pts], [p[1] for p in pts]


def setup_axis(ax, counts):
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_xlabel("devices")
    ax.grid(True, which="both", alpha=0.3)


def plot_scaling(rows, compare, projection, out, key, ylabel, fname, title):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    counts = sorted({r["devices"] for r in rows + compare})
    proj = projection[0] if projection else {}
    for mode in ("dp", "ddp"):
        xs, rs = series(rows, mode)
        if xs:
            ys = [r[key] * (100 if key == "efficiency" else 1) if r.get(key) is not None else None
                  for r in rs]
            ax.plot(xs, ys, "-o", color=COLORS[mode], label="replica %s (measured)" % NAMES[mode])
        if mode in proj:
            p = proj[mode]["points"]
            px = [q["devices"] for q in p]
            py = [q["samples_per_sec" if key == "samples_per_sec" else "efficiency"] *
                  (100 if key == "efficiency" else 1) for q in p]
            link = proj.get("link")
            what = ("over %s, declared" % link["name"]) if link else "alpha-beta model"
            ax.plot(px, py, "--", color=COLORS[mode], alpha=0.8,
                    label="%s projection (%s)" % (NAMES[mode], what))
            counts = sorted(set(counts) | set(px))
    for mode in ("dp", "ddp"):
        xs, rs = series(compare, mode)
        if xs:
            ys = [r.get(key) for r in rs]
            ys = [y * (100 if key == "efficiency" else 1) if y is not None else None for y in ys]
            engine = {"pytorch": "PyTorch"}.get(rs[0].get("engine"), rs[0].get("engine", "other"))
            ax.plot(xs, ys, "-.x", color=COLORS[mode], alpha=0.6,
                    label="%s %s" % (engine, "DataParallel" if mode == "dp" else "DDP"))
    if key == "samples_per_sec":
        base = [r for r in rows if r["devices"] == 1 and r["mode"] == "dp"]
        if base:
            ax.plot(counts, [base[0]["samples_per_sec"] * c for c in counts], ":", color="grey",
                    label="ideal: n x 1-device DP")
        ax.set_yscale("log")
    else:
        ax.axhline(100, color="grey", linestyle=":", label="100% (perfect weak scaling)")
        ax.set_ylim(bottom=0)
    setup_axis(ax, counts)
    ax.set_ylabel(ylabel)
    ax.set_title(title + " - " + group_label(rows[0]) + shared_note(rows), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, fname), dpi=110)
    plt.close(fig)
    print("wrote " + fname)


def plot_phases(rows, out):
    phases = []
    for r in rows:
        for p in r.get("phase_ms") or {}:
            if p not in phases and p != "other":
                phases.append(p)
    phases.append("other")
    labels = ["%s %d" % (NAMES.get(r["mode"], r["mode"]), r["devices"]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 3), 4.5))
    bottom = [0.0] * len(rows)
    for p in phases:
        vals = [(r.get("phase_ms") or {}).get(p, 0.0) or 0.0 for r in rows]
        if not any(vals):
            continue
        ax.bar(labels, vals, bottom=bottom, label=p, color=PHASE_COLORS.get(p))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step (DP: device 0, DDP: rank 0)")
    ax.set_title("time per step by phase - " + group_label(rows[0]) + shared_note(rows), fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "phases.png"), dpi=110)
    plt.close(fig)
    print("wrote phases.png")


def plot_memory(rows, out):
    labels = ["%s %d" % (NAMES.get(r["mode"], r["mode"]), r["devices"]) for r in rows]
    dev0 = [r["peak_memory_bytes"][0] / 1e6 for r in rows]
    others = [max(r["peak_memory_bytes"][1:]) / 1e6 if len(r["peak_memory_bytes"]) > 1 else 0
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 3), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], dev0, width=0.4, label="device 0 / rank 0", color="tab:red")
    ax.bar([i + 0.2 for i in x], others, width=0.4, label="other devices (max)", color="tab:gray")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("peak memory (MB)")
    ax.set_title("peak memory per device - " + group_label(rows[0]) + shared_note(rows), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)
    plt.close(fig)
    print("wrote memory.png")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: bench_plot.py DIR")
    d = sys.argv[1]
    rows = read_jsonl(os.path.join(d, "results.jsonl"))
    if not rows:
        sys.exit("bench_plot: error: no rows in %s" % os.path.join(d, "results.jsonl"))
    compare = read_jsonl(os.path.join(d, "compare.jsonl"))
    projection = []
    if os.path.exists(os.path.join(d, "projection.json")):
        with open(os.path.join(d, "projection.json")) as f:
            projection = json.load(f) or []
    # One model group per plot: the first one (a report normally has one).
    g = group_label(rows[0])
    rows = [r for r in rows if group_label(r) == g]
    compare = [r for r in compare if r["model"] == rows[0]["model"]
               and r["batch_per_device"] == rows[0]["batch_per_device"]]
    projection = [p for p in projection if p["model"] == rows[0]["model"]
                  and p["batch_per_device"] == rows[0]["batch_per_device"]]
    plot_scaling(rows, compare, projection, d, "samples_per_sec", "samples/s (log scale)",
                 "throughput.png", "throughput")
    plot_scaling(rows, compare, projection, d, "efficiency", "scaling efficiency (%)",
                 "efficiency.png", "scaling efficiency")
    plot_phases(rows, d)
    plot_memory(rows, d)


if __name__ == "__main__":
    main()
