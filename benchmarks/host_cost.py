"""Host cost of one neuron layer's training step: the Python and dispatch time around the kernels.

Tiny tensors on the CPU, where the kernels cost next to nothing, timed side by side in this process
(ratios, never absolute claims): MF-PSN on 'triton', on 'cpp' and on the default torch method, against
SpikingJelly's BatchNorm + PSN, PSN and LIF. The Triton rows launch nothing; how they get there:

* ``--launch compiled`` (where Triton has its CUDA backend): through the code that launches on a GPU.
  A stand-in CUDA driver (``_fake_cuda.py``) has Triton specialise and compile each kernel for sm_90 and
  drops the launches, so the rows hold Triton's per-launch Python (argument binding, cache lookup) and
  this package's; each Triton row appears twice, with the compiled kernels bound
  (``spikingjelly_mfpsn.ops.launch``) and with every launch through Triton's ``JITFunction.run``. A GPU
  adds the launcher's C code and the driver call to these.
* ``--launch interpreter`` (the default): Triton's interpreter with its run replaced by a no-op, which
  leaves out Triton's launch path.

``--network`` adds the sequential-CIFAR network's step (tiny), MF-PSN against PSN.
``benchmarks/gpu_check.py`` measures the whole step's host time on a GPU.

    python benchmarks/host_cost.py [--launch compiled] [--network] [--shape T,N,C,L] [--repeats 200]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# (read before triton is imported: argparse checks the flag again in main)
COMPILED = "--launch=compiled" in sys.argv or \
    any(a == "--launch" and b == "compiled" for a, b in zip(sys.argv, sys.argv[1:]))
if COMPILED:  # (before triton is imported by anything else)
    import _fake_cuda
    _fake_cuda.install()
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from _timing import (Flat, interleaved, layer_step, markdown_table, median, positive_int, ratio_cell,  # noqa: E402
                     shape, through_triton, train_step)
from spikingjelly.activation_based import layer, neuron, surrogate  # noqa: E402

import spikingjelly_mfpsn  # noqa: E402,F401
from spikingjelly_mfpsn import MulFreeChannelwisePSN, fuse_batchnorm, ops  # noqa: E402
from spikingjelly_mfpsn.paper import models  # noqa: E402


class StubbedTriton:
    """Triton's interpreted kernels replaced by a no-op (a finiteness flag set to 'finite')."""

    def __enter__(self):
        import triton.runtime.interpreter as interpreter
        self.cls, self.real = interpreter.InterpretedFunction, interpreter.InterpretedFunction.run

        def run(fn, *args, **kwargs):
            if "OK" in fn.arg_names:
                args[fn.arg_names.index("OK")].fill_(1)
        self.cls.run = run
        return self

    def __exit__(self, *exc):
        self.cls.run = self.real


def triton_layers(c: int) -> dict[str, nn.Module]:
    """BN- and parameter-threshold MF-PSN on 'triton', and a batch norm fused into it."""
    pair = nn.Sequential(layer.BatchNorm1d(c, step_mode="m"), MulFreeChannelwisePSN(c, k=2, step_mode="m",
                                                                                      method="triton"))
    fuse_batchnorm(pair)
    return {"MF-PSN triton, bn": MulFreeChannelwisePSN(c, k=2, step_mode="m", method="triton"),
            "MF-PSN triton, param": MulFreeChannelwisePSN(c, k=2, step_mode="m", method="triton", threshold="param"),
            "BatchNorm + MF-PSN triton, fused": pair}


THROUGH_TRITON = " (compiled, through Triton)"


def candidates(T: int, c: int) -> dict[str, nn.Module]:
    out = {}
    if "triton" in ops.names() and COMPILED:
        for name, module in triton_layers(c).items():
            out[name + " (compiled, bound)"] = module
            out[name + THROUGH_TRITON] = copy.deepcopy(module)
    elif "triton" in ops.names():
        out.update({name + " (kernels stubbed)": module for name, module in triton_layers(c).items()})
    if "cpp" in ops.names():
        out["MF-PSN cpp, bn"] = MulFreeChannelwisePSN(c, k=2, step_mode="m", method="cpp")
    out["MF-PSN shift_add, bn"] = MulFreeChannelwisePSN(c, k=2, step_mode="m", method="shift_add")
    if models.psn_available("psn"):
        out["BatchNorm + PSN"] = nn.Sequential(layer.BatchNorm1d(c, step_mode="m"), Flat(neuron.PSN(T=T)))
        out["PSN"] = Flat(neuron.PSN(T=T))
    out["LIF"] = neuron.LIFNode(step_mode="m", surrogate_function=surrogate.ATan())
    return out


def network_steps(T: int, n: int) -> dict[str, object]:
    """The sequential-CIFAR network's training step (tiny: 8 channels, 8-pixel columns, T columns, SGD
    included) with MF-PSN on 'triton' (batch norms apart, and fused), and with PSN."""
    x, y = torch.randn(T, n, 3, 8), torch.randint(0, 10, (n,))

    def step(kind, fuse=False, **kwargs):
        net = models.sequential_image_net(3, 8, 10, T=T, neuron=kind, channels=8, hidden=16, **kwargs)
        if fuse:
            fuse_batchnorm(net)
        return train_step(net, x, y)

    out = {}
    if "triton" in ops.names():
        how = " (compiled, bound)" if COMPILED else " (kernels stubbed)"
        out["MF-PSN triton" + how] = step("mfpsn", method="triton")
        out["MF-PSN triton, fused BN" + how] = step("mfpsn", method="triton", fuse=True)
        if COMPILED:
            out["MF-PSN triton" + THROUGH_TRITON] = through_triton(step("mfpsn", method="triton"))
    if models.psn_available("psn"):
        out["PSN"] = step("psn")
    return out


def timed_table(fns: dict, base: str, repeats: int, title: str) -> None:
    for fn in fns.values():  # real kernels once (lazy state, autotuning)
        fn()
    with contextlib.nullcontext() if COMPILED else StubbedTriton():
        times = interleaved(fns, repeats=repeats, warmup=20)
    base = base if base in times else next(iter(times))
    rows = [[name, f"{median(ts) * 1e6:.0f} us", ratio_cell(ts, times[base])] for name, ts in times.items()]
    print(f"{title}; ratio to {base}")
    print(markdown_table(["step", "median", f"ratio to {base}"], rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=shape, default="4,2,8,4", help="T,N,C,L")
    parser.add_argument("--repeats", type=positive_int, default=200)
    parser.add_argument("--launch", choices=("interpreter", "compiled"), default="interpreter",
                        help="how the Triton rows launch (see above); read before anything imports triton")
    parser.add_argument("--network", action="store_true",
                        help="also the sequential-CIFAR network's step (tiny), MF-PSN against PSN")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    T, n, c, m = args.shape
    x, grad = torch.randn(T, n, c, m), torch.randn(T, n, c, m)
    fns = {name: layer_step(mod, x, grad) for name, mod in candidates(T, c).items()}
    fns = {name: through_triton(fn) if name.endswith(THROUGH_TRITON) else fn for name, fn in fns.items()}
    timed_table(fns, "BatchNorm + PSN", args.repeats,
                f"host time of one layer's training step (forward + backward), X {(T, n, c, m)}, one thread")
    if args.network:
        timed_table(network_steps(T, n), "PSN", max(args.repeats // 4, 1),
                    f"host time of the sequential-CIFAR network's training step, T = {T}, batch {n}, one thread")


if __name__ == "__main__":
    main()
