"""Whole-network layout conversion: :func:`to_time_last` and its exact inverse :func:`to_time_first`.

``to_time_last(net, example_input=x)`` swaps every SpikingJelly stateless layer for its time-last
wrapper (sharing the layer's parameters, so state_dict keys and values do not change), sets
``layout='time_last'`` on every :class:`MulFreeChannelwisePSN`, and makes the network move time to the
end once at the input and back once at the output, so callers keep passing ``(T, N, ...)``.

The forward is traced with torch.fx (:mod:`.tracing`; SpikingJelly's modules are leaves). Where it
makes no call that depends on where the time axis is (only modules, residual sums and other
element-wise calls), the modules are converted in place and the forwards kept, with a boundary
(forward hooks) on ``net``. Otherwise (``torch.flatten(x, 2)``, ``x.mean(0)``, reshapes, ``cat``...) the
forward is rewritten (:mod:`.rewrite`) from its trace on ``example_input``, and the rewritten forward
(``net.forward``, a :class:`~.rewrite.GraphForward`; ``print(net.forward.code)``) is checked against
the time-first network on the example one step longer. A forward that cannot be traced, or one with
such calls and no example input, gets its modules converted only, after a warning that names the call
(``strict=True``: an :class:`UnconvertibleModuleError` instead).

Rules, per module (a leaf of the trace, or ``net`` itself):

* a time-last wrapper: kept;
* an MF-PSN neuron (``MulFreeChannelwisePSN``, or a folded ``deploy.FoldedMulFreePSN``) in ``step_mode='m'``:
  ``layout='time_last'``;
* a stateless layer :func:`layer.wrapper_class` knows (SpikingJelly's ``layer.Conv2d``,
  ``layer.BatchNorm2d``, pools, ``Linear``, ``Flatten``, ``Dropout``... in ``step_mode='m'``, and the
  plain torch.nn layers): its wrapper. A plain ``nn.Flatten`` outside SpikingJelly's containers sees
  the whole ``(T, N, ...)`` sequence, every other plain layer one step;
* ``SeqToANNContainer``: a :class:`layer.TimeLastSequential` of its children's wrappers;
* element-wise modules (activations, ``nn.Identity``, ``nn.Dropout``, surrogate functions): kept;
* (module swapping only) any other module with children: its children are converted in place and its
  own ``forward`` kept;
* anything else (other spiking neurons, stateful or multi-step-only SpikingJelly modules, unknown
  layers): an :class:`UnconvertibleModuleError` naming every such module, unless ``fallback='time_first'``,
  which runs that module time-first inside the time-last network (its input and output are transposed).

Nothing is changed unless the whole network converts.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from . import _compat, layer, rewrite, tracing
from ._util import agree, as_args, module_slots
from .neuron import ChargeNeuronBase
from .rewrite import GraphForward

FALLBACKS = (None, "time_first")

ELEMENTWISE = (nn.Identity, nn.Dropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
               nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
               nn.Softsign, nn.Tanhshrink, nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.LogSigmoid)


class UnconvertibleModuleError(TypeError):
    """A network holds modules that have no time-last version (the message names each of them)."""


def _is_elementwise(m: nn.Module) -> bool:
    return _unmoved_class(type(m)) in ELEMENTWISE or isinstance(m, _compat.surrogate.SurrogateFunctionBase)


# ---------------------------------------------------------------------------- moves of T at a boundary
# Module-level functions (not closures) so converted networks deep-copy and pickle, and so the moves are
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


def _wrapped(module) -> bool:
    """A time-first layer whose time-last wrapper shares its hook dictionaries (a single layer converted):
    the boundary is the wrapper's, and the layer itself still runs time-first."""
    return not isinstance(module, TIME_LAST_TYPES) and layer.wrapper_class(module) is not None


def _boundary_enter(module, args):
    """(T, N, ...) -> (N, ..., T) at the input of a time-last network."""
    if _wrapped(module):
        return None
    x = _first_arg(module, args, "time-last inside and takes (T, N, ...)")
    return (x.movedim(0, -1).contiguous(), *args[1:])


def _boundary_exit(module, args, output):
    """(N, ..., T) -> (T, N, ...) at its output."""
    return None if _wrapped(module) else _map_tensors(output, lambda y: y.movedim(-1, 0).contiguous())


def _island_enter(module, args):
    """(N, ..., T) -> (T, N, ...) at the input of a module run time-first inside a time-last network."""
    if getattr(module, "step_mode", "m") != "m":  # (set_step_mode(net, 's') reached it, then was refused)
        raise ValueError(f"{type(module).__name__} runs time-first inside a time-last network, multi-step only, "
                         f"but has step_mode={module.step_mode!r}: set_step_mode(net, 'm'), or convert the network "
                         f"back with to_time_first(net) before setting step_mode='s'")
    x = _first_arg(module, args, "time-first inside a time-last network")
    return (x.movedim(-1, 0).contiguous(), *args[1:])


def _island_exit(module, args, output):
    return _map_tensors(output, lambda y: y.movedim(0, -1).contiguous())


class _Moves:
    """Mixin of a module whose forward runs between moves of T (:func:`_add_moves`): a time-last network's
    boundary, or a module run time-first inside one. Inside the forward rather than in hooks, so that the
    module's own hooks see its tensors as they flow outside it, whenever they were registered; in the class
    (as ``torch.nn.utils.parametrize`` does) rather than in the instance, so that a replica
    (``nn.DataParallel``) or a shallow copy runs itself. The instance holds its ``(enter, exit)`` pairs in
    ``_moves`` (innermost first) and an instance forward it had in ``_inner_forward``."""

    def forward(self, *args, **kwargs):
        moves = self.__dict__["_moves"]
        for enter, _ in reversed(moves):
            moved = enter(self, args)
            args = args if moved is None else moved
        inner = self.__dict__.get("_inner_forward")
        out = inner(*args, **kwargs) if inner is not None else super().forward(*args, **kwargs)
        for _, exit_ in moves:
            moved = exit_(self, args, out)
            out = out if moved is None else moved
        return out

    def __reduce_ex__(self, protocol):
        # Pickled as the module's own class, moved again on loading: the moved class is made at run time.
        return _new_moved, (_unmoved_class(type(self)),), self.__getstate__()


_MOVED_CLASSES: dict[type, type] = {}


def _moved_class(cls: type) -> type:
    if cls not in _MOVED_CLASSES:  # (named as the module's class: messages and reprs name it)
        _MOVED_CLASSES[cls] = type(cls.__name__, (_Moves, cls), {"__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
    return _MOVED_CLASSES[cls]


def _unmoved_class(cls: type) -> type:
    """The class a moved module had (the one after :class:`_Moves` in its MRO), or ``cls``."""
    mro = cls.__mro__
    return mro[mro.index(_Moves) + 1] if _Moves in mro else cls


def _without_moves(cls: type) -> type:
    """``cls`` without the moves: the module's own class, or a class made over the moved one since (by
    ``torch.nn.utils.parametrize``) made again over the module's own."""
    base = _unmoved_class(cls)
    if cls is _MOVED_CLASSES.get(base):
        return base
    return type(cls.__name__, (base,), {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")})


def _new_moved(cls: type) -> nn.Module:
    moved = _moved_class(cls)
    return moved.__new__(moved)


def _is_moved(m: nn.Module, enter, exit_, outermost: bool = False) -> bool:
    moves = m.__dict__.get("_moves", ()) if isinstance(m, _Moves) else ()
    return (moves[-1:] == ((enter, exit_),)) if outermost else (enter, exit_) in moves


def runs_time_first_inside(m: nn.Module) -> bool:
    """Whether ``m`` runs time-first inside a time-last network.

    ``to_time_last(net, fallback='time_first')`` leaves such a module as it was, with a transpose on
    each side (its hooks see the time-last tensors outside it; but a module that is a network with a
    boundary of its own takes time-first ones)."""
    return _is_moved(m, _island_enter, _island_exit, outermost=True)


def _add_moves(m: nn.Module, enter, exit_) -> None:
    if _is_moved(m, enter, exit_):
        return
    if not isinstance(m, _Moves):
        if parametrize.is_parametrized(m):  # (torch undoes its class by its first base: it would be the moves')
            raise UnconvertibleModuleError(f"{type(m).__name__} is parametrized (torch.nn.utils.parametrize), and "
                                           f"it would run time-first inside a time-last network or take its "
                                           f"boundary: remove its parametrizations first (and register them "
                                           f"again after the conversion)")
        if "forward" in m.__dict__:  # (an instance forward would hide the class's)
            m.__dict__["_inner_forward"] = m.__dict__.pop("forward")
        m.__dict__["_moves"] = ()
        m.__class__ = _moved_class(type(m))
    m.__dict__["_moves"] = m.__dict__["_moves"] + ((enter, exit_),)


def _remove_moves(m: nn.Module, enter, exit_) -> None:
    if not _is_moved(m, enter, exit_):
        return
    m.__dict__["_moves"] = tuple(pair for pair in m.__dict__["_moves"] if pair != (enter, exit_))
    if not m.__dict__["_moves"]:
        del m.__dict__["_moves"]
        m.__class__ = _without_moves(type(m))
        if "_inner_forward" in m.__dict__:
            m.__dict__["forward"] = m.__dict__.pop("_inner_forward")


def has_time_last_boundary(net: nn.Module) -> bool:
    """Whether ``net`` takes and returns time-first tensors around a time-last inside."""
    forward = net.__dict__.get("forward")
    return _is_moved(net, _boundary_enter, _boundary_exit) or isinstance(forward, GraphForward) and forward.boundary


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
    if next(m.children(), None) is not None:
        return ("a module with a forward of its own inside a SeqToANNContainer, whose steps no trace sees (its "
                "calls may depend on where the time axis is)")
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
        if isinstance(m, TIME_LAST_TYPES) or _is_moved(m, _island_enter, _island_exit):
            return m
        kind = _unmoved_class(type(m))  # (a network with its boundary: its own class)
        if _layout_aware(m):
            if per_step or getattr(m, "step_mode", "m") != "m":
                self.errors.append(f"{_describe(path, m)}: the time-last layout needs step_mode='m' outside "
                                   f"SeqToANNContainer (functional.set_step_mode(net, 'm'))")
            else:
                self.actions.append(partial(setattr, m, "layout", "time_last"))
            return m
        if _is_elementwise(m) or not m._modules and kind.forward in (nn.Sequential.forward, nn.Module.forward):
            return m  # (an empty Sequential passes its input through; an empty ModuleList is not called)
        if layer.wrapper_class(m) is not None:
            return self._wrap(m, path, per_step)
        if kind is _compat.sj_layer("SeqToANNContainer"):
            return self._seq_to_ann(m, path)
        if isinstance(m, _compat.StepModule) or next(m.children(), None) is None or \
                per_step and kind.forward is not nn.Sequential.forward:  # (a forward of its own, per step)
            return self._unconvertible(m, path, per_step)
        for name, child in _occurrences(m):
            new = self.convert(child, _path(path, name), per_step)
            if new is not child:
                self.actions.append(partial(m._modules.__setitem__, name, new))
        return m

    def _wrap(self, m: nn.Module, path: str, per_step: bool) -> nn.Module:
        if per_step and layer.wrapper_class(m) is layer.TimeLastDropout:
            self.errors.append(f"{_describe(path, m)}: a dropout inside a SeqToANNContainer draws a mask per step "
                               f"and sample, which its time-last version (one mask for every step) does not")
            return m
        if not per_step and getattr(m, "step_mode", "m") != "m":
            self.errors.append(f"{_describe(path, m)} has step_mode={m.step_mode!r}: the time-last layout is "
                               f"multi-step only (functional.set_step_mode(net, 'm'))")
            return m
        try:
            new = layer.time_last(m, whole_sequence=not per_step and type(m) is nn.Flatten)
        except (TypeError, ValueError) as e:
            self.errors.append(f"{_describe(path, m)}: {e}")
            return m
        if self.method in getattr(new, "supported_methods", ()):  # (a 3d conv or pool runs 'vmap' only)
            new.method = self.method
        return new

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
            self.actions.append(partial(_add_moves, m, _island_enter, _island_exit))
        else:
            self.errors.append(f"{_describe(path, m)}: {_why_not(m)}")
        return m


def to_time_last(net: nn.Module, fallback: Optional[str] = None, boundary: bool = True,
                 method: str = "auto", example_input=None, strict: bool = False) -> nn.Module:
    """Convert a multi-step SpikingJelly network to the time-last layout (see the module docstring).

    Args:
        net: a network in ``step_mode='m'``; converted in place, but use the return value (a
            network that is itself a single layer comes back as a new wrapper)
        fallback: ``None`` (default): raise :class:`UnconvertibleModuleError` naming every module
            without a time-last version, changing nothing; ``'time_first'``: run such modules time-first
            (input and output transposed around each), which is correct for any multi-step module
            including stateful neurons, at the cost of two copies per module
        boundary: install the boundary that takes and returns ``(T, N, ...)``; ``False`` makes the
            network take ``(N, ..., T)`` and return its outputs that have a time axis with time last
        method: ``method`` of the two-way stateless wrappers (``'auto'``, ``'vmap'``, ``'highdim'``),
            where a wrapper has it (3d convolutions and pools run ``'vmap'`` only)
        example_input: one input of the network (``(T, N, ...)``; a tuple holds several positional
            inputs). Needed where ``forward`` makes calls that depend on where the time axis is
            (``torch.flatten(x, 2)``, ``x.mean(0)``, reshapes...): the forward is traced, run on it and on
            it one step longer, rewritten, and checked against the time-first network
        strict: where the forward cannot be traced or rewritten, raise
            :class:`UnconvertibleModuleError` (``True``) or warn and convert the modules only (``False``)
    Returns:
        the converted network; :func:`to_time_first` undoes the conversion exactly
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if method not in ("auto",) + layer.METHODS:
        raise ValueError(f"method must be 'auto' or one of {layer.METHODS}, got {method!r}")
    for name, flag in (("boundary", boundary), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    conv = _Converter(fallback, method)
    forward = net.__dict__.get("forward")
    blocks = [name for name, m in net.named_modules() if m is not net and has_time_last_boundary(m)]
    if blocks and not has_time_last_boundary(net):
        raise UnconvertibleModuleError(f"net holds blocks converted on their own ({', '.join(blocks)}), each taking "
                                       f"and giving time-first tensors: convert the network as a whole, from its "
                                       f"time-first form (to_time_first(net), then to_time_last(net, ...))")
    if has_time_last_boundary(net) != boundary and (isinstance(forward, GraphForward) or runs_time_last(net)):
        raise ValueError(f"net runs time-last already, with boundary={not boundary}: convert it back first "
                         f"(to_time_first(net)), then to_time_last(net, boundary={boundary}, ...)")
    if isinstance(forward, GraphForward):
        return net  # converted already
    if tracing.is_leaf(net) or runs_time_last(net):  # (a network converted by module swapping: still so)
        return _swap_modules(net, conv, boundary)
    inputs = _probes(example_input) if example_input is not None else None
    attrs = set(vars(net))
    try:
        return _traced(net, conv, boundary, inputs, strict)
    finally:  # (the tensor constants fx's traces set on net, but those the rewritten forward reads)
        forward = net.__dict__.get("forward")
        for name in set(vars(net)) - attrs - set(getattr(forward, "constants", ())):
            if name.startswith("_tensor_constant"):
                delattr(net, name)


def _traced(net: nn.Module, conv: _Converter, boundary: bool, inputs, strict: bool) -> nn.Module:
    """:func:`to_time_last` past its checks: the forward traced, and rewritten where it needs to be."""
    reads = []
    try:
        graph, how, shapes = tracing.trace(net, inputs and inputs[0], reads=reads, guards=True)
    except tracing.TraceFailure as e:
        return _modules_only(net, conv, boundary, inputs, str(e), strict)
    if how == "concrete" and _steps_by_hand(net, graph):
        return _modules_only(net, conv, boundary, inputs, "it calls single-step stateful modules (it steps through "
                             "time itself), and its trace holds the example's number of steps", strict)
    calls = [n for n in graph.nodes if n.op == "get_attr" or n.op in ("call_function", "call_method")
             and not rewrite.is_layout_free(n)]
    if not calls and how == "symbolic":  # (a concrete trace may hold lengths and branches the forward computes)
        several = inputs is not None and len(inputs[0]) > 1  # (the boundary moves the first input only)
        return _checked_swap(net, conv, boundary, inputs if several else None, "its modules converted")
    if inputs is None:
        listed = "; ".join(rewrite.describe(n) for n in calls[:3]) + (" ..." if len(calls) > 3 else "")
        reason = f"it makes calls that depend on where the time axis is ({listed}) and no example_input was given"
        return _modules_only(net, conv, boundary, None, reason, strict)
    try:  # (a rewritten forward is the graph, which must be the forward in train and eval mode alike)
        tracing.trace(net, inputs[0], every_mode=True)
    except tracing.TraceFailure as e:
        return _modules_only(net, conv, boundary, inputs, str(e), strict)
    return _rewritten(net, (graph, how, shapes, reads), inputs, conv, boundary, strict)


def _steps_by_hand(net: nn.Module, graph) -> bool:
    """The traced forward calls a stateful module in single-step mode (a loop over the steps)."""
    return any(n.op == "call_module" and isinstance(m := net.get_submodule(n.target), _compat.MemoryModule)
               and getattr(m, "step_mode", "m") == "s" for n in graph.nodes)


def runs_time_last(net: nn.Module) -> bool:
    """Whether ``net`` runs time-last inside.

    That is: converted by :func:`to_time_last`, with or without the boundary, or holding time-last modules."""
    return has_time_last_boundary(net) or any(isinstance(m, TIME_LAST_TYPES) or getattr(m, "layout", None) ==
                                              "time_last" for m in net.modules())


def _swap_modules(net: nn.Module, conv: _Converter, boundary: bool) -> nn.Module:
    """Convert the modules in place, keeping every forward (the calls between modules must not depend
    on the layout)."""
    new = conv.convert(net, "", per_step=False)
    _raise_errors(conv)
    for action in conv.actions:
        action()
    if boundary:
        _add_moves(new, _boundary_enter, _boundary_exit)
    _compat.invalidate_reset_cache(net, new)
    return new


def _raise_errors(conv: _Converter) -> None:
    if conv.errors:
        raise UnconvertibleModuleError(
            "cannot convert to the time-last layout:\n  " + "\n  ".join(conv.errors) +
            "\nReplace these modules (e.g. spiking neurons with MulFreeChannelwisePSN), or pass "
            "fallback='time_first' to run them time-first inside the time-last network.")


def _modules_only(net, conv, boundary, inputs, reason: str, strict: bool) -> nn.Module:
    """The forward could not be seen: convert the modules only, after a warning (or raise if strict);
    with example inputs (:func:`_probes`), the result is checked against the time-first network."""
    message = (f"to_time_last cannot rewrite {type(net).__name__}.forward: {reason}. Only its modules are "
               f"converted, so a call in forward that depends on where the time axis is would go wrong")
    if strict:
        raise UnconvertibleModuleError(message + ".")
    hint = ("pass example_input=<one input batch, (T, N, ...)> to trace and rewrite the forward (strict=True "
            "raises instead)" if inputs is None else "strict=True raises instead")
    warnings.warn(f"{message}; {hint}.", stacklevel=3)
    return _checked_swap(net, conv, boundary, inputs, f"its modules converted (its forward was not rewritten: "
                                                      f"{reason})")


def _checked_swap(net, conv, boundary: bool, inputs, what: str) -> nn.Module:
    """:func:`_swap_modules`, checked against the time-first network on the example's probes where there
    are some (and a boundary: the outputs are then time-first), in eval and in training mode (a forward
    may branch on ``self.training``): its other inputs pass the boundary as they are, and a second input
    with a time axis would reach time-last layers time-first."""
    references = _references(net, inputs) if inputs is not None and boundary else []
    new = _swap_modules(net, conv, boundary)
    for args, training, reference in references:
        _check(new, args, training, reference, what)
    return new


def _references(net: nn.Module, inputs: list) -> list:
    """``(args, training, outputs)`` of the time-first network in eval and in training mode, on the longer
    probe, or (a network that runs for the example's number of steps only) on one sample of the example.
    A network that does not run in training mode on either probe, or whose training mode draws random
    numbers (two runs differ: a time-last run draws them in another order), is checked in eval mode only."""
    try:
        _eval(net, inputs[1])
    except Exception:  # noqa: BLE001
        inputs[1] = _same_steps(inputs)
    references = [(inputs[1], False, _probe_run(net, lambda: _eval(net, inputs[1])))]
    for args in (inputs[1], inputs[0]):
        with contextlib.suppress(Exception):
            with tracing.quiet(net, training=True):
                first = net(*args)
                _compat.functional.reset_net(net)
                again = net(*args)
            return references + ([(args, True, first)] if agree(first, again) else [])
    return references


def _probe_run(net: nn.Module, run):
    try:
        return run()
    except Exception as e:  # noqa: BLE001  (any failure of the user's network on a probe)
        raise _probe_error(net, e) from e


def _probe_error(net: nn.Module, e: Exception) -> UnconvertibleModuleError:
    return UnconvertibleModuleError(
        f"{type(net).__name__} does not run on the inputs made from example_input to check the conversion (two "
        f"of its samples, and one of them one step longer; its other inputs are passed as they are), so it was "
        f"left time-first: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")


def _eval(net: nn.Module, args: tuple, training: bool = False):
    with tracing.quiet(net, training):
        return net(*args)


def _check(net: nn.Module, args: tuple, training: bool, reference, what: str) -> None:
    """Undo the conversion and raise if ``net`` no longer gives ``reference`` on ``args``."""
    try:
        ok, why = agree(_eval(net, args, training), reference), "gives different outputs from the time-first network"
    except Exception as e:  # noqa: BLE001  (any failure of the converted network)
        ok, why = False, f"fails ({type(e).__name__}: {e})"
    if not ok:
        to_time_first(net)
        mode = "training" if training else "eval"
        raise UnconvertibleModuleError(f"{type(net).__name__} with {what} {why} in {mode} mode on an input made "
                                       f"from example_input (two of its samples, or one of them one step longer); "
                                       f"it was left time-first.")


def _probes(example_input) -> list[tuple]:
    """The two inputs of :func:`tracing.probes` made from the example's first input."""
    args = as_args(example_input)
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.shape[0]:
        raise ValueError("example_input must be a (T, N, ...) tensor (or a tuple whose first element is one), "
                         f"got {type(x).__name__}{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
    return [(p,) + args[1:] for p in tracing.probes(x)]


def _runs(net: nn.Module, args: tuple) -> bool:
    try:
        _eval(net, args)
        return True
    except Exception:  # noqa: BLE001
        return False


def _same_steps(inputs: list) -> tuple:
    """The first probe with one sample (for a network that runs for one number of steps only)."""
    x = inputs[0][0]
    return (x[:, :1] if x.dim() > 1 else x,) + inputs[0][1:]


def _rewritten(net, traced: tuple, inputs: list, conv: _Converter, boundary: bool, strict: bool) -> nn.Module:
    """Trace-based conversion: the modules converted, and the forward rewritten around them."""
    graph, how, shapes_a, reads = traced
    if shapes_a is None:
        try:
            shapes_a = tracing.run_graph(net, graph, inputs[0])[1]
        except Exception as e:  # noqa: BLE001
            raise _probe_error(net, e) from e
    try:
        out_b, shapes_b = tracing.run_graph(net, graph, inputs[1])
        grown = True
    except Exception:  # noqa: BLE001  (a network that runs for the example's number of steps only)
        if how == "concrete" and _runs(net, inputs[1]):  # ... or a trace that recorded the example's T
            return _modules_only(net, conv, boundary, inputs, "its concrete trace fails on an input one step "
                                 "longer, where the network runs (it may loop over the steps, or branch on "
                                 "their number or on the batch size)", strict)
        inputs[1] = _same_steps(inputs)
        out_b, shapes_b = _probe_run(net, lambda: tracing.run_graph(net, graph, inputs[1]))
        grown = False
    # (a symbolic trace too: it records `y += v` as `y = y + v`, losing what another name of y sees)
    reference = _probe_run(net, lambda: _eval(net, inputs[1]))
    if not agree(out_b, reference):
        return _modules_only(net, conv, boundary, inputs,
                             f"its {how} trace gives different outputs from the network on an input "
                             f"{'one step longer' if grown else 'of another batch size'} (it may branch on "
                             f"the input's shape, or change in place a tensor that another name holds)", strict)
    swaps, decided = {}, {}

    def convert_module(m: nn.Module, path: str) -> bool:
        errors = len(conv.errors)
        new = conv.convert(m, path, per_step=False)
        if len(conv.errors) == errors and new is not m:
            swaps[id(m)] = new
        decided[path] = True
        return True

    steps = inputs[0][0].shape[0]
    rewriter = rewrite.Rewriter(net, graph, (shapes_a, shapes_b), steps, convert_module, True, grown)
    try:
        checked = rewriter.run()
    except rewrite.Unrewritable as e:
        return _modules_only(net, _Converter(conv.fallback, conv.method), boundary, inputs, str(e), strict)
    _raise_errors(conv)
    for action in conv.actions:
        action()
    for parent, name, child in module_slots(net):
        if id(child) in swaps:
            parent._modules[name] = swaps[id(child)]
    net.__dict__["forward"] = rewrite.GraphForward(checked, net, True, rewriter.time_first_calls, how, reads)
    _compat.invalidate_reset_cache(net)
    _check(net, inputs[1], False, reference, "its forward rewritten")
    if not boundary:
        inner = rewrite.Rewriter(net, graph, (shapes_a, shapes_b), steps, lambda m, p: decided.get(p, False),
                                 False, grown).run()
        net.__dict__["forward"] = rewrite.GraphForward(inner, net, False, rewriter.time_first_calls, how, reads)
    return net


# ---------------------------------------------------------------------------- to_time_first
def _revert(m: nn.Module) -> nn.Module:
    _remove_moves(m, _island_enter, _island_exit)
    if isinstance(m, layer.TimeLastSequential):
        original = m._time_first
        for name, child in _occurrences(m):
            original._modules[name] = _revert(child)
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
    """Undo :func:`to_time_last`.

    Restores the original time-first modules (the same objects, holding the current parameters), with
    ``layout='time_first'`` on every MF-PSN and no boundary. Use the return value.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    for name, m in net.named_modules():
        if isinstance(m, layer.TimeLastModule) and parametrize.is_parametrized(m) and \
                not all(isinstance(getattr(type(m.time_first_module), t, None), property) for t in m.parametrizations):
            raise ValueError(f"{name or 'net'} ({type(m).__name__}) has a parametrization registered on the "
                             f"time-last wrapper, which its time-first module cannot run; register it on "
                             f"its time_first_module instead, or remove it first "
                             f"(torch.nn.utils.parametrize.remove_parametrizations)")
    _remove_moves(net, _boundary_enter, _boundary_exit)
    if isinstance(net.__dict__.get("forward"), GraphForward):
        for name in net.__dict__.pop("forward").constants:
            net.__dict__.pop(name, None)
    new = _revert(net)
    _compat.invalidate_reset_cache(net, new)
    return new


__all__ = ["ELEMENTWISE", "FALLBACKS", "UnconvertibleModuleError", "current_layout", "has_time_last_boundary", "to_time_first",
           "to_time_last"]


def current_layout(net: nn.Module) -> str:
    """``'time_last'`` if :func:`to_time_last` installed its boundary on ``net``, else ``'time_first'``."""
    return "time_last" if has_time_last_boundary(net) else "time_first"
