"""Side-by-side timing for the benchmark scripts: every candidate runs in the same process, interleaved
round by round, so machine noise hits all of them alike; results are medians with their spread."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a bad value is refused by argparse, naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def shape(text: str) -> tuple[int, int, int, int]:
    """An argparse ``type``: four ints >= 1 separated by commas (a shape such as ``T,N,C,L``)."""
    parts = text.split(",")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"expected four sizes such as 4,2,8,4, got {text!r}")
    return tuple(positive_int(v) for v in parts)


def out_folder(text: str) -> str:
    """An argparse ``type``: a folder to write into (made where missing); not an existing file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text


def sync(device: torch.device | str = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                device="cpu") -> dict[str, list[float]]:
    """Seconds of each ``fns[name]()`` call: ``warmup`` untimed rounds, then ``repeats`` rounds, each
    round running every candidate once in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median(ts: list[float]) -> float:
    return statistics.median(ts)


def spread(ts: list[float]) -> float:
    """Relative spread of a list of times: (max - min) / median."""
    return (max(ts) - min(ts)) / statistics.median(ts)


def ratio_cell(num: list[float], den: list[float]) -> str:
    """``median(num) / median(den)`` with the spread of the two, e.g. ``3.12 ±4%``."""
    r = median(num) / median(den)
    return f"{r:.2f} ±{100 * max(spread(num), spread(den)):.0f}%"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} "
            f"thread(s)")


class Flat(nn.Module):
    """(T, N, C, L) <-> (T, N, C * L) around a neuron that takes (T, N, features), such as SpikingJelly's PSN."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.flatten(2)).view_as(x)


def train_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One SGD training step of a classifier over time steps (scores averaged over T), then a reset."""
    import torch.nn.functional as F
    from spikingjelly.activation_based import functional
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def run():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x).mean(0), y).backward()
        opt.step()
        functional.reset_net(net)
    return run


def through_triton(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with every Triton launch through Triton's ``JITFunction.run`` (the package's binding of
    compiled kernels off: ``spikingjelly_mfpsn.ops.launch.BIND``)."""
    def run():
        from spikingjelly_mfpsn.ops import launch
        bind, launch.BIND = launch.BIND, False
        try:
            step()
        finally:
            launch.BIND = bind
    return run


def layer_step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One training step of a layer: forward on a fresh leaf copy of ``x``, backward with ``grad``, reset."""
    from spikingjelly.activation_based import functional

    def run():
        xi = x.detach().requires_grad_()
        module(xi).backward(grad)
        functional.reset_net(module)
    return run
