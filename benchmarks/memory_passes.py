"""Passes over memory of one training step (forward + backward) of the neuron, per implementation.

A pass is reading or writing one tensor of the size of the input X. PyTorch operators are counted
as they run (a ``TorchDispatchMode``: every non-view operator reads each tensor argument once and
writes each result once, broadcast arguments counted by their storage); every Triton launch is
counted by one rule, from what its kernel declares it reads and writes (``triton_ops.TRAFFIC``: each
tensor it loads is read once -- the k shifted loads of one tile hit the cache -- and each tensor it
stores is written once; a launch of a kernel that declares nothing is an error), a C++ kernel
(backend 'cpp') likewise. Tensors of parameter size are included
but amount to a few hundredths of a pass.

Run on the CPU through Triton's interpreter::

    TRITON_INTERPRET=1 python benchmarks/memory_passes.py
"""
from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import spikingjelly_mfpsn  # noqa: E402,F401
from spikingjelly.activation_based import neuron  # noqa: E402
from spikingjelly_mfpsn import ops  # noqa: E402
from spikingjelly_mfpsn.neuron import FusedBatchNorm  # noqa: E402

from _timing import shape  # noqa: E402

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "promote_types",
        "result_type",
        "lift_fresh", "_local_scalar_dense", "set_", "resize_"}
WRITE_ONLY = {"fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros"}


def _bytes(t: torch.Tensor) -> int:
    """Bytes really stored: an expanded (broadcast) tensor only holds its storage."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Traffic(TorchDispatchMode):
    """Adds up bytes read and written by PyTorch operators (and Triton kernels: :func:`count_triton`)."""

    def __init__(self):
        super().__init__()
        self.read = self.written = 0
        self.launches = 0  # operators that run a kernel (neither views nor allocations) and Triton launches
        self.paused = False
        self.extra = None  # (name, args, out) -> (more bytes read, more written), for fused operators

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in FREE:
            self.launches += 1  # an operator that runs a kernel
            if name not in WRITE_ONLY:
                self.read += sum(_bytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.written += sum(_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            if self.extra is not None:
                more_read, more_written = self.extra(name, args, out)
                self.read, self.written = self.read + more_read, self.written + more_written
        return out


def _declared(entries, args: dict) -> list:
    """The tensors of a launch that a ``TRAFFIC`` entry names (``"NAME"``, ``"NAME if FLAG"`` or ``"NAME if
    not FLAG"``)."""
    out = []
    for entry in entries:
        name, _, cond = entry.partition(" if ")
        negate = cond.startswith("not ")
        flag = cond[4:] if negate else cond
        if not cond or bool(args[flag]) != negate:
            out.append(args[name])
    return out


@contextlib.contextmanager
def count_triton(mode: Traffic):
    """Count every Triton launch into ``mode`` by one rule: what its kernel declares it reads and writes
    (``triton_ops.TRAFFIC``), never the interpreter's own copies. A launch of a kernel that declares
    nothing raises: it could not be counted."""
    from spikingjelly_mfpsn.ops import launch, triton_ops
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    cls = interpreter.InterpretedFunction if triton_ops.INTERPRETED else jit.JITFunction
    real = cls.run

    def run(self, *args, **kwargs):
        name = self.fn.__name__
        if name not in triton_ops.TRAFFIC:
            raise RuntimeError(f"a launch of the Triton kernel {name} cannot be counted: it declares no traffic "
                               f"in triton_ops.TRAFFIC")
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        reads, writes = triton_ops.TRAFFIC[name]
        mode.read += sum(map(_bytes, _declared(reads, named)))
        mode.written += sum(map(_bytes, _declared(writes, named)))
        mode.launches += 1
        mode.paused = True  # the interpreter's own host copies are not the kernel's traffic
        try:
            return real(self, *args, **kwargs)
        finally:
            mode.paused = False

    cls.run = run
    bind, launch.BIND = launch.BIND, False  # every launch through Triton's run, where it is counted
    try:
        yield mode
    finally:
        cls.run, launch.BIND = real, bind


def _cpp_bn_sweeps(name: str, args, out) -> tuple[int, int]:
    """The sweeps of backend 'cpp''s fused BN-threshold operators beyond the one read of each argument and
    the one write of each result that :class:`Traffic` counts: the forward reads X twice (the statistics'
    sweep, then the spikes'), the backward reads X twice too (the spikes' backward, then the statistics',
    which adds to dL/dX: reads and writes it again), unless the statistics were given (eval)."""
    if name == "cpp_bn_forward" and args[6] is None:
        return _bytes(args[0]), 0
    if name == "cpp_bn_backward" and not args[14]:
        return _bytes(args[0]) + _bytes(out[0]), _bytes(out[0])
    return 0, 0


@contextlib.contextmanager
def count_cpp(mode: Traffic):
    """Count the C++ operators (backend 'cpp') into ``mode``: they run through the dispatcher, so
    :class:`Traffic` sees each (a forward reads X once and writes its output, none for the batch
    statistics; a backward reads X and dL/dS or dL/dH and writes dL/dX), plus the fused BN operators'
    second sweeps (:func:`_cpp_bn_sweeps`). Each step of a sweep loads one input row: the taps read a
    window of earlier inputs kept in registers."""
    mode.extra = _cpp_bn_sweeps
    try:
        yield mode
    finally:
        mode.extra = None


class BatchNormLayer(nn.BatchNorm2d):
    """A batch norm over every axis of a sequence but the channels, as a separate layer in front of the
    neuron (SpikingJelly's ``layer.BatchNorm`` in multi-step mode)."""

    def __init__(self, channels: int, layout: str):
        super().__init__(channels)
        self.layout = layout

    def forward(self, x):
        y = x.flatten(0, 1) if self.layout == "time_first" else x
        y = y.flatten(2).unsqueeze(-1)  # (samples, C, features, 1)
        return super().forward(y).view(x.shape)


def step_passes(method: str, layout: str, threshold: str, shape, k: int = 2,
                strided: bool = False, input_bn: str = "none") -> tuple[float, float, int, int]:
    """(forward passes, backward passes, forward launches, backward launches) of one training step of the
    neuron with ``method``: a launch is a PyTorch operator that runs a kernel (neither a view nor an
    allocation) or a Triton kernel. ``strided``: X is a view stored in the other layout's order (time
    first stored time-last, or the reverse), which a method that reads strides takes without a copy.
    ``input_bn``: ``'layer'``, a batch norm layer in front of the neuron (counted with it), or ``'fused'``,
    that batch norm applied by the neuron (``functional.fuse_batchnorm``)."""
    torch.manual_seed(0)
    backend = ops.get(method).backend
    channels = shape[ops.channel_dim(layout)]
    sn = neuron.MulFreeChannelwisePSN(channels, k=k, dilation=1, step_mode="m",
                                      layout=layout, threshold=threshold, backend=backend, method=method)
    if input_bn == "fused":  # (as in its network: the fused batch norm passes X on, the neuron normalises it)
        sn.set_input_bn(FusedBatchNorm.fuse(BatchNormLayer(channels, layout)))
        sn = nn.Sequential(sn.input_bn, sn)
    elif input_bn == "layer":
        sn = nn.Sequential(BatchNormLayer(channels, layout), sn)
    if strided:  # the time axis moved to the other end of the storage
        order = list(range(1, len(shape))) + [0] if layout == "time_first" else [len(shape) - 1] + list(range(len(shape) - 1))
        stored = torch.randn([shape[i] for i in order])
        x = stored.permute([order.index(i) for i in range(len(shape))]).requires_grad_()
        assert tuple(x.shape) == tuple(shape) and not x.is_contiguous()
    else:
        x = torch.randn(shape, requires_grad=True)
    g = torch.randn(shape)
    sn(x).backward(g)  # warm-up (lazy state, autotuning)
    sn.zero_grad(set_to_none=True)  # as optimizer.zero_grad() leaves them: a step's gradients are new tensors
    x.grad = None  # (x stands for an activation, whose gradient is not accumulated)

    def passes(fn):
        counter = {"triton": count_triton, "cpp": count_cpp}.get(backend)
        with Traffic() as mode, (counter(mode) if counter else contextlib.nullcontext()):
            out = fn()
        return (mode.read + mode.written) / _bytes(x), mode.launches, out

    fwd, fwd_launches, s = passes(lambda: sn(x))
    # The gradients of X and the parameters as the step produces them: X stands for an activation, whose
    # gradient autograd hands on rather than accumulates (into a strided leaf it would copy it first).
    params = list(sn.parameters())
    bwd, bwd_launches, _ = passes(lambda: torch.autograd.grad(s, [x, *params], g))
    return fwd, bwd, fwd_launches, bwd_launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=shape, default="16,8,16,64", help="T,N,C,M (time-first order)")
    args = parser.parse_args()
    t, n, c, m = args.shape
    shapes = {"time_first": (t, n, c, m), "time_last": (n, c, m, t)}
    print(f"passes over an X-sized tensor and kernel launches, one training step, k=2, X {shapes['time_first']} "
          f"(time-first order)")
    print(f"{'layout':<11} {'method':<12} {'threshold':<9} {'forward':>8} {'backward':>9} {'total':>6} {'launches':>9}")
    for layout in ops.LAYOUTS:
        for method in ops.names(layout=layout):
            for threshold in ("param", "bn"):
                f, b, lf, lb = step_passes(method, layout, threshold, shapes[layout])
                print(f"{layout:<11} {method:<12} {threshold:<9} {f:8.1f} {b:9.1f} {f + b:6.1f} {lf + lb:9d}")
    print("\nwith the batch norm in front of the neuron: a separate layer, or fused (functional.fuse_batchnorm)")
    print(f"{'layout':<11} {'method':<12} {'input bn':<9} {'forward':>8} {'backward':>9} {'total':>6} {'launches':>9}")
    for layout in ops.LAYOUTS:
        for method in ops.names(layout=layout):
            for input_bn in ("layer", "fused"):
                f, b, lf, lb = step_passes(method, layout, "bn", shapes[layout], input_bn=input_bn)
                print(f"{layout:<11} {method:<12} {input_bn:<9} {f:8.1f} {b:9.1f} {f + b:6.1f} {lf + lb:9d}")


if __name__ == "__main__":
    main()
