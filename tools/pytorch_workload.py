"""What tools/pytorch_bench.py asks PyTorch to run, set up as replica sets up the same run: the
devices (--devices as replica spells them), the models as replica defines them, the precision and
memory-format settings, and the synthetic batches. A missing PyTorch is a one-line error."""
import sys


def fail(msg, code=2):
    print("pytorch_bench: error: " + msg, file=sys.stderr)
    sys.exit(code)


try:
    import torch
    import torch.nn as nn
except ImportError:
    fail("PyTorch is not installed (pip install torch torchvision): nothing measured")


def parse_devices(spec):
    """'cpu*2' | 'cuda' | 'cuda:0,1' | 'cuda:0*4' -> list of (kind, index) and whether they
    share a GPU."""
    try:
        devs, shared = devices_of(spec)
    except ValueError:
        devs = None
    if not devs:
        fail("--devices '%s': expected cpu*N, cuda, cuda:0,1 or cuda:0*N" % spec)
    return devs, shared


def devices_of(spec):
    """parse_devices' reading: None where spec has none of its forms (int() raises on a bad
    number)."""
    kind, star, count = spec.partition("*")
    n = int(count) if star else 1
    if kind == "cpu":
        return [("cpu", i) for i in range(n)], False
    if kind == "cuda" and not star:
        if not torch.cuda.is_available():
            fail("--devices cuda: no CUDA GPU visible to PyTorch")
        return [("cuda", i) for i in range(torch.cuda.device_count())], False
    if kind.startswith("cuda:"):
        if star:
            return [("cuda", int(kind[5:]))] * n, n > 1
        return [("cuda", int(g)) for g in kind[5:].split(",")], False
    return None, False


def parse_shape(text, model):
    """--input-shape CxHxW (default 1x28x28 for the CNN, 3x224x224 for the ResNets)."""
    text = text or ("1x28x28" if model == "cnn" else "3x224x224")
    try:
        shape = tuple(int(v) for v in text.split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        fail("--input-shape '%s': expected CxHxW" % text)
    return shape


def parse_counts(text):
    """--device-counts '1,2,4' -> [1, 2, 4]."""
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        fail("--device-counts '%s': expected a comma list of numbers" % text)


class Cnn(nn.Module):
    def __init__(self, shape, classes=10):
        super().__init__()
        c, h, w = shape
        self.conv1 = nn.Conv2d(c, 20, 5)
        self.conv2 = nn.Conv2d(20, 20, 5)
        self.fc1 = nn.Linear(20 * ((h - 8) // 2) * ((w - 8) // 2), 50)
        self.fc2 = nn.Linear(50, classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.flatten(torch.max_pool2d(x, 2), 1)
        return self.fc2(torch.relu(self.fc1(x)))


def make_model(name, shape):
    if name == "cnn":
        return Cnn(shape)
    try:
        import torchvision
    except ImportError:
        fail("torchvision is not installed (pip install torchvision), needed for --model " + name)
    if not callable(getattr(torchvision.models, name, None)):
        fail("--model '%s': expected cnn or a torchvision model (resnet18, resnet50, ...)" % name)
    m = getattr(torchvision.models, name)(num_classes=10)
    if shape[0] != 3:
        m.conv1 = nn.Conv2d(shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
    return m


def resolve_precision(args, devs):
    if args.precision not in ("auto", "fp32", "tf32", "bf16"):
        fail("--precision '%s': expected auto, fp32, tf32 or bf16" % args.precision)
    gpus = devs[0][0] == "cuda"
    tf32_everywhere = gpus and all(torch.cuda.get_device_capability(d[1])[0] >= 8 for d in devs)
    if args.precision == "auto":
        return "tf32" if tf32_everywhere else "fp32"
    if args.precision == "tf32" and not tf32_everywhere:
        fail("--precision tf32 needs GPUs with TF32 tensor cores (compute capability 8.0+)")
    return args.precision


def apply_precision(args):
    """Called in every process that trains (DDP ranks are fresh processes)."""
    tf32 = args.precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = args.cudnn_benchmark


def channels_last(args):
    """auto: channels_last for bf16 images on GPUs, as replica-bench's auto (CPU devices: NCHW)."""
    if len(args.shape) != 3 or args.memory_format == "nchw":
        return False
    on_gpu = args.devices.startswith("cuda")
    return args.memory_format == "channels_last" or (args.precision == "bf16" and on_gpu)


def prepare_model(model, args):
    return model.to(memory_format=torch.channels_last) if channels_last(args) else model


def batches(args, batch, seed, device, count=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.rand((batch,) + tuple(args.shape), generator=g) - 0.5
        y = torch.randint(0, 10, (batch,), generator=g)
        x = x.to(device)
        if channels_last(args):
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, y.to(device)))
    return out


def torch_device(d):
    return torch.device("cuda:%d" % d[1]) if d[0] == "cuda" else torch.device("cpu")
