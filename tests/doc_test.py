#!/usr/bin/env python3
"""The documentation's commands, run: README.md and docs/**/*.md stay true as the code changes.

Every fenced block must say what it is. Shell blocks are marked in their info string:

    ```sh run                  run it (from a scratch directory of the file's own, in order)
    ```sh run timeout=300      ... with a time limit other than the default 120 s
    ```sh run gpu              ... only where replica finds a GPU (elsewhere skipped by name)
    ```sh run netns            ... only where network namespaces can be made (root, iproute2:
                                   tools/local_nodes.sh --check; elsewhere skipped by name)
    ```sh skip=hours on CPU    not run, for the reason given (printed, never silent)

and an ```output block after a run block is what it prints: the run's output must have the same
lines and words, numbers free to differ; a line that is only `...` stands for any number of
lines, and `...` inside a line for any text. Other blocks are ```text, ```json, ```python, ....

Every command in every shell block, run or skipped, is checked: the program exists, and each
--flag it uses is one the program lists in its --help (replica programs) or names in its source
(scripts; tests/doc_commands.py). A renamed flag, a removed program or a changed output fails
with file:line.

    python3 tests/doc_test.py --repo . --bin build/bin [--only README.md] [--list]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from doc_commands import Programs, check_command, command_lines, segments

FENCE = re.compile(r"^```(.*)$")
NUMBER = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


class Block:
    def __init__(self, path, line, info, body):
        self.path, self.line, self.body = path, line, body
        words = info.split()
        self.lang = words[0] if words else ""
        self.attrs = " ".join(words[1:])

    def where(self):
        return f"{self.path}:{self.line}"

    def run(self):
        return self.lang == "sh" and re.match(r"^run\b", self.attrs) is not None

    def skip_reason(self):
        m = re.match(r"^skip=(.+)$", self.attrs)
        return m.group(1).strip() if m else None

    def needs(self):
        """What the machine must have for this run block (words of REQUIREMENTS)."""
        return [w for w in REQUIREMENTS if self.run() and re.search(rf"\b{w}\b", self.attrs)]

    def timeout(self):
        m = re.search(r"timeout=(\d+)", self.attrs)
        return int(m.group(1)) if m else 120


def blocks_of(path, text):
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append(Block(path, start, m.group(1).strip(), "\n".join(body)))
        i += 1
    return out


# ----------------------------------------------------------------------------- outputs

def normalize(line):
    line = NUMBER.sub("#", line.rstrip())
    return re.sub(r"\s+", " ", line).strip()


def line_pattern(expected):
    parts = [re.escape(p) for p in normalize(expected).split("...")]
    return re.compile("^" + ".*".join(parts) + "$")


def same_shape(expected_text, actual_text):
    """None when the output has the expected shape, else the first expected line not found."""
    actual = [normalize(l) for l in actual_text.replace("\r", "\n").split("\n") if l.strip()]
    expected = [l for l in expected_text.split("\n") if l.strip()]

    def match(ei, ai):
        while ei < len(expected):
            if expected[ei].strip() == "...":
                return any(match(ei + 1, k) for k in range(ai, len(actual) + 1))
            if ai >= len(actual) or not line_pattern(expected[ei]).match(actual[ai]):
                return False
            ei, ai = ei + 1, ai + 1
        return ai == len(actual)

    if match(0, 0):
        return None
    # Where a line-by-line reading first goes wrong, for the message.
    ai, gap = 0, False
    for e in expected:
        if e.strip() == "...":
            gap = True
            continue
        pat = line_pattern(e)
        if gap:
            k = next((k for k in range(ai, len(actual)) if pat.match(actual[k])), None)
            if k is None:
                return f"'{e.strip()}' (after output line {ai}: not found)"
            ai, gap = k + 1, False
        elif ai >= len(actual):
            return f"'{e.strip()}' (the output ended before it)"
        elif not pat.match(actual[ai]):
            return f"'{e.strip()}' at output line {ai + 1}, which reads '{actual[ai]}'"
        else:
            ai += 1
    if not gap and ai < len(actual):
        return f"the end of the output after line {ai}, which goes on: '{actual[ai]}'"
    return "the lines in another arrangement"


# ----------------------------------------------------------------------------- running

def scratch_dir(repo):
    d = tempfile.mkdtemp(prefix="replica-doc-")
    for entry in os.listdir(repo):
        if not entry.startswith("."):
            os.symlink(os.path.join(repo, entry), os.path.join(d, entry))
    return d


def run_block(block, cwd, bindir):
    env = dict(os.environ)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    script = "set -e -o pipefail\n" + block.body + "\n"
    try:
        p = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=block.timeout(), errors="replace")
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out


def have_gpu(bindir):
    try:
        p = subprocess.run([os.path.join(bindir, "replica-train"), "--list-devices"],
                           capture_output=True, text=True, timeout=60)
        return re.search(r"^cuda:\d", p.stdout, re.M) is not None
    except (OSError, subprocess.SubprocessError):
        return False


def have_netns(repo):
    try:
        p = subprocess.run([os.path.join(repo, "tools", "local_nodes.sh"), "--check"],
                           capture_output=True, text=True, timeout=60)
        return p.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# A run block's requirements: the word in its info string, and what is missing without it.
REQUIREMENTS = {"gpu": "needs a GPU (none found)",
                "netns": "needs network namespaces (root and iproute2: tools/local_nodes.sh --check)"}


def doc_files(repo, only):
    if only:
        return only
    files = ["README.md"]
    for root, _, names in os.walk(os.path.join(repo, "docs")):
        files += sorted(os.path.relpath(os.path.join(root, n), repo) for n in names if n.endswith(".md"))
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=".")
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--only", action="append", help="just these files (relative to --repo)")
    ap.add_argument("--list", action="store_true", help="list the blocks and what would happen")
    ap.add_argument("--no-run", action="store_true", help="check commands and flags only")
    args = ap.parse_args()
    repo, bindir = os.path.abspath(args.repo), os.path.abspath(args.bin)
    programs = Programs(repo, bindir)
    have = {"gpu": have_gpu(bindir), "netns": have_netns(repo)}
    failures, ran, skipped = [], 0, 0

    for rel in doc_files(repo, args.only):
        with open(os.path.join(repo, rel)) as f:
            blocks = blocks_of(rel, f.read())
        cwd, last_run = None, None
        for b in blocks:
            if b.lang == "":
                failures.append(f"{b.where()}: untagged block: mark it ```sh run, ```sh skip=REASON, "
                                f"```output or ```text")
                continue
            if b.lang == "output":
                if last_run is None:
                    failures.append(f"{b.where()}: output block without a run block before it")
                elif last_run[0] is not None:
                    rc, out, where = last_run
                    missing = same_shape(b.body, out)
                    if missing is not None:
                        failures.append(f"{b.where()}: the output of {where} changed shape: "
                                        f"expected {missing}\n--- output ---\n{out[-3000:]}")
                last_run = None
                continue
            if b.lang != "sh":
                continue
            for line in command_lines(b.body):
                for seg in segments(line):
                    for problem in check_command(seg, programs):
                        failures.append(f"{b.where()}: {problem}  ({line.strip()[:100]})")
            missing = [w for w in b.needs() if not have[w]]
            if missing:
                skipped += 1
                print(f"SKIP {b.where()}: {REQUIREMENTS[missing[0]]}")
                last_run = (None, "", b.where())  # its output block: taken, not compared
                continue
            if b.run():
                if args.list or args.no_run:
                    print(f"RUN  {b.where()} (timeout {b.timeout()} s)")
                    last_run = (None, "", b.where())
                    continue
                cwd = cwd or scratch_dir(repo)
                started = time.monotonic()
                rc, out = run_block(b, cwd, bindir)
                ran += 1
                status = "ok" if rc == 0 else ("TIMEOUT" if rc is None else f"exit {rc}")
                print(f"RUN  {b.where()}: {status} ({time.monotonic() - started:.1f} s)",
                      flush=True)
                if rc != 0:
                    failures.append(f"{b.where()}: {status}\n--- output ---\n{out[-3000:]}")
                    last_run = (None, out, b.where())
                else:
                    last_run = (rc, out, b.where())
            else:
                reason = b.skip_reason()
                if reason is None:
                    failures.append(f"{b.where()}: shell block neither `run` nor `skip=REASON`")
                else:
                    skipped += 1
                    print(f"SKIP {b.where()}: {reason}")
                last_run = None
        if cwd:
            shutil.rmtree(cwd, ignore_errors=True)

    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"doc test: {ran} blocks run, {skipped} skipped by name, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
