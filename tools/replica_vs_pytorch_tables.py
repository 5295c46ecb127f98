"""The tables tools/replica_vs_pytorch.py writes to table.md: samples/s of both engines side by
side with their ratio and memory (table), replica-train beside replica-bench (train_table), and
the lines that say how the cases were run (report_text). Each case's cells are what
replica_vs_pytorch.measure returns: (row, why) per engine, the rounds' ratios and, with
--with-train, replica-train's (row, why) per data placement."""
import statistics


def train_table(results):
    lines = ["| model | input | batch | precision | replica-bench samples/s | data placement | "
             "replica-train samples/s | train / bench | data_wait, % of a step |",
             "|---|---|---:|---|---:|---|---:|---:|---:|"]
    notes = []
    for (model, shape, batch, precision), cells in results:
        bench, _ = cells["replica"]
        bench_cell = "%.1f" % bench["samples_per_sec"] if bench else "-"
        for placement, (train, why) in cells.get("train", {}).items():
            if not train:
                notes.append(why)
                lines.append("| %s | %s | %d | %s | %s | %s | - | - | - |" % (
                    model, shape, batch, precision, bench_cell, placement))
                continue
            sps = train["samples_per_sec"]
            step_ms = 1e3 * batch / sps
            wait = 100 * train.get("phase_ms_per_step", {}).get("data_wait", 0.0) / step_ms
            used = train.get("config", {}).get("data_placement", placement)
            lines.append("| %s | %s | %d | %s | %s | %s | %.1f | %s | %.1f%% |" % (
                model, shape, batch, precision, bench_cell,
                placement if used == placement else "%s (%s)" % (placement, used), sps,
                "%.2f" % (sps / bench["samples_per_sec"]) if bench else "-", wait))
    lines.append("")
    lines.append("replica-train's samples/s covers its whole run (--max-steps) but the first "
                 "step, which allocates and warms caches.")
    lines += ["- " + n for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def mb(row):
    """Device 0's peak bytes in use, held (in use plus cached) and kept by a training forward
    for backward, where the row has them: "6139 / 6410 MB, kept 2950"."""
    peaks = row.get("peak_memory_bytes") or []
    held = row.get("peak_held_bytes") or []
    kept = row.get("forward_kept_bytes") or []
    if not peaks:
        return "-"
    text = ("%.0f / %.0f MB" % (peaks[0] / 1e6, held[0] / 1e6) if held and held[0] is not None
            else "%.0f MB" % (peaks[0] / 1e6))
    return text + (", kept %.0f" % (kept[0] / 1e6) if kept and kept[0] is not None else "")


def table(results, rounds=1):
    by_round = rounds > 1
    lines = ["| model | input | batch | precision | replica samples/s | PyTorch samples/s | "
             "replica / PyTorch | " + ("ratio by round | " if by_round else "")
             + "replica peak / held, kept | PyTorch peak / held, kept |",
             "|---|---|---:|---|---:|---:|---:|" + ("---|" if by_round else "") + "---:|---:|"]
    notes = []
    for (model, shape, batch, precision), cells in results:
        r, rwhy = cells["replica"]
        p, pwhy = cells["pytorch"]
        cell = []
        for row, why, name in ((r, rwhy, "replica"), (p, pwhy, "PyTorch")):
            if row:
                cell.append("%.1f" % row["samples_per_sec"])
            else:
                cell.append("-")
                if why not in notes:
                    notes.append(why)
        ratios = cells["ratios"]
        ratio = "%.2fx" % statistics.median(ratios) if ratios else "-"
        if by_round:
            ratio += " | " + (", ".join("%.2f" % x for x in ratios) if ratios else "-")
        lines.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s |" % (
            model, shape, batch, precision, cell[0], cell[1], ratio, mb(r) if r else "-",
            mb(p) if p else "-"))
    if by_round:
        notes.append("%d rounds per case, the engines alternated (replica first in odd rounds): "
                     "samples/s is each engine's median round, the ratio the median of the "
                     "rounds' ratios, each round's beside it" % rounds)
    if any(p and p.get("peak_memory_kind") == "process max RSS" for (_, c) in results
           for p in [c["pytorch"][0]]):
        notes.append("on CPU PyTorch's peak is its process's max RSS, replica's its allocator's "
                     "peak: not comparable")
    notes.append("peak / held: device memory in use at the peak (max_memory_allocated) / held "
                 "by the caching allocator, in use plus cached (max_memory_reserved); kept: what "
                 "a training forward left allocated for its backward, in MB (activations; "
                 "under autocast PyTorch's also holds the bf16 weight copies it saved)")
    lines.append("")
    lines += ["- " + n for n in notes]
    return "\n".join(lines) + "\n"


def report_text(args, results):
    """table.md: how the cases were run, then the tables."""
    text = ("Convolution algorithms: %s.\n\n" % (
        "timed per shape in both engines (replica --cudnn-benchmark, "
        "torch.backends.cudnn.benchmark = True)" if args.cudnn_benchmark
        else "cuDNN's heuristics in both engines (no cudnn.benchmark)")) if args.gpu else ""
    if args.cuda_graphs:
        text += ("replica's step captured once and replayed as a CUDA Graph "
                 "(--cuda-graphs); PyTorch eager.\n\n")
    text += table(results, args.rounds)
    if args.with_train:
        text += "\n" + train_table(results)
    return text
