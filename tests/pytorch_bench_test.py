#!/usr/bin/env python3
"""tools/pytorch_bench.py's own logic, without PyTorch: a stand-in `torch` (no GPU, a fixed
version) is put where the import looks for it, so that the devices, shapes and layouts the bench
reads from its flags, the DDP backend it picks and the row it writes beside replica's can be
checked on any machine. Bad flags must be one-line errors with exit code 2. The stand-in is
taken away after the tests, so nothing else sees it."""
import contextlib
import io
import os
import sys
import types
import unittest
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
STAND_INS = ("torch", "torch.distributed", "torch.multiprocessing", "torch.nn")


def stand_in_torch():
    """The few names pytorch_bench.py and pytorch_workload.py touch outside a run."""
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-stand-in"
    torch.cuda = SimpleNamespace(is_available=lambda: False, device_count=lambda: 0,
                                 get_device_name=lambda i: "none")
    torch.version = SimpleNamespace(cuda=None)
    torch.backends = SimpleNamespace(cudnn=SimpleNamespace(version=lambda: None))
    nn = types.ModuleType("torch.nn")
    nn.Module = type("Module", (), {})
    torch.nn = nn
    torch.distributed = types.ModuleType("torch.distributed")
    torch.multiprocessing = types.ModuleType("torch.multiprocessing")
    return {"torch": torch, "torch.nn": nn, "torch.distributed": torch.distributed,
            "torch.multiprocessing": torch.multiprocessing}


class PytorchBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.saved = {name: sys.modules.get(name) for name in STAND_INS}
        sys.modules.update(stand_in_torch())
        sys.path.insert(0, TOOLS)
        import pytorch_bench
        import pytorch_workload
        cls.bench, cls.work = pytorch_bench, pytorch_workload

    @classmethod
    def tearDownClass(cls):
        sys.path.remove(TOOLS)
        for name in ("pytorch_bench", "pytorch_workload"):
            sys.modules.pop(name, None)
        for name, module in cls.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    def refused(self, call, message):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as stop:
            call()
        self.assertEqual(stop.exception.code, 2)
        self.assertIn(message, err.getvalue())
        self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())

    def test_devices_as_replica_spells_them(self):
        parse = self.work.parse_devices
        self.assertEqual(parse("cpu"), ([("cpu", 0)], False))
        self.assertEqual(parse("cpu*2"), ([("cpu", 0), ("cpu", 1)], False))
        self.assertEqual(parse("cuda:0*4"), ([("cuda", 0)] * 4, True))
        self.assertEqual(parse("cuda:0*1"), ([("cuda", 0)], False))
        self.assertEqual(parse("cuda:0,1"), ([("cuda", 0), ("cuda", 1)], False))
        for bad in ("cpu*x", "cpu*0", "gpu", "cuda*2", "cuda:a", "cuda:0*", ""):
            self.refused(lambda: parse(bad), "expected cpu*N, cuda, cuda:0,1 or cuda:0*N")
        self.refused(lambda: parse("cuda"), "no CUDA GPU visible to PyTorch")

    def test_shapes_and_counts(self):
        self.assertEqual(self.work.parse_shape("", "cnn"), (1, 28, 28))
        self.assertEqual(self.work.parse_shape("", "resnet50"), (3, 224, 224))
        self.assertEqual(self.work.parse_shape("3x32x32", "resnet18"), (3, 32, 32))
        for bad in ("3x32", "3x32xa", "0x28x28"):
            self.refused(lambda: self.work.parse_shape(bad, "cnn"), "expected CxHxW")
        self.assertEqual(self.work.parse_counts("1,2,4"), [1, 2, 4])
        self.refused(lambda: self.work.parse_counts("1,two"), "expected a comma list")

    def test_channels_last_as_replica_bench_decides(self):
        def args(precision, fmt="auto", devices="cuda:0", shape=(3, 32, 32)):
            return SimpleNamespace(precision=precision, memory_format=fmt, devices=devices,
                                   shape=shape)
        cl = self.work.channels_last
        self.assertTrue(cl(args("bf16")))  # auto: bf16 images on a GPU
        self.assertFalse(cl(args("bf16", devices="cpu*2")))
        self.assertFalse(cl(args("tf32")))
        self.assertFalse(cl(args("bf16", fmt="nchw")))
        self.assertTrue(cl(args("fp32", fmt="channels_last", devices="cpu")))
        self.assertFalse(cl(args("bf16", fmt="channels_last", shape=(784,))))  # not an image

    def test_ddp_backend_never_mixes_gloo_and_nccl_in_one_run(self):
        backend = self.bench.ddp_backend
        self.assertEqual(backend([("cuda", 0), ("cuda", 1)]), "nccl")
        self.assertEqual(backend([("cuda", 0)] * 2), "gloo")  # NCCL refuses two ranks a GPU
        self.assertEqual(backend([("cpu", 0), ("cpu", 1)]), "gloo")

    def test_row_has_replica_bench_fields(self):
        args = SimpleNamespace(batch_per_device=32, steps=10, model="cnn", shape=(1, 28, 28),
                               threads_per_device=1, precision="fp32", memory_format="auto",
                               devices="cpu*2", cudnn_benchmark=False, warmup=2, repeat=3)
        devs = [("cpu", 0), ("cpu", 1)]
        windows = [0.5, 0.4, 0.8]  # seconds for 10 steps of 64 samples: 1280, 1600, 800
        r = self.bench.row(args, "dp", devs, False, 1000, windows,
                           {"forward": 1.0, "backward": 2.0, "step": 0.5}, 2.3,
                           [(100, None), (90, None)], [None])
        self.assertEqual(r["engine"], "pytorch")
        self.assertEqual(r["samples_per_sec"], 1280)  # the median window
        self.assertEqual(r["samples_per_sec_runs"], [1280, 1600, 800])
        self.assertAlmostEqual(r["ms_per_step"], 50.0)
        self.assertEqual(r["global_batch"], 64)
        self.assertEqual(r["comm_bytes"], 4000)  # DP: one gradient copy per extra device
        self.assertEqual(r["device_list"], ["cpu:0", "cpu:1"])
        self.assertEqual(r["peak_memory_bytes"], [100, 90])
        self.assertIsNone(r["peak_held_bytes"])
        self.assertIsNone(r["forward_kept_bytes"])
        self.assertEqual(r["memory_format"], "nchw")
        ddp = self.bench.row(args, "ddp", devs, False, 1000, windows, {}, 2.3,
                             [(100, None), (90, None)], [None, None], "gloo")
        self.assertEqual(ddp["comm_bytes"], 4000)  # DDP: one all-reduce of the gradients
        self.assertEqual(ddp["backend"], "gloo")
        self.assertEqual(ddp["env"]["torch"], "0.0-stand-in")


if __name__ == "__main__":
    unittest.main()
