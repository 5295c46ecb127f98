#!/usr/bin/env python3
"""The measuring tools' own logic, without running an engine or a GPU:
- how tools/replica_vs_pytorch.py alternates the engines over --rounds, pairs their runs into
  ratios and writes the table (the programs it calls replaced by a recorder, run_one);
- how tools/gpu_clocks.py samples and sums up the GPU's clocks (nvidia-smi replaced by a script
  that answers as an older driver does: the new name of the reasons field refused);
- which kernels tools/ncu_step.py counts as one step, from a made-up Nsight Compute CSV;
- how tools/gpu_steps.sh spends a budget: steps cut at their limit, the last listed as not run.

    python3 tests/tools_test.py        # ctest: tools_py (label unit)
"""
import contextlib
import importlib.util
import io
import os
import stat
import subprocess
import sys
import tempfile
import time
import unittest
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name, folder="tools"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, folder, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, os.path.join(REPO, "tools"))  # the tools import their sibling modules
vs = load("replica_vs_pytorch")
vs_tables = load("replica_vs_pytorch_tables")
doc_test = load("doc_test", folder="tests")
clocks = load("gpu_clocks")


def row(engine, sps, peak=1e9):
    return {"engine": engine, "samples_per_sec": sps, "peak_memory_bytes": [peak],
            "peak_held_bytes": [peak * 1.1]}


def args(rounds):
    return SimpleNamespace(cudnn_benchmark=False, cuda_graphs=False, steps=None, warmup=None,
                           repeat=None, bin="/bin", device="cuda:0", rounds=rounds)


class Recorder:
    """Stands in for run_one: answers each engine's runs from a list, in order, and records
    which engine ran when."""

    def __init__(self, speeds):
        self.speeds = {name: list(values) for name, values in speeds.items()}
        self.order = []

    def __call__(self, cmd, out_file, read=None):
        name = "pytorch" if any("pytorch_bench" in c for c in cmd) else "replica"
        self.order.append(name)
        sps = self.speeds[name].pop(0)
        return (row(name, sps), None) if sps is not None else (None, name + " failed")


class Rounds(unittest.TestCase):
    def run_rounds(self, rounds, speeds):
        recorder = Recorder(speeds)
        saved, vs.run_one = vs.run_one, recorder
        try:
            cells = vs.measure(args(rounds), "resnet101", "1x28x28", 256, "fp32", "/tmp")
        finally:
            vs.run_one = saved
        return cells, recorder.order

    def test_engines_alternate_and_rounds_pair(self):
        cells, order = self.run_rounds(3, {"replica": [100, 80, 90], "pytorch": [100, 100, 50]})
        self.assertEqual(order, ["replica", "pytorch", "pytorch", "replica", "replica",
                                 "pytorch"])
        replica, _ = cells["replica"]
        pytorch, _ = cells["pytorch"]
        self.assertEqual(replica["samples_per_sec"], 90)
        self.assertEqual(replica["samples_per_sec_rounds"], [100, 80, 90])
        self.assertEqual(replica["round"], 3)  # the median round's row
        self.assertEqual(pytorch["samples_per_sec"], 100)
        self.assertEqual([round(x, 3) for x in cells["ratios"]], [1.0, 0.8, 1.8])
        self.assertEqual([r["round"] for r in cells["rows"]], [1, 1, 2, 2, 3, 3])

    def test_one_round_is_one_run_each_unmarked(self):
        cells, order = self.run_rounds(1, {"replica": [120], "pytorch": [100]})
        self.assertEqual(order, ["replica", "pytorch"])
        self.assertNotIn("round", cells["replica"][0])
        self.assertEqual([round(x, 3) for x in cells["ratios"]], [1.2])

    def test_a_failed_round_pairs_nothing_and_a_failed_engine_says_why(self):
        cells, _ = self.run_rounds(2, {"replica": [100, 90], "pytorch": [None, 100]})
        self.assertEqual([round(x, 3) for x in cells["ratios"]], [0.9])
        self.assertEqual(cells["pytorch"][0]["samples_per_sec"], 100)
        cells, _ = self.run_rounds(2, {"replica": [100, 90], "pytorch": [None, None]})
        self.assertEqual(cells["pytorch"], (None, "pytorch failed"))
        self.assertEqual(cells["ratios"], [])


class Table(unittest.TestCase):
    def cells(self, ratios):
        return {"replica": (row("replica", 90), None), "pytorch": (row("pytorch", 100), None),
                "ratios": ratios}

    def check_columns(self, text):
        lines = [l for l in text.splitlines() if l.startswith("|")]
        self.assertGreaterEqual(len(lines), 3)
        self.assertEqual(len({l.count("|") for l in lines}), 1, text)

    def test_rounds_add_a_column_with_each_ratio(self):
        text = vs_tables.table(
            [(("resnet101", "1x28x28", 256, "fp32"), self.cells([1.0, 0.8, 1.8]))], rounds=3)
        self.check_columns(text)
        self.assertIn("ratio by round", text)
        self.assertIn("| 1.00x | 1.00, 0.80, 1.80 |", text)
        self.assertIn("3 rounds per case", text)

    def test_one_round_keeps_the_plain_table(self):
        text = vs_tables.table([(("cnn", "1x28x28", 32, "fp32"), self.cells([0.9]))])
        self.check_columns(text)
        self.assertNotIn("ratio by round", text)
        self.assertIn("| 90.0 | 100.0 | 0.90x |", text)

    def test_memory_cells_show_what_a_forward_kept_where_rows_have_it(self):
        ours = dict(row("replica", 90), forward_kept_bytes=[2.95e9])
        theirs = dict(row("pytorch", 100), forward_kept_bytes=None)  # on a CPU: not measured
        cells = {"replica": (ours, None), "pytorch": (theirs, None), "ratios": [0.9]}
        text = vs_tables.table([(("resnet50", "3x224x224", 64, "bf16"), cells)])
        self.check_columns(text)
        self.assertIn("| 1000 / 1100 MB, kept 2950 | 1000 / 1100 MB |", text)

    def test_a_missing_engine_says_why(self):
        cells = {"replica": (row("replica", 90), None), "pytorch": (None, "no module torch"),
                 "ratios": []}
        text = vs_tables.table([(("cnn", "1x28x28", 32, "fp32"), cells)], rounds=2)
        self.check_columns(text)
        self.assertIn("| - | - |", text)
        self.assertIn("- no module torch", text)


# Answers like nvidia-smi of a driver that knows clocks_throttle_reasons but not
# clocks_event_reasons: one line per query, or with -lms a line every 50 ms, the clock falling
# and the power cap (0x4) set from the third line on.
FAKE_NVIDIA_SMI = r"""#!/bin/sh
case "$*" in *clocks_event_reasons*) echo "Field is not a valid field to query." >&2; exit 2;; esac
line() { echo "$1, 1980, 2619, 690.5, 700.00, $2, 98, $3"; }
case "$*" in
  *-lms*) i=0; while true; do
            if [ $i -lt 2 ]; then line 1980 60 0x0000000000000000
            else line 1500 71 0x0000000000000004; fi
            i=$((i+1)); sleep 0.05; done;;
  *) line 1980 60 0x0000000000000000;;
esac
"""


class Clocks(unittest.TestCase):
    def test_samples_fall_back_to_the_old_field_and_name_the_slowdown(self):
        with tempfile.TemporaryDirectory() as d:
            smi = os.path.join(d, "nvidia-smi")
            with open(smi, "w") as f:
                f.write(FAKE_NVIDIA_SMI)
            os.chmod(smi, os.stat(smi).st_mode | stat.S_IEXEC)
            saved = os.environ["PATH"]
            os.environ["PATH"] = d + os.pathsep + saved
            try:
                t0 = time.time()
                log = clocks.ClockLog("cuda:0", os.path.join(d, "clocks.csv"), period_ms=50)
                deadline = time.time() + 10
                while len(log.samples) < 6 and time.time() < deadline:
                    time.sleep(0.05)
                t1 = time.time()
                log.stop()
            finally:
                os.environ["PATH"] = saved
            self.assertEqual(log.fields[-1], "clocks_throttle_reasons.active")
            self.assertGreaterEqual(len(log.samples), 6)
            text = log.summary(t0, t1)
            self.assertIn("SM clock median", text)
            self.assertIn("(min 1500, max 1980)", text)
            self.assertIn("temperature max 71 C", text)
            self.assertRegex(text, r"while busy, slowed by: power cap \d+%")
            with open(os.path.join(d, "clocks.csv")) as f:
                rows = f.read().splitlines()
            self.assertTrue(rows[0].startswith("host_time,clocks.sm"))
            self.assertGreaterEqual(len(rows), 7)
            self.assertIn("no sample", log.summary(t1 + 100, t1 + 200))

    def test_without_nvidia_smi_it_says_so(self):
        saved = os.environ["PATH"]
        os.environ["PATH"] = "/nonexistent"
        try:
            log = clocks.ClockLog("cuda:0", "/nonexistent/clocks.csv")
        finally:
            os.environ["PATH"] = saved
        log.stop()
        self.assertIn("not sampled (nvidia-smi did not run", log.summary(0, time.time()))


class DocTest(unittest.TestCase):
    def run_docs(self, text, have):
        with tempfile.TemporaryDirectory() as repo:
            with open(os.path.join(repo, "README.md"), "w") as f:
                f.write(text)
            saved = (doc_test.have_gpu, doc_test.have_netns, sys.argv)
            doc_test.have_gpu = lambda bindir: have
            doc_test.have_netns = lambda repo: have
            sys.argv = ["doc_test.py", "--repo", repo, "--bin", repo]
            try:
                with contextlib.redirect_stdout(io.StringIO()) as out, \
                        contextlib.redirect_stderr(io.StringIO()) as err:
                    code = doc_test.main()
            finally:
                doc_test.have_gpu, doc_test.have_netns, sys.argv = saved
            return code, out.getvalue() + err.getvalue()

    def test_a_block_skipped_for_what_the_machine_lacks_takes_its_output_block(self):
        text = ("```sh run netns\necho one 1\n```\n```output\none 1\n```\n"
                "```sh run gpu\necho two 2\n```\n```output\ntwo 2\n```\n")
        code, out = self.run_docs(text, have=False)
        self.assertEqual(code, 0, out)
        self.assertIn("needs network namespaces", out)
        self.assertIn("needs a GPU", out)
        # Where the machine has them, the blocks run and their outputs are compared.
        code, out = self.run_docs(text, have=True)
        self.assertEqual(code, 0, out)
        self.assertIn("2 blocks run", out)
        code, out = self.run_docs(text.replace("```output\ntwo 2", "```output\nthree 3"), have=True)
        self.assertEqual(code, 1, out)
        self.assertIn("changed shape", out)


NCU_CSV = """==PROF== Connected to process 1 (replica-bench)
"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","warm_up_kernel(float*)","gpu__time_duration.sum","us","900"
"1","adam_kernel(float*)","gpu__time_duration.sum","us","5"
"2","conv(float*)","gpu__time_duration.sum","us","7"
"3","bn_dx<4>(float*)","gpu__time_duration.sum","us","3"
"4","bn_dx<4>(float*)","gpu__time_duration.sum","us","1"
"5","adam_kernel(float*)","gpu__time_duration.sum","us","5"
"6","conv(float*)","gpu__time_duration.sum","us","2"
"7","bn_dx<4>(float*)","gpu__time_duration.sum","us","2,000"
"8","adam_kernel(float*)","gpu__time_duration.sum","us","4"
"""


class NcuStep(unittest.TestCase):
    def run_tool(self, text, *args):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "run.csv")
            with open(path, "w") as f:
                f.write(text)
            return subprocess.run([sys.executable, os.path.join(REPO, "tools", "ncu_step.py"),
                                   path] + list(args), capture_output=True, text=True)

    def test_the_last_whole_step_by_kernel_name(self):
        r = self.run_tool(NCU_CSV)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        # kernels 6..8: the step between the last two optimizer kernels, the second included;
        # "2,000" us is ncu's thousands separator; names lose their argument lists
        self.assertEqual(lines[0], "3 kernels, 2.006 ms of device time in one step")
        self.assertRegex(lines[2], r"^\s+2\.000\s+99\.7%\s+1  bn_dx<4>$")
        self.assertRegex(lines[3], r"^\s+0\.004\s+0\.2%\s+1  adam_kernel$")
        self.assertNotIn("warm_up_kernel", r.stdout)

    def test_fewer_than_two_steps_is_an_error_that_says_so(self):
        r = self.run_tool(NCU_CSV, "--step-marker", "sgd")
        self.assertEqual(r.returncode, 1)
        self.assertIn("fewer than two 'sgd' kernels", r.stderr)
        r = self.run_tool(NCU_CSV.replace('"us"', '"weeks"'))
        self.assertIn("unknown time unit 'weeks'", r.stderr)


class GpuSteps(unittest.TestCase):
    def test_steps_run_within_the_budget_and_say_what_found_no_time(self):
        with tempfile.TemporaryDirectory() as out:
            script = ("BUDGET=9; OUT=%s; source %s calls\n"
                      "step ok 6 echo hello\nstep failing 6 false\nstep cut 6 sleep 30\n"
                      "step late 6 true\ngpu_steps_pack\n"
                      % (out, os.path.join(REPO, "tools", "gpu_steps.sh")))
            r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            subprocess.run(["tar", "-xzf", os.path.join(out, "calls.tgz"), "-C", out], check=True)
            with open(os.path.join(out, "calls", "summary.txt")) as f:
                summary = f.read().splitlines()
            with open(os.path.join(out, "calls", "ok.log")) as f:
                self.assertEqual(f.read(), "hello\n")
        # whole seconds of date +%s: a step of a few ms may straddle one
        self.assertRegex(summary[0], r"^ok rc=0 [01]s$")
        self.assertRegex(summary[1], r"^failing rc=1 [01]s$")
        # cut at its own 6 s limit (timeout's 124); the budget then has 3 s left: not run
        self.assertRegex(summary[2], r"^cut rc=124 [67]s$")
        self.assertEqual(summary[3], "NOT RUN late (no time)")


class CompareTransforms(unittest.TestCase):
    def test_without_torchvision_it_says_what_it_needs(self):
        try:
            import torch, torchvision, PIL  # noqa: F401
            self.skipTest("torch, torchvision and PIL are here: the comparison itself can run")
        except ImportError:
            pass
        r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "compare_transforms.py"),
                            "--bin", "/nonexistent"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 77)
        self.assertIn("compare_transforms: needs torch, torchvision and PIL", r.stderr)


class Cli(unittest.TestCase):
    def test_rounds_below_one_is_refused(self):
        p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "replica_vs_pytorch.py"),
                            "--rounds", "0", "--out", "/tmp/unused"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--rounds must be at least 1", p.stderr)

    def test_bad_cases_and_inputs_are_one_line_errors(self):
        tools = os.path.join(REPO, "tools")
        for argv, code, message in (
                (["replica_vs_pytorch.py", "--case", "cnn:1x28:32", "--out", "/tmp/unused"], 2,
                 "--case 'cnn:1x28:32': expected MODEL:CxHxW:BATCH"),
                (["gpu_checks.py", "speed", "--case", "cnn:1x28x28:0", "--out", "/tmp/unused"],
                 1,
                 "--case 'cnn:1x28x28:0': expected MODEL:CxHxW:BATCH"),
                (["ncu_step.py", "/nonexistent/ncu.csv"], 1, "cannot read /nonexistent/ncu.csv")):
            p = subprocess.run([sys.executable, os.path.join(tools, argv[0])] + argv[1:],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, code, p.stderr)
            self.assertIn(message, p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        # Nothing measured (a model neither engine has) is a failure, not an empty table.
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run([sys.executable, os.path.join(tools, "replica_vs_pytorch.py"),
                                "--case", "nosuch:1x28x28:8", "--precisions", "fp32", "--out",
                                out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("replica measured no case", p.stderr)

    def test_local_nodes_refuses_bad_arguments_before_making_nodes(self):
        script = os.path.join(REPO, "tools", "local_nodes.sh")
        for argv, message in ((["--rate", "5xbit", "--", "true"], "--rate '5xbit'"),
                              (["--nodes", "0", "--", "true"], "--nodes must be 1 to 200"),
                              (["--nproc-per-node", "x", "--", "true"], "--nproc-per-node"),
                              (["--speed", "1"], "unknown argument '--speed'"),
                              (["--rate"], "--rate needs a value"),
                              (["--rate", "", "--", "true"], "--rate needs a value"),
                              (["--nodes", "08", "--", "true"], "--nodes must be 1 to 200"),
                              ([], "no program given")):
            p = subprocess.run([script] + argv, capture_output=True, text=True)
            self.assertEqual(p.returncode, 2, argv)
            self.assertIn(message, p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)


if __name__ == "__main__":
    unittest.main()
