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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import spikingjelly_mfpsn  # noqa: E402,F401
from spikingjelly.activation_based import neuron  # noqa: E402
from spikingjelly_mfpsn import ops  # noqa: E402

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in FREE:
            self.launches += 1  # an operator that runs a kernel
            if name not in WRITE_ONLY:
                self.read += sum(_bytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.written += sum(_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
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
    from spikingjelly_mfpsn.ops import triton_ops
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
    try:
        yield mode
    finally:
        cls.run = real


@contextlib.contextmanager
def count_cpp(mode: Traffic):
    """Count the C++ kernels (backend 'cpp') into ``mode``: a forward reads X once and writes its output
    (none for the batch statistics); a backward reads X, and dL/dS or dL/dH unless it is the
    statistics' backward, and writes dL/dX (reading it too when it adds to it). Each step of a sweep
    loads one input row: the taps read a window of earlier inputs kept in registers."""
    from spikingjelly_mfpsn.ops import cpp_ops
    real_fwd, real_bwd = cpp_ops.forward, cpp_ops.backward

    def forward(x, weight, bias, dilation, layout, spike=False, stats=False):
        mode.read += _bytes(x)
        out = real_fwd(x, weight, bias, dilation, layout, spike=spike, stats=stats)
        mode.written += 0 if stats else _bytes(out)
        return out

    def backward(x, weight, bias, grad, *args, add_to=None):
        mode.read += _bytes(x) + (_bytes(grad) if grad is not None else 0)
        mode.read += _bytes(add_to) if add_to is not None else 0  # dL/dX added to what it holds
        gx, gw, gb = real_bwd(x, weight, bias, grad, *args, add_to=add_to)
        mode.written += _bytes(gx) if gx is not None else 0
        return gx, gw, gb

    # The BN-threshold training node: forward, the statistics' sweep and the spikes' (reads X twice,
    # writes S); backward, the spikes' backward (reads X and dL/dS, writes dL/dX), then the statistics'
    # (reads X, adds to dL/dX: reads and writes it).
    real_bn_fwd, real_bn_bwd = cpp_ops.bn_forward, cpp_ops.bn_backward

    def bn_forward(x, *args):
        out = real_bn_fwd(x, *args)
        mode.read += 2 * _bytes(x)
        mode.written += _bytes(out[0])
        return out

    def bn_backward(x, *args):
        gx, *rest = real_bn_bwd(x, *args)
        grad = args[6]
        mode.read += 2 * _bytes(x) + _bytes(grad) + (_bytes(gx) if gx is not None else 0)
        mode.written += 2 * _bytes(gx) if gx is not None else 0
        return (gx, *rest)

    cpp_ops.forward, cpp_ops.backward = forward, backward
    cpp_ops.bn_forward, cpp_ops.bn_backward = bn_forward, bn_backward
    # The C++ autograd node calls the same kernels from C++, where they cannot be counted: count its
    # Python counterpart, which makes the same calls.
    real_node = cpp_ops.node
    cpp_ops.node = lambda dtype: None
    try:
        yield mode
    finally:
        cpp_ops.forward, cpp_ops.backward = real_fwd, real_bwd
        cpp_ops.bn_forward, cpp_ops.bn_backward = real_bn_fwd, real_bn_bwd
        cpp_ops.node = real_node


def step_passes(method: str, layout: str, threshold: str, shape, k: int = 2) -> tuple[float, float, int, int]:
    """(forward passes, backward passes, forward launches, backward launches) of one training step of the
    neuron with ``method``: a launch is a PyTorch operator that runs a kernel (neither a view nor an
    allocation) or a Triton kernel."""
    torch.manual_seed(0)
    backend = ops.get(method).backend
    sn = neuron.MulFreeChannelwisePSN(shape[ops.channel_dim(layout)], k=k, dilation=1, step_mode="m",
                                      layout=layout, threshold=threshold, backend=backend, method=method)
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
    bwd, bwd_launches, _ = passes(lambda: s.backward(g))
    return fwd, bwd, fwd_launches, bwd_launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="16,8,16,64", help="T,N,C,M (time-first order)")
    args = parser.parse_args()
    t, n, c, m = (int(v) for v in args.shape.split(","))
    shapes = {"time_first": (t, n, c, m), "time_last": (n, c, m, t)}
    print(f"passes over an X-sized tensor and kernel launches, one training step, k=2, X {shapes['time_first']} "
          f"(time-first order)")
    print(f"{'layout':<11} {'method':<12} {'threshold':<9} {'forward':>8} {'backward':>9} {'total':>6} {'launches':>9}")
    for layout in ops.LAYOUTS:
        for method in ops.names(layout=layout):
            for threshold in ("param", "bn"):
                f, b, lf, lb = step_passes(method, layout, threshold, shapes[layout])
                print(f"{layout:<11} {method:<12} {threshold:<9} {f:8.1f} {b:9.1f} {f + b:6.1f} {lf + lb:9d}")


if __name__ == "__main__":
    main()
