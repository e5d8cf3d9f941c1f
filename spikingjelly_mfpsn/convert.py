"""Whole-network layout conversion: :func:`to_time_last` and its exact inverse :func:`to_time_first`.

``to_time_last(net)`` swaps every SpikingJelly stateless layer for its time-last wrapper (sharing the
layer's parameters, so state_dict keys and values do not change), sets ``layout='time_last'`` on every
:class:`MulFreeChannelwisePSN`, and installs a boundary on ``net`` that moves time to the end once at
the input and back once at the output, so callers keep passing ``(T, N, ...)``.

Rules, per module (``net`` itself included):

* a time-last wrapper: kept;
* an MF-PSN neuron (``MulFreeChannelwisePSN``, or a folded ``deploy.FoldedMulFreePSN``) in ``step_mode='m'``:
  ``layout='time_last'``;
* a stateless layer :func:`layer.wrapper_class` knows (SpikingJelly's ``layer.Conv2d``,
  ``layer.BatchNorm2d``, pools, ``Linear``, ``Flatten``, ``Dropout``... in ``step_mode='m'``, and the
  plain torch.nn layers): its wrapper. A plain ``nn.Flatten`` outside SpikingJelly's containers sees
  the whole ``(T, N, ...)`` sequence, every other plain layer one step;
* ``SeqToANNContainer``: a :class:`layer.TimeLastSequential` of its children's wrappers;
* element-wise modules (activations, ``nn.Identity``, ``nn.Dropout``, surrogate functions): kept;
* any other module with children (``nn.Sequential``, residual blocks): its children are converted in
  place and its own ``forward`` kept, so code between layers must not depend on the layout
  (element-wise ops and residual sums do not; an inline ``torch.flatten(x, 2)`` only where the
  flattened dims are 1x1, as after the zoo ResNets' global pooling);
* anything else (other spiking neurons, stateful or multi-step-only SpikingJelly modules, unknown
  layers): an :class:`UnconvertibleModuleError` naming every such module, unless ``fallback='time_first'``,
  which runs that module time-first inside the time-last network (its input and output are transposed).

Nothing is changed unless the whole network converts.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Optional

import torch
import torch.nn as nn

from . import _compat, layer
from .neuron import ChargeNeuronBase

FALLBACKS = (None, "time_first")

ELEMENTWISE = (nn.Identity, nn.Dropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
               nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
               nn.Softsign, nn.Tanhshrink, nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.LogSigmoid)


class UnconvertibleModuleError(TypeError):
    """A network holds modules that have no time-last version (the message names each of them)."""


def _is_elementwise(m: nn.Module) -> bool:
    return type(m) in ELEMENTWISE or isinstance(m, _compat.surrogate.SurrogateFunctionBase)


# ---------------------------------------------------------------------------- forward hooks
# Module-level functions (not closures) so hooked networks deep-copy and pickle, and so the hooks are
# found again by identity when converting back.

def _map_tensors(out, fn):
    """``fn`` applied to every tensor of a module's output: a tensor, or tuples (named ones too), lists
    and dicts of them; other values as they are."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple takes its fields one by one
        return type(out)(*(_map_tensors(o, fn) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    if isinstance(out, dict):
        mapped = copy.copy(out)  # the same kind of dict (OrderedDict, defaultdict, ...)
        for key, value in out.items():
            mapped[key] = _map_tensors(value, fn)
        return mapped
    return out


def _first_arg(module, args, what):
    if not args or not isinstance(args[0], torch.Tensor):
        raise TypeError(f"{type(module).__name__} runs {what}; its first argument must be a tensor")
    return args[0]


def _boundary_enter(module, args):
    """(T, N, ...) -> (N, ..., T) at the input of a time-last network."""
    x = _first_arg(module, args, "time-last inside and takes (T, N, ...)")
    return (x.movedim(0, -1).contiguous(), *args[1:])


def _boundary_exit(module, args, output):
    """(N, ..., T) -> (T, N, ...) at its output."""
    return _map_tensors(output, lambda y: y.movedim(-1, 0).contiguous())


def _island_enter(module, args):
    """(N, ..., T) -> (T, N, ...) at the input of a module run time-first inside a time-last network."""
    x = _first_arg(module, args, "time-first inside a time-last network")
    return (x.movedim(-1, 0).contiguous(), *args[1:])


def _island_exit(module, args, output):
    return _map_tensors(output, lambda y: y.movedim(0, -1).contiguous())


def _has_hooks(m: nn.Module, enter, exit_) -> bool:
    return enter in m._forward_pre_hooks.values() and exit_ in m._forward_hooks.values()


def _add_hooks(m: nn.Module, enter, exit_) -> None:
    if not _has_hooks(m, enter, exit_):
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(exit_)


def _remove_hooks(m: nn.Module, enter, exit_) -> None:
    for hooks, fn in ((m._forward_pre_hooks, enter), (m._forward_hooks, exit_)):
        for key in [k for k, v in hooks.items() if v is fn]:
            del hooks[key]


def has_time_last_boundary(net: nn.Module) -> bool:
    """Whether ``net`` takes and returns time-first tensors around a time-last inside."""
    return _has_hooks(net, _boundary_enter, _boundary_exit)


# ---------------------------------------------------------------------------- to_time_last
#: The wrappers that run time-last whatever they wrap (a network holding one runs time-last inside).
TIME_LAST_TYPES = (layer.TimeLastModule, layer.TimeLastDropout, layer.TimeLastSequential, layer.TLastSeqToANNContainer)


def _layout_aware(m: nn.Module) -> bool:
    """Modules that run either layout themselves and say which through a ``layout`` attribute:
    MF-PSN (trainable or folded), and any module declaring ``layout_aware = True`` (e.g. layers that
    mix time steps)."""
    return isinstance(m, ChargeNeuronBase) or getattr(m, "layout_aware", False)


def _why_not(m: nn.Module) -> str:
    if isinstance(m, _compat.MemoryModule):
        return "a stateful SpikingJelly module, which runs time-first only"
    if isinstance(m, _compat.StepModule):
        return "a SpikingJelly module without a time-last version"
    return "not a stateless layer this package knows"


def _occurrences(m: nn.Module) -> list:
    """``(name, child)`` for every child slot of ``m``: a module used twice is listed twice
    (``named_children`` lists it once, and its second place would stay unconverted)."""
    return [(name, child) for name, child in m._modules.items() if child is not None]


def _path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(path: str, m: nn.Module) -> str:
    return f"{path or '(the network itself)'} ({type(m).__name__})"


class _Converter:
    """One to_time_last pass: builds the wrappers, records what to change, applies it all or nothing."""

    def __init__(self, fallback: Optional[str], method: str):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.fallback = fallback
        self.method = method
        self.actions = []
        self.errors = []
        self.done: dict[tuple[int, bool], nn.Module] = {}

    def convert(self, m: nn.Module, path: str, per_step: bool) -> nn.Module:
        """The time-last replacement of ``m`` (``m`` itself when it is converted in place); a module
        used at several places (shared weights) gets one replacement, used at each of them."""
        key = (id(m), per_step)
        if key not in self.done:
            self.done[key] = self._replacement(m, path, per_step)
        return self.done[key]

    def _replacement(self, m: nn.Module, path: str, per_step: bool) -> nn.Module:
        if isinstance(m, TIME_LAST_TYPES) or _has_hooks(m, _island_enter, _island_exit):
            return m
        if _layout_aware(m):
            if per_step or getattr(m, "step_mode", "m") != "m":
                self.errors.append(f"{_describe(path, m)}: the time-last layout needs step_mode='m' outside "
                                   f"SeqToANNContainer (functional.set_step_mode(net, 'm'))")
            else:
                self.actions.append(partial(setattr, m, "layout", "time_last"))
            return m
        if layer.wrapper_class(m) is not None:
            return self._wrap(m, path, per_step)
        if type(m) is _compat.sj_layer("SeqToANNContainer"):
            return self._seq_to_ann(m, path)
        if _is_elementwise(m):
            return m
        if isinstance(m, _compat.StepModule) or next(m.children(), None) is None:
            return self._unconvertible(m, path, per_step)
        for name, child in _occurrences(m):
            new = self.convert(child, _path(path, name), per_step)
            if new is not child:
                self.actions.append(partial(m._modules.__setitem__, name, new))
        return m

    def _wrap(self, m: nn.Module, path: str, per_step: bool) -> nn.Module:
        if not per_step and getattr(m, "step_mode", "m") != "m":
            self.errors.append(f"{_describe(path, m)} has step_mode={m.step_mode!r}: the time-last layout is "
                               f"multi-step only (functional.set_step_mode(net, 'm'))")
            return m
        try:
            return layer.time_last(m, method=self.method, whole_sequence=not per_step and type(m) is nn.Flatten)
        except (TypeError, ValueError) as e:
            self.errors.append(f"{_describe(path, m)}: {e}")
            return m

    def _seq_to_ann(self, container: nn.Module, path: str) -> nn.Module:
        outer_errors, self.errors = self.errors, []
        children = {name: self.convert(c, _path(path, name), per_step=True) for name, c in _occurrences(container)}
        inner_errors, self.errors = self.errors, outer_errors
        if not inner_errors:
            return layer.TimeLastSequential(container, children)
        if self.fallback == "time_first":
            return self._unconvertible(container, path, per_step=False)
        self.errors.extend(inner_errors)
        return container

    def _unconvertible(self, m: nn.Module, path: str, per_step: bool) -> nn.Module:
        if self.fallback == "time_first" and not per_step:
            self.actions.append(partial(_add_hooks, m, _island_enter, _island_exit))
        else:
            self.errors.append(f"{_describe(path, m)}: {_why_not(m)}")
        return m


def to_time_last(net: nn.Module, fallback: Optional[str] = None, boundary: bool = True,
                 method: str = "auto") -> nn.Module:
    """Convert a multi-step SpikingJelly network to the time-last layout (see the module docstring).

    :param net: a network in ``step_mode='m'``; converted in place, but use the return value (a
        network that is itself a single layer comes back as a new wrapper)
    :param fallback: ``None`` (default): raise :class:`UnconvertibleModuleError` naming every module
        without a time-last version, changing nothing; ``'time_first'``: run such modules time-first
        (input and output transposed around each), which is correct for any multi-step module
        including stateful neurons, at the cost of two copies per module
    :param boundary: install the boundary that takes and returns ``(T, N, ...)``; ``False`` makes the
        network take and return ``(N, ..., T)``
    :param method: ``method`` of the two-way stateless wrappers (``'auto'``, ``'vmap'``, ``'highdim'``)
    :return: the converted network; :func:`to_time_first` undoes the conversion exactly
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if method not in ("auto",) + layer.METHODS:
        raise ValueError(f"method must be 'auto' or one of {layer.METHODS}, got {method!r}")
    conv = _Converter(fallback, method)
    new = conv.convert(net, "", per_step=False)
    if conv.errors:
        raise UnconvertibleModuleError(
            "cannot convert to the time-last layout:\n  " + "\n  ".join(conv.errors) +
            "\nReplace these modules (e.g. spiking neurons with MulFreeChannelwisePSN), or pass "
            "fallback='time_first' to run them time-first inside the time-last network.")
    for action in conv.actions:
        action()
    if boundary:
        _add_hooks(new, _boundary_enter, _boundary_exit)
    _invalidate(new)
    return new


# ---------------------------------------------------------------------------- to_time_first
def _revert(m: nn.Module) -> nn.Module:
    _remove_hooks(m, _island_enter, _island_exit)
    if isinstance(m, layer.TimeLastSequential):
        original = m._time_first
        for name, child in _occurrences(m):
            original._modules[name] = _revert(child)
        original.train(m.training)
        return original
    if isinstance(m, (layer.TimeLastModule, layer.TimeLastDropout)):
        return m.time_first_module
    if _layout_aware(m):
        m.layout = "time_first"
        return m
    for name, child in _occurrences(m):
        new = _revert(child)
        if new is not child:
            m._modules[name] = new
    return m


def to_time_first(net: nn.Module) -> nn.Module:
    """Undo :func:`to_time_last`: the original time-first modules (the same objects, holding the
    current parameters), ``layout='time_first'`` on every MF-PSN, no boundary. Use the return value."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    _remove_hooks(net, _boundary_enter, _boundary_exit)
    new = _revert(net)
    _invalidate(new)
    return new


def _invalidate(net: nn.Module) -> None:
    # reset_net may have cached the modules of net or of any block of it.
    for m in net.modules():
        _compat.invalidate_reset_cache(m)


__all__ = ["ELEMENTWISE", "FALLBACKS", "UnconvertibleModuleError", "current_layout", "has_time_last_boundary", "to_time_first",
           "to_time_last"]


def current_layout(net: nn.Module) -> str:
    """``'time_last'`` if :func:`to_time_last` installed its boundary on ``net``, else ``'time_first'``."""
    return "time_last" if has_time_last_boundary(net) else "time_first"
