"""What the exporters (:mod:`.nir`, :mod:`.onnx`) share: a network's layers in execution order, a layer's
stateless op on one step, and BatchNorm folding."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from . import deploy
from .convert import to_time_first
from .neuron import MulFreeChannelwisePSN


def layers(net: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` in execution order: nested Sequential containers (SeqToANNContainer is one) opened."""
    if isinstance(net, nn.Sequential):
        out = []
        for name, child in net.named_children():
            out += layers(child, f"{prefix}{name}.")
        return out
    return [(prefix.rstrip(".") or type(net).__name__, net)]


def per_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s stateless op on one step ``x`` (N, ...), through its torch.nn base class's forward
    (a SpikingJelly layer in multi-step mode expects a time axis)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.modules") and "forward" in cls.__dict__:
            return cls.forward(module, x)
    return module(x)


def fold_bn(weight, bias, bn: nn.modules.batchnorm._BatchNorm):
    """``(weight, bias)`` of a Conv/Linear followed by ``bn`` in eval: the BatchNorm folded in (constants)."""
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    scale = (bn.weight.detach() if bn.affine else torch.ones_like(bn.running_var)) / torch.sqrt(bn.running_var + bn.eps)
    shift = (bn.bias.detach() if bn.affine else torch.zeros_like(bn.running_mean)) - bn.running_mean * scale
    bias = torch.zeros_like(bn.running_mean) if bias is None else bias
    return weight * scale.reshape(-1, *[1] * (weight.dim() - 1)), bias * scale + shift


def bn_after(seq, i):
    """The BatchNorm right after layer ``i`` of ``seq`` (``layers``' list), or None."""
    nxt = seq[i + 1][1] if i + 1 < len(seq) else None
    return nxt if isinstance(nxt, nn.modules.batchnorm._BatchNorm) else None


def prepared(net: nn.Module) -> nn.Module:
    """A time-first, eval, folded copy of ``net``."""
    net = copy.deepcopy(net).eval()
    if any(getattr(m, "layout", "time_first") == "time_last" for m in net.modules()) or \
            getattr(net.forward, "time_first_calls", None) is not None:
        net = to_time_first(net)
    return deploy.fold(net) if any(isinstance(m, MulFreeChannelwisePSN) for m in net.modules()) else net
