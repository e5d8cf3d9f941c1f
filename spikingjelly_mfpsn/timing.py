"""What autoselect times and how: the layers of a network, each layer's candidate methods in the order
they are timed, their inputs captured from a forward pass, and :func:`measure` (forward and backward,
device synchronised)."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Optional

import torch
import torch.nn as nn

from . import _compat, ops
from ._util import run_hooked, sync, tensors

# A candidate whose timed runs all took more than this many times the best time so far is no longer
# timed (at least one timed run each: the first run may pay one-off costs).
ABANDON = 2.0


def is_tunable(m: nn.Module) -> bool:
    """A layer with a choice of implementations: a settable ``method`` and ``supported_methods``."""
    return hasattr(m, "supported_methods") and hasattr(m, "method")


def layers(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers autoselect times, as ``(name, module)`` pairs.

    These are the tunable modules and stateful modules (neurons), not descended into, and every other leaf
    module.
    """
    if is_tunable(net):
        return [("", net)]  # (a network that is itself one tunable layer, e.g. a neuron)
    out, skip = [], []
    for name, m in net.named_modules():
        if m is net or any(name.startswith(p + ".") for p in skip):
            continue
        if is_tunable(m) or isinstance(m, _compat.MemoryModule):
            out.append((name, m))
            skip.append(name)
        elif not m._modules:
            out.append((name, m))
    return out


def candidates(m: nn.Module) -> list[str]:
    """The methods autoselect may time for layer ``m``.

    Args:
        m: a layer, as listed by :func:`layers`.

    Returns:
        Its ``candidate_methods`` (or, without them, its ``supported_methods``); ``['-']`` for a layer that
        is not tunable (no choice of implementations).
    """
    if not is_tunable(m):
        return ["-"]
    return list(getattr(m, "candidate_methods", None) or m.supported_methods)


def ordered(m: nn.Module, args: tuple) -> list[str]:
    """Candidates, the likely fastest first: a good first time lets slow ones be abandoned early.

    First the fused kernels of a non-torch backend (on the CPU 'cpp', fastest in nearly every
    configuration of the speed suite), then the layer's own default, then the rest."""
    cands = candidates(m)
    resolve = getattr(m, "resolve_method", None)
    if resolve is not None and args and isinstance(args[0], torch.Tensor):
        with contextlib.suppress(Exception), _method(m, "auto"):
            first = resolve(args[0])
            if first in cands:
                cands.remove(first)
                cands.insert(0, first)
    if is_tunable(m) and getattr(m, "candidate_methods", None):
        fused = [c for c in cands if c in ops.names() and ops.get(c).backend != "torch"]
        cands = fused + [c for c in cands if c not in fused]
    return cands


@contextlib.contextmanager
def _method(m: nn.Module, method: str):
    """Run with ``m.method = method``, then restore it. A method of another backend switches a
    neuron's backend, so the backend is restored too."""
    if method == "-":
        yield
        return
    old, old_backend = m.method, getattr(m, "backend", None)
    m.method = method
    try:
        yield
    finally:
        if old_backend is not None and m.backend != old_backend:
            m.backend = old_backend
        m.method = old


def _clone(a, grad: bool):
    """A copy of an input; one that requires grad is not a leaf, as a layer's input inside a network is
    not (an in-place layer, e.g. ``ReLU(inplace=True)``, refuses a leaf)."""
    if not isinstance(a, torch.Tensor):
        return a
    if grad and a.is_floating_point():
        return a.detach().requires_grad_().clone()
    return a.detach().clone()


def _clone_args(args, grad: bool = True):
    return tuple(_clone(a, grad) for a in args)


def capture_inputs(net: nn.Module, x, mods: list[tuple[str, nn.Module]]) -> dict[str, tuple[tuple, dict]]:
    """The positional and keyword inputs each of ``mods`` gets in a forward of ``net`` on ``x`` (its
    first call's)."""
    seen: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    for name, m in mods:
        def hook(mod, args, kwargs, name=name):
            if name not in seen:
                seen[name] = _clone_args(args, grad=False), {k: _clone(v, False) for k, v in kwargs.items()}
        # (what the module takes from outside: a fallback island moves T inside its forward)
        hooks.append(m.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
    run_hooked(net, x, hooks)
    return seen


class _SeedGradient(torch.autograd.Function):
    """``_SeedGradient.apply(out, grad).backward()`` runs the backward of ``out.backward(grad)``.

    A scalar backward skips torch's check of an explicit gradient, whose first call in a process
    imports sympy (about half a second that a training loop, backward from a scalar loss, never pays)."""

    @staticmethod
    def forward(ctx, out, grad):
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.grad, None


def measure(module: nn.Module, args: tuple, m: int, timer: Callable[[], float] = time.perf_counter,
            abandon_above: float = math.inf, input_grad: bool = True, kwargs: Optional[dict] = None) -> float:
    """Mean forward + backward time (seconds) of ``module(*args, **kwargs)``.

    The mean is over the last ``m`` of ``2m`` timed runs, after a warm-up run (which may pay one-off costs,
    and is never timed).

    The backward gets a gradient of ones of the output's shape (of each tensor of a structured output:
    tuples, lists, dicts; made once, outside the timed region; no
    kernel's work depends on the gradient's values, and drawing random ones is a visible part of a
    cold autoselect).
    Once every timed run so far was slower than ``abandon_above``, the measurement ends early and returns
    the fastest of them: the candidate is already known to lose. A single slow run (noise only ever slows
    a run down) does not end it, except the first. A run whose forward alone settles that skips its
    backward, and counts with its forward time (so an abandoned candidate's time is a lower bound). A
    warm-up whose forward alone is slower than ``abandon_above`` skips its backward too: the next forward,
    free of one-off costs, either loses as well (the candidate is abandoned after two forwards) or warms
    up the backward.
    ``input_grad``: the inputs require grad (a layer inside a network); ``False`` for a whole
    network fed data. With gradients disabled (``torch.no_grad()``, ``torch.inference_mode()``), the
    forward alone is timed: what an inference loop runs.
    """
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    backward = torch.is_grad_enabled()
    times, z, warm, slow_warmups = [], None, False, 0
    while len(times) < 2 * m:
        inputs = _clone_args(args, input_grad and backward)
        keywords = {k: _clone(v, input_grad and backward) for k, v in (kwargs or {}).items()}
        _compat.functional.reset_net(module)
        t0 = timer()
        out = module(*inputs, **keywords)
        sync(device)
        elapsed = timer() - t0
        lost = min(times + [elapsed]) > abandon_above  # lost, whatever its backward takes (no times yet: warm-up)
        if not warm:
            slow_warmups += lost
            if slow_warmups == 2:  # a second forward, without one-off costs, lost as well
                break
        outs = [t for t in tensors(out) if t.requires_grad]
        if not lost and backward and outs:
            if z is None or [t.shape for t in z] != [t.shape for t in outs]:
                z = [torch.ones_like(t) for t in outs]
            seed = sum(_SeedGradient.apply(t, g) for t, g in zip(outs, z))
            t2 = timer()
            seed.backward()
            sync(device)
            elapsed += timer() - t2
        if not warm:
            warm = not lost or not backward  # (without gradients, a forward is the whole run)
            continue
        times.append(elapsed)
        if min(times) > abandon_above:
            break
    _compat.functional.reset_net(module)
    if len(times) < 2 * m:  # abandoned
        return min(times) if times else elapsed
    return sum(times[-m:]) / m


def timed(measure_fn: Callable, module: nn.Module, args: tuple, m: int, **options) -> float:
    """``measure_fn(module, args, m)`` in seconds; :func:`measure` gets ``options`` too."""
    return measure(module, args, m, **options) if measure_fn is measure else float(measure_fn(module, args, m))


@contextlib.contextmanager
def _after_input_bn(module: nn.Module):
    """A neuron that applies a fused batch norm runs after it, as in its network (the batch norm passes X on;
    the neuron refuses to apply one that did not run)."""
    bn = getattr(module, "input_bn", None)

    def run_bn(_, args) -> None:
        bn(*args)

    hook = None if bn is None else module.register_forward_pre_hook(run_bn)
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


def time_candidates(module: nn.Module, inputs: tuple[tuple, dict], m: int, measure_fn: Callable,
                    skipped: list[str], where: str) -> dict[str, float]:
    """Seconds of each of ``module``'s candidates on ``inputs`` (positional and keyword), timed in
    :func:`ordered` order; one that cannot run takes ``inf``, and its error goes to ``skipped`` (as
    ``where/candidate: error``). :func:`measure` stops timing a candidate once it clearly loses
    (``ABANDON`` times the best so far); a ``measure_fn`` of the caller's gets the positional inputs."""
    args, kwargs = inputs
    times: dict[str, float] = {}
    for c in ordered(module, args):
        best = min(times.values(), default=math.inf)
        with _method(module, c), _after_input_bn(module):
            try:
                times[c] = timed(measure_fn, module, args, m, abandon_above=ABANDON * best, kwargs=kwargs)
            except Exception as e:  # noqa: BLE001  (a candidate that cannot run is skipped)
                times[c] = math.inf
                skipped.append(f"{where}/{c}: {type(e).__name__}: {e}")
    return times
