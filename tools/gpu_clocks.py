"""The GPU's clocks, power, temperature and clock-event (throttle) reasons, sampled once a second
while a measurement runs (tools/gpu_checks.py), so that a timed window slower than its
neighbours can be told apart from a GPU that slowed down under it. Two runs of the same
benchmark an hour apart differ by ±25% on a lent machine (ResNet-101's windows on 2026-11-27:
4,471, 3,649 and 3,418 samples/s in one call); without the clocks beside them nobody can say
whether the engine or the GPU changed.

    log = ClockLog("cuda:0", "OUT/gpu-clocks.csv")   # starts nvidia-smi -lms 1000
    ...                                              # the runs
    print(log.summary(t0, t1))                       # what the GPU did between t0 and t1
    log.stop()

Best effort: without nvidia-smi, or where it knows none of the reason fields, the log says so and
samples what it can; it never fails a check.
"""
import statistics
import subprocess
import threading
import time

# nvidia-smi --query-gpu's fields; the reasons field was renamed in newer drivers, so the first
# one nvidia-smi accepts is used.
FIELDS = ["clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit",
          "temperature.gpu", "utilization.gpu"]
REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]

# The reasons that slow a busy GPU (nvmlClocksEventReasons): idle (0x1), application clocks
# (0x2) and sync boost (0x10) are not slowdowns.
SLOWDOWNS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)",
             0x40: "thermal (hardware)", 0x80: "power brake"}


def number(text):
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


class ClockLog:
    def __init__(self, device, path, period_ms=1000):
        self.samples = []  # (host time, {field: value})
        self.why_not = None
        self.proc = None
        index = device.split(":", 1)[1] if ":" in device else "0"
        fields = self._fields(index)
        if fields is None:
            return
        self.fields = fields
        self.has_reasons = fields[-1] in REASON_FIELDS
        self.csv = open(path, "w")
        self.csv.write("host_time," + ",".join(fields) + "\n")
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", index, "--query-gpu=" + ",".join(fields),
             "--format=csv,noheader,nounits", "-lms", str(period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _fields(self, index):
        """The fields this nvidia-smi answers: FIELDS plus the first reason field it knows."""
        for extra in [[f] for f in REASON_FIELDS] + [[]]:
            fields = FIELDS + extra
            try:
                p = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=" + ",".join(fields),
                                    "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                self.why_not = f"nvidia-smi did not run ({e})"
                return None
            if p.returncode == 0:
                return fields
        self.why_not = "nvidia-smi refused every field list"
        return None

    def _read(self):
        for line in self.proc.stdout:
            values = line.rstrip("\n").split(",")
            if len(values) != len(self.fields):
                continue
            now = time.time()
            self.csv.write("%.3f,%s" % (now, line))
            self.csv.flush()
            sample = {}
            for field, text in zip(self.fields, values):
                if field in REASON_FIELDS:
                    try:
                        sample["reasons"] = int(text.strip(), 16)
                    except ValueError:
                        pass
                else:
                    sample[field] = number(text)
            self.samples.append((now, sample))

    def stop(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.reader.join(timeout=5)
            self.csv.close()
            self.proc = None

    def summary(self, t0, t1):
        """One line on what the GPU's clocks did between host times t0 and t1."""
        if self.why_not:
            return f"GPU clocks: not sampled ({self.why_not})"
        inside = [s for (t, s) in list(self.samples) if t0 <= t <= t1]
        if not inside:
            return "GPU clocks: no sample in this part (shorter than a second?)"

        def values(field):
            return [s[field] for s in inside if s.get(field) is not None]

        sm, top = values("clocks.sm"), values("clocks.max.sm")
        busy = [s for s in inside if (s.get("utilization.gpu") or 0) >= 50]
        parts = [f"{len(inside)} samples"]
        if sm:
            parts.append(f"SM clock median {statistics.median(sm):.0f} MHz (min {min(sm):.0f}"
                         + (f", max {max(top):.0f}" if top else "") + ")")
        for field, unit, label in (("power.draw", "W", "power max"),
                                   ("temperature.gpu", "C", "temperature max")):
            v = values(field)
            if v:
                parts.append(f"{label} {max(v):.0f} {unit}")
        if not self.has_reasons:
            parts.append("clock-event reasons not reported")
        elif busy:
            slowed = {name: sum(1 for s in busy if s.get("reasons", 0) & bit)
                      for bit, name in SLOWDOWNS.items()}
            named = [f"{name} {100 * n / len(busy):.0f}%" for name, n in slowed.items() if n]
            parts.append("while busy, slowed by: " + (", ".join(named) if named else "nothing"))
        return "GPU clocks: " + "; ".join(parts)
