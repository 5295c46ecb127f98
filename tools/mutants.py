#!/usr/bin/env python3
"""Plants bugs one at a time and checks that the tests notice (mutation testing): a test suite
that passes with a bug in the code it guards cannot fail for that bug.

    python3 tools/mutants.py --build build-mut                 # every mutant of the catalogue
    python3 tools/mutants.py --build build-mut --only dp-tree-short --only ddp-sum-not-mean
    python3 tools/mutants.py --list

Each mutant of the catalogue (tools/mutants.txt) names a source file, a text that occurs exactly
once in it, its replacement, and the ctest suites that should catch it. For each one the runner
writes the mutated file, rebuilds (`cmake --build BUILD`), runs those suites (`ctest -R`), and
puts the file back, whatever happens (an error, Ctrl-C). A mutant is

  killed          a suite failed or ran past its limit: the tests noticed the bug
  SURVIVED        every suite passed: the bug went unnoticed
  does not build  the mutated source did not compile (the mutant is wrong, not the tests)
  broken          the text to replace is not in the file exactly once (the code moved on)

The build folder must be configured from this checkout (its CMakeCache.txt says which). A build
of its own is best, so the usual build/ stays as it is; configured with
-DREPLICA_UNITY_BUILD=OFF -DCMAKE_LINK_DEPENDS_NO_SHARED=ON -DREPLICA_CUDA=OFF a mutant costs
one file's compile and one library's link. The source tree is rebuilt unmutated at the end.
Exit code: 0 when every mutant run was killed, 1 when one survived or did not build (or was
broken), 2 for bad input.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KEYS = ("file", "tests", "why", "find", "replace")


def fail(msg):
    sys.exit(f"mutants.py: error: {msg}")


def parse_catalogue(text, where="catalogue"):
    """Mutants from the catalogue's text: blocks opened by '== NAME', with one-line keys file:,
    tests:, why: and the multi-line blocks find: and replace: (their lines follow the key, as
    they are in the source). Lines starting with '#' outside find/replace are comments."""
    mutants, current, block = [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("== "):
            current, block = {"name": line[3:].strip(), "line": number}, None
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", current["name"]):
                raise ValueError(f"{where}:{number}: mutant name '{current['name']}': lowercase "
                                 "letters, digits and dashes")
            mutants.append(current)
            continue
        key = re.match(r"(file|tests|why|find|replace):(.*)$", line)
        if key and current is not None:
            name, rest = key.group(1), key.group(2).strip()
            if name in current:
                raise ValueError(f"{where}:{number}: '{name}:' given twice for {current['name']}")
            if name in ("find", "replace"):
                current[name], block = [], name
            else:
                current[name], block = rest, None
            continue
        if block is not None:
            current[block].append(line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"{where}:{number}: expected '== NAME', a key or a comment: {line}")
    names = set()
    for m in mutants:
        for k in KEYS:
            if k not in m:
                raise ValueError(f"{where}:{m['line']}: mutant {m['name']} has no '{k}:'")
        for k in ("find", "replace"):
            while m[k] and not m[k][-1].strip():  # blank lines before the next mutant
                m[k].pop()
            m[k] = "\n".join(m[k])
        if not m["find"]:
            raise ValueError(f"{where}:{m['line']}: mutant {m['name']} has nothing to find")
        if m["find"] == m["replace"]:
            raise ValueError(f"{where}:{m['line']}: mutant {m['name']} changes nothing")
        if m["name"] in names:
            raise ValueError(f"{where}:{m['line']}: mutant {m['name']} named twice")
        names.add(m["name"])
    return mutants


def mutated(source, mutant):
    """The source with the mutant planted, or None unless its text occurs exactly once."""
    if source.count(mutant["find"]) != 1:
        return None
    return source.replace(mutant["find"], mutant["replace"])


class Planted:
    """The mutated file while the block runs; the original afterwards, whatever happens (a
    signal too: SIGINT and SIGTERM become KeyboardInterrupt inside the block)."""

    def __init__(self, path, text):
        self.path, self.text = path, text

    def __enter__(self):
        with open(self.path) as f:
            self.original = f.read()
        self.stat = os.stat(self.path)
        self.write(self.text)
        return self

    def write(self, text):
        with open(self.path, "w") as f:
            f.write(text)

    def __exit__(self, *exc):
        self.write(self.original)
        # A fresh modification time (later than the mutant's), so the next build recompiles.
        now = time.time()
        os.utime(self.path, (now, max(now, self.stat.st_mtime + 1)))
        return False


def run(argv, timeout):
    """(exit code, output); 124 at the timeout. At the timeout, or when this script is stopped
    (Ctrl-C), the program's whole process group is killed: a hung test must not outlive it."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return 124, out
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise


def failed_suites(ctest_output):
    return re.findall(r"^\s*\d+ - (\S+) \((?:Failed|Timeout|SEGFAULT|Subprocess aborted|"
                      r"Exception|Not Run)", ctest_output, re.M)


def try_mutant(m, args):
    """Plants, builds, tests and removes one mutant: (result, seconds, what failed)."""
    path = os.path.join(args.source, m["file"])
    t0 = time.time()
    try:
        with open(path) as f:
            text = mutated(f.read(), m)
    except OSError as e:
        return "broken", 0.0, f"{m['file']}: {e.strerror}"
    if text is None:
        return "broken", 0.0, "the text to find is not in the file exactly once"
    with Planted(path, text):
        code, out = run(["cmake", "--build", args.build, "-j", str(args.jobs)], args.build_timeout)
        if code != 0:
            return "does not build", time.time() - t0, "".join(out.strip().splitlines()[-1:])
        # ctest's --timeout serves only suites without a TIMEOUT of their own (the project's
        # have 900 s): the whole call is bounded too.
        code, out = run(["ctest", "--test-dir", args.build, "-R", m["tests"], "-j",
                         str(args.jobs), "--timeout", str(args.test_timeout)],
                        args.test_timeout * 2)
    seconds = time.time() - t0
    if "No tests were found" in out:
        return "broken", seconds, f"no suite matches '{m['tests']}'"
    if code == 124:
        return "killed", seconds, "ran past its limit"
    if code != 0:
        return "killed", seconds, ", ".join(failed_suites(out)) or "ctest failed"
    return "SURVIVED", seconds, ""


def source_of(build):
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", f.read(), re.M)
    except OSError:
        fail(f"{build}: no CMakeCache.txt (configure a build first; see --help)")
    if not m:
        fail(f"{build}/CMakeCache.txt names no source directory")
    return m.group(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--build", help="the build folder to mutate (configured from this checkout)")
    ap.add_argument("--catalogue", default=os.path.join(HERE, "mutants.txt"))
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="this mutant only (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--build-timeout", type=int, default=900, help="seconds per rebuild")
    ap.add_argument("--test-timeout", type=int, default=300,
                    help="seconds per suite; the suites of one mutant get twice that in all")
    args = ap.parse_args()
    try:
        with open(args.catalogue) as f:
            mutants = parse_catalogue(f.read(), args.catalogue)
    except OSError as e:
        fail(f"{args.catalogue}: {e.strerror}")
    except ValueError as e:
        fail(str(e))
    unknown = [n for n in args.only if n not in {m["name"] for m in mutants}]
    if unknown:
        fail(f"no mutant named {', '.join(unknown)} (--list names them)")
    chosen = [m for m in mutants if not args.only or m["name"] in args.only]
    if args.list:
        for m in chosen:
            print(f"{m['name']:28} {m['file']}  [{m['tests']}]\n{'':28} {m['why']}")
        return 0
    if not args.build:
        fail("--build BUILD is required (the folder to rebuild with each mutant)")
    args.source = source_of(args.build)
    if os.path.realpath(args.source) != os.path.realpath(REPO):
        fail(f"{args.build} was configured from {args.source}, not from this checkout ({REPO})")
    files = sorted({m["file"] for m in chosen})
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--"] + files,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        fail("uncommitted changes in files a mutant writes (commit or stash them first):\n"
             + dirty)
    # SIGTERM as Ctrl-C: the planted file goes back either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results = []
    try:
        for m in chosen:
            print(f"{m['name']}: {m['why']}", flush=True)
            result = try_mutant(m, args)
            results.append((m, result))
            print(f"  {result[0]} in {result[1]:.0f} s {result[2] or ''}", flush=True)
    finally:
        print("rebuilding the unmutated tree", flush=True)
        run(["cmake", "--build", args.build, "-j", str(args.jobs)], args.build_timeout)
    print(f"\n| mutant | file | result | seconds | caught by |\n|---|---|---|---:|---|")
    for m, (result, seconds, detail) in results:
        print(f"| {m['name']} | {m['file']} | {result} | {seconds:.0f} | {detail or '-'} |")
    killed = sum(r[0] == "killed" for _, r in results)
    print(f"\n{killed} of {len(results)} mutants killed")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
