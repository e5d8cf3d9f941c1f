"""Small wrapper networks, data and helpers the tests share."""
import os
import subprocess
import sys

import torch
from torch import nn


class Gained(nn.Module):
    """A network of two inputs: ``body(x * gain)``, a sequence and a gain (a number, a ``(1,)`` tensor
    or a mask shaped like the sequence)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x, gain):
        return self.body(x * gain)


def digits_sequences():
    """The digits test split (the examples' default data), column by column: (T = 8, N, 1, 8)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    _, test = train_test_split(load_digits().images, test_size=0.2, random_state=0)
    return torch.tensor(test, dtype=torch.float32).div(16).permute(2, 0, 1).unsqueeze(2)


def calibrated(net, x, steps=40):
    """``net`` with batch-norm statistics from batches of 60 of ``x``, in eval."""
    from spikingjelly.activation_based import functional
    net.train()
    with torch.no_grad():
        for i in range(steps):
            net(x[:, (i % 6) * 60:(i % 6 + 1) * 60])
            functional.reset_net(net)
    return net.eval()


class SharedPool(nn.Module):
    """Two conv-MF-PSN stages that call one pooling module each, and a readout attribute named ``output``."""

    def __init__(self):
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn import MulFreeChannelwisePSN
        super().__init__()
        self.c1, self.c2 = (layer.Conv2d(c, 2, 3, padding=1, step_mode="m") for c in (1, 2))
        self.sn1, self.sn2 = (MulFreeChannelwisePSN(2, k=k, threshold="param", v_threshold=0.05, step_mode="m")
                              for k in (2, 3))
        self.pool = layer.AvgPool2d(2, step_mode="m")
        self.output = layer.Linear(8, 3, step_mode="m")

    def forward(self, x):
        x = self.pool(self.sn1(self.c1(x)))
        return self.output(torch.flatten(self.pool(self.sn2(self.c2(x))), 2))


def shared_layers_net(names=("0", "1", "2", "3")) -> nn.Sequential:
    """One Linear and one MF-PSN, each used twice in one Sequential, under ``names``; and SpikingJelly's
    dropouts, which pass their input in eval."""
    from collections import OrderedDict
    from spikingjelly.activation_based import layer
    from spikingjelly_mfpsn import MulFreeChannelwisePSN
    torch.manual_seed(0)
    lin = layer.Linear(4, 4, step_mode="m")
    sn = MulFreeChannelwisePSN(4, k=2, threshold="param", v_threshold=0.0, step_mode="m")
    modules = [lin, sn, layer.Dropout(0.5, step_mode="m"), lin, sn]
    return nn.Sequential(OrderedDict(zip(names[:2] + ("drop",) + names[2:], modules))).eval()


def small_inputs_net() -> nn.Sequential:
    """A Linear of tiny weights into an MF-PSN of weight 2**-3 (eval): calibration on its inputs wants many
    fractional bits, more than the exact accumulator can take."""
    from spikingjelly.activation_based import layer
    from spikingjelly_mfpsn import MulFreeChannelwisePSN
    torch.manual_seed(0)
    lin = layer.Linear(3, 2, step_mode="m")
    sn = MulFreeChannelwisePSN(2, k=1, step_mode="m", threshold="param", v_threshold=-0.2)
    with torch.no_grad():
        lin.weight.mul_(0.01)
        lin.bias.zero_()
        sn.weight.fill_(0.125)
    return nn.Sequential(lin, sn).eval()


class Residual(nn.Module):
    """Conv-BN-MF-PSN twice with a residual addition, then torch.flatten, a readout and ``tail``."""

    def __init__(self, tail=None):
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn import MulFreeChannelwisePSN
        super().__init__()
        self.stem = nn.Sequential(layer.Conv1d(1, 8, 3, padding=1, bias=False, step_mode="m"),
                                  layer.BatchNorm1d(8, step_mode="m"), MulFreeChannelwisePSN(8, k=2, step_mode="m"))
        self.conv = layer.Conv1d(8, 8, 3, padding=1, bias=False, step_mode="m")
        self.bn = layer.BatchNorm1d(8, step_mode="m")
        self.sn = MulFreeChannelwisePSN(8, k=3, dilation=2, step_mode="m")
        self.fc = layer.Linear(64, 10, step_mode="m")
        self.tail = tail

    def forward(self, x):
        x = self.stem(x)
        x = x + self.sn(self.bn(self.conv(x)))
        x = self.fc(torch.flatten(x, 2))
        return self.tail(x) if self.tail is not None else x


class _ResidualBlock(nn.Module):
    def __init__(self, channels):
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn import MulFreeChannelwisePSN
        super().__init__()
        self.conv = layer.Conv1d(channels, channels, 3, padding=1, bias=False, step_mode="m")
        self.bn = layer.BatchNorm1d(channels, step_mode="m")
        self.sn = MulFreeChannelwisePSN(channels, k=2, step_mode="m")

    def forward(self, x):
        return x + self.sn(self.bn(self.conv(x)))


class SequentialResidual(nn.Sequential):
    """A residual block written as an ``nn.Sequential`` subclass: its forward adds the input back."""

    def forward(self, x):
        return x + super().forward(x)


class StandardisedConv1d(nn.Conv1d):
    """A weight-standardised convolution: a torch.nn layer whose subclass computes with another weight."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2), keepdim=True)) / (w.std(dim=(1, 2), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


def residual_sequential_subclass(tail=()):
    """:func:`residual_in_sequential` with the block a :class:`SequentialResidual`."""
    from spikingjelly.activation_based import layer
    from spikingjelly_mfpsn import MulFreeChannelwisePSN
    block = SequentialResidual(layer.Conv1d(8, 8, 3, padding=1, bias=False, step_mode="m"),
                               layer.BatchNorm1d(8, step_mode="m"), MulFreeChannelwisePSN(8, k=2, step_mode="m"))
    net = residual_in_sequential(tail)
    net[3] = block
    return net


def residual_in_sequential(tail=()):
    """A residual block nested in an nn.Sequential (as model zoos build stages), then SpikingJelly's
    Flatten, a readout and the modules ``tail``."""
    from spikingjelly.activation_based import layer
    from spikingjelly_mfpsn import MulFreeChannelwisePSN
    return nn.Sequential(layer.Conv1d(1, 8, 3, padding=1, bias=False, step_mode="m"),
                         layer.BatchNorm1d(8, step_mode="m"), MulFreeChannelwisePSN(8, k=2, step_mode="m"),
                         nn.Sequential(_ResidualBlock(8)), layer.Flatten(step_mode="m"),
                         layer.Linear(64, 10, step_mode="m"), *tail)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_compiled_trains_as_eager(net: nn.Module, x: torch.Tensor, steps: int = 2, **compile_kwargs) -> None:
    """``net`` and ``torch.compile`` of a copy of it (``compile_kwargs``), trained side by side on
    ``x + i`` for ``steps`` steps: the same spikes, dL/dX, parameter gradients and state (to rounding),
    then the same eval output."""
    import copy
    from spikingjelly.activation_based import functional
    twin = copy.deepcopy(net)
    torch._dynamo.reset()
    compiled = torch.compile(twin, **compile_kwargs)
    tol = dict(rtol=1e-5, atol=1e-6)
    try:
        for i in range(steps):
            xe, xc = (x + i).requires_grad_(), (x + i).requires_grad_()
            se, sc = net(xe), compiled(xc)
            assert torch.equal(sc, se)
            g = torch.linspace(-1, 1, se.numel(), device=se.device).view(se.shape)
            (se * g).sum().backward()
            (sc * g).sum().backward()
            torch.testing.assert_close(xc.grad, xe.grad, **tol)
            for (name, pe), pc in zip(net.named_parameters(), twin.parameters()):
                torch.testing.assert_close(pc.grad, pe.grad, **tol, msg=name)
                pe.grad = pc.grad = None
            for (name, be), bc in zip(net.state_dict().items(), twin.state_dict().values()):
                torch.testing.assert_close(bc, be, **tol, msg=name)
            functional.reset_net(net)
            functional.reset_net(twin)
        net.eval(), twin.eval()
        assert torch.equal(compiled(x), net(x))
    finally:
        torch._dynamo.reset()


def export_error_without(package: str, module: str, call: str) -> str:
    """What ``spikingjelly_mfpsn.<module>.<call>`` of a one-neuron network raises as ImportError in a
    process where ``package`` cannot be imported (its output; the traceback's end if it raised nothing)."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "import torch, torch.nn as nn, spikingjelly_mfpsn\n"
            f"from spikingjelly_mfpsn.{module} import {call}\n"
            f"try:\n    {call}(nn.Sequential(spikingjelly_mfpsn.MulFreeChannelwisePSN(1, step_mode='m')), "
            "torch.rand(3, 1, 1))\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    return out.stdout or out.stderr[-2000:]


def run_inference_example(*args) -> str:
    """The output of ``examples/mulfree_inference.py --batch 1 ARGS``, which must succeed."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mulfree_inference.py"), "--batch", "1",
                          *map(str, args)], capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


class TwoOutputs(nn.Module):
    """A forward with two outputs: spikes and their double."""

    def __init__(self):
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn import MulFreeChannelwisePSN
        super().__init__()
        self.fc, self.sn = layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m")

    def forward(self, x):
        h = self.sn(self.fc(x))
        return h, h + h


class FlattenInForward(nn.Module):
    """Conv2d, MF-PSN, then ``torch.flatten(x, start)`` in the forward, on (T, N, 1, H, W)."""

    def __init__(self, start):
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn import MulFreeChannelwisePSN
        super().__init__()
        self.start = start
        self.conv = layer.Conv2d(1, 2, 1, step_mode="m")
        self.sn = MulFreeChannelwisePSN(2, k=2, threshold="param", v_threshold=0.0, step_mode="m")

    def forward(self, x):
        return torch.flatten(self.sn(self.conv(x)), self.start)
