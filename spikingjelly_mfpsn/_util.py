"""Small helpers the package's modules share: a network's inputs, running it with recording hooks,
the device it runs on."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from . import _compat


def cache_home(*parts: str) -> str:
    """A path under ``$XDG_CACHE_HOME/spikingjelly_mfpsn`` (``~/.cache`` where that is unset or empty, as
    the XDG specification says)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spikingjelly_mfpsn",
                        *parts)


def as_args(x) -> tuple:
    """A network's positional inputs: a tuple ``x`` holds several (as ``torch.jit.trace`` takes them),
    anything else (a tensor, a list, a dict) is the one input."""
    return x if isinstance(x, tuple) else (x,)


def autocasting(x: torch.Tensor) -> bool:
    """Autocast is on for ``x``'s device (never for shape-only ``meta`` tensors, which autocast does not know)."""
    return not x.is_meta and torch.is_autocast_enabled(x.device.type)


def run_hooked(net: nn.Module, x, hooks: list) -> None:
    """Run ``net`` on input ``x`` without gradients, then remove ``hooks`` and reset the network.

    ``hooks`` are those that recorded the run; resetting clears the network's state.
    """
    try:
        with torch.no_grad():
            net(*as_args(x))
    finally:
        for h in hooks:
            h.remove()
        _compat.functional.reset_net(net)


@contextlib.contextmanager
def modes_kept(net: nn.Module):
    """Put every module's own train/eval flag back on leaving.

    ``net.train(flag)`` would set them all to one: a frozen batch norm, kept in eval inside a training
    network, would train again."""
    modes = [(m, m.training) for m in net.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def module_slots(net: nn.Module) -> list:
    """Every ``(parent, name, child)`` place in ``net`` that holds a module.

    A module used at several places is listed at each; the list is made first, so the caller may
    replace children while walking it."""
    return [(parent, name, child) for parent in net.modules()
            for name, child in parent._modules.items() if child is not None]


def tensors(x) -> list:
    """The tensors of a network's input or output: ``x`` itself, or those inside tuples, lists and dicts
    (a batch given as a dict included)."""
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def device_type(ts: list) -> str:
    """The device type of the first of tensors ``ts`` ('cpu' for none)."""
    return ts[0].device.type if ts else "cpu"


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree(a, b, mismatch: float = 1e-3) -> bool:
    """Outputs agree up to float reordering: near-threshold spikes may flip in a tiny fraction. Outputs
    may be tensors or tuples, lists and dicts of them (other values must be equal)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return False
        close = torch.isclose(a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True)
        return bool((~close).float().mean() <= mismatch)
    if isinstance(a, (tuple, list)):  # (lists of any list class: fx's graphs give immutable ones)
        same = isinstance(b, list) if isinstance(a, list) else type(a) is type(b)
        return same and len(a) == len(b) and all(agree(x, y, mismatch) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(agree(a[k], b[k], mismatch) for k in a)
    try:
        return not isinstance(b, torch.Tensor) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. arrays, whose == is element-wise
        return False
