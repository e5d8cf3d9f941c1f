"""One-call utilities on whole networks: switch neurons, choose backends and methods.

``replace_neurons``, ``set_backend``, ``set_method`` and ``autoselect`` are also added to
``spikingjelly.activation_based.functional`` when SpikingJelly does not define those names itself.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from . import _compat, ops
from ._util import run_hooked
from .neuron import MulFreeChannelwisePSN

logger = _compat.logger


def _check_count(value, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def sawtooth_dilation(index: int, period: int = 3) -> int:
    """Dilation of the ``index``-th (0-based) spiking-neuron layer (paper Eq. 4:
    ``d^0 = 1, d^{l+1} = d^l mod 3 + 1``): 1, 2, 3, 1, 2, 3, ..."""
    _check_count(index, "index", 0)
    _check_count(period, "period", 1)
    return index % period + 1


def sawtooth(n: int, period: int = 3) -> list[int]:
    """The first ``n`` sawtooth dilations: 1, 2, 3, 1, 2, 3, ..."""
    _check_count(n, "n", 0)
    _check_count(period, "period", 1)
    return [sawtooth_dilation(i, period) for i in range(n)]


@dataclass
class Replacement:
    name: str
    old: str
    channels: Optional[int]
    k: int
    dilation: int
    step_mode: str


@dataclass
class ReplaceSummary:
    """What ``replace_neurons`` did, one row per replaced neuron, in the order the neurons run."""

    rows: list[Replacement] = field(default_factory=list)
    order: str = "registration"

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __str__(self) -> str:
        head = f"replaced {len(self.rows)} neuron(s) with MulFreeChannelwisePSN (order: {self.order})"
        lines = [head, f"{'module':<32} {'was':<20} {'C':>5} {'k':>3} {'d':>3} step"]
        for r in self.rows:
            c = "lazy" if r.channels is None else str(r.channels)
            lines.append(f"{r.name or '<net>':<32} {r.old:<20} {c:>5} {r.k:>3} {r.dilation:>3} {r.step_mode}")
        return "\n".join(lines)


def _is_target(targets, name: str, module: nn.Module) -> bool:
    if isinstance(module, MulFreeChannelwisePSN):
        return False
    if callable(targets) and not isinstance(targets, type):
        return bool(targets(name, module))
    return isinstance(module, targets)


def _device_dtype(net: nn.Module, module: nn.Module, example_input) -> tuple:
    for t in list(module.parameters()) + list(module.buffers()) + list(net.parameters()):
        if t.is_floating_point():
            return t.device, t.dtype
    if isinstance(example_input, torch.Tensor):
        return example_input.device, (example_input.dtype if example_input.is_floating_point()
                                      else torch.get_default_dtype())
    return torch.device("cpu"), torch.get_default_dtype()


def _run_order(net: nn.Module, modules: list[nn.Module], example_input) -> dict[int, int]:
    """Input channel count of each module in ``modules``, keyed by id, in the order they run."""
    seen: dict[int, int] = {}

    def hook(mod, args):
        if id(mod) not in seen and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            step = getattr(mod, "step_mode", "s")
            seen[id(mod)] = x.shape[2 if step == "m" and x.dim() >= 3 else 1] if x.dim() >= 2 else x.shape[0]

    was_training = net.training
    net.eval()
    try:
        run_hooked(net, example_input, [m.register_forward_pre_hook(hook) for m in modules])
    finally:
        net.train(was_training)
    return seen


def replace_neurons(net: nn.Module, k: int = 2, dilation: Union[str, int] = "sawtooth",
                    targets: Union[type, tuple, Callable, None] = None, example_input=None,
                    **neuron_kwargs) -> tuple[nn.Module, ReplaceSummary]:
    """Swap spiking neurons in ``net`` for :class:`MulFreeChannelwisePSN`, in place.

    :param net: a SpikingJelly network (``net`` itself may be a neuron; the new neuron is returned)
    :param k: order of the new neurons
    :param dilation: ``'sawtooth'`` (1, 2, 3, 1, 2, 3, ... in the order the neurons run) or an int
    :param targets: neuron classes (a class or tuple) or a predicate ``(name, module) -> bool``;
        default: every spiking neuron class SpikingJelly defines (IF, LIF, ParametricLIF, PSN family...)
    :param example_input: optional input for ``net`` (a tuple holds several positional inputs); when
        given, neurons are ordered as they run in a forward pass and get their channel count from it,
        otherwise registration order and lazy channels
    :param neuron_kwargs: passed to :class:`MulFreeChannelwisePSN` (``threshold``, ``quantize``, ...)
    :return: ``(net, summary)``; each new neuron keeps the old one's ``step_mode``, surrogate function
        (where it had one, unless ``surrogate_function`` is given), device and dtype
    """
    if targets is None:
        targets = _compat.spiking_neuron_classes()
    if dilation != "sawtooth" and (not isinstance(dilation, int) or dilation < 1):
        raise ValueError(f"dilation must be 'sawtooth' or an int >= 1, got {dilation!r}")
    # (named_modules visits a module registered at several places once.)
    found = [(name, m) for name, m in net.named_modules() if _is_target(targets, name, m)]
    channels, order = {}, "registration"
    if example_input is not None and found:
        channels = _run_order(net, [m for _, m in found], example_input)
        ranked = {mid: i for i, mid in enumerate(channels)}
        found.sort(key=lambda nm: ranked.get(id(nm[1]), len(ranked)))
        order = "forward"
    dilations = sawtooth(len(found)) if dilation == "sawtooth" else [dilation] * len(found)

    summary = ReplaceSummary(order=order)
    new_of: dict[int, MulFreeChannelwisePSN] = {}
    for (name, old), d in zip(found, dilations):
        kwargs = dict(neuron_kwargs)
        if "surrogate_function" not in kwargs and isinstance(getattr(old, "surrogate_function", None), nn.Module):
            kwargs["surrogate_function"] = copy.deepcopy(old.surrogate_function)
        step_mode = kwargs.pop("step_mode", getattr(old, "step_mode", "s"))
        device, dtype = _device_dtype(net, old, example_input)
        new_of[id(old)] = MulFreeChannelwisePSN(channels=channels.get(id(old)), k=k, dilation=d, step_mode=step_mode,
                                                **kwargs).to(device=device, dtype=dtype)
        summary.rows.append(Replacement(name, type(old).__name__, channels.get(id(old)), k, d, step_mode))

    if id(net) in new_of:
        return new_of[id(net)], summary
    for parent in net.modules():
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_of:
                setattr(parent, child_name, new_of[id(child)])
    _compat.invalidate_reset_cache(net)
    return net, summary


def set_backend(net: nn.Module, backend: str, instance=(nn.Module,)) -> nn.Module:
    """Set ``backend`` on every module of type ``instance`` that has one and supports it.

    Modules that do not support ``backend`` are logged and skipped (SpikingJelly 0.0.0.0.14 style).
    """
    for m in net.modules():
        if not isinstance(m, instance) or not hasattr(m, "backend") or not hasattr(m, "supported_backends"):
            continue
        if backend in m.supported_backends:
            try:
                m.backend = backend
            except (ImportError, NotImplementedError, ValueError) as e:  # library missing at run time
                logger.warning("%s cannot use backend=%r (%s); it keeps backend=%r",
                               type(m).__name__, backend, e, m.backend)
        else:
            logger.warning("%s does not support backend=%r; it keeps backend=%r",
                           type(m).__name__, backend, m.backend)
    return net


def set_method(net: nn.Module, method: str, layout: Optional[str] = None, instance=(nn.Module,)) -> nn.Module:
    """Set ``method`` on every module of type ``instance`` whose ``supported_methods`` (or, for MF-PSN
    neurons, ``candidate_methods``: a method of another available backend, which switches the neuron's
    backend too) has it.

    ``'auto'`` is accepted by every such module; others are logged and skipped. With ``layout``, the
    network is first converted to that layout (:func:`~spikingjelly_mfpsn.to_time_last` /
    :func:`~spikingjelly_mfpsn.to_time_first`, sharing parameters). Returns the network (use the
    return value: a network that is a single layer may come back wrapped).
    """
    if layout is not None:
        from .convert import current_layout, to_time_first, to_time_last
        ops.check_layout(layout)
        if current_layout(net) != layout:
            net = to_time_last(net) if layout == "time_last" else to_time_first(net)
    for m in net.modules():
        supported = getattr(m, "supported_methods", None) if isinstance(m, instance) else None
        if supported is None:
            continue
        supported = list(supported) + [c for c in getattr(m, "candidate_methods", ()) if c not in supported]
        if method == "auto" or method in supported:
            m.method = method
        else:
            logger.warning("%s does not support method=%r (it supports %s); it keeps method=%r",
                           type(m).__name__, method, list(supported), m.method)
    return net


def autoselect(net: nn.Module, x_example, m: int = 2, layouts=("time_first", "time_last"), cache=True, **kwargs):
    """Paper Algorithm 1: time every layer's implementations in each layout and apply the fastest.
    See :func:`spikingjelly_mfpsn.tuner.autoselect`."""
    from .tuner import autoselect as _autoselect
    return _autoselect(net, x_example, m=m, layouts=layouts, cache=cache, **kwargs)
