"""One-call utilities on whole networks: switch neurons, choose backends and methods.

``replace_neurons``, ``set_backend``, ``set_method`` and ``autoselect`` are also added to
``spikingjelly.activation_based.functional`` when SpikingJelly does not define those names itself.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from . import _compat, layer, ops, tracing
from ._util import modes_kept, module_slots, run_hooked
from .convert import has_time_last_boundary, runs_time_first_inside, runs_time_last, to_time_last
from .neuron import ChargeNeuronBase as _ChargeNeuronBase
from .neuron import FusedBatchNorm, MulFreeChannelwisePSN

logger = _compat.logger


def _check_count(value, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def sawtooth_dilation(index: int, period: int = 3) -> int:
    """Dilation of the ``index``-th (0-based) spiking-neuron layer (paper Eq. 4).

    The sawtooth ``d^0 = 1, d^{l+1} = d^l mod 3 + 1``: 1, 2, 3, 1, 2, 3, ...
    """
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
    """One neuron ``replace_neurons`` replaced (or re-configured), a row of :class:`ReplaceSummary`.

    ``name``: the neuron's module name; ``old``: its former type's name; ``channels``, ``k``, ``dilation``
    and ``step_mode``: those of the MF-PSN now in its place.
    """

    name: str
    old: str
    channels: Optional[int]
    k: int
    dilation: int
    step_mode: str


@dataclass
class Skipped:
    """A neuron ``replace_neurons`` matched but left as it is, and why."""

    name: str
    old: str
    reason: str


READOUT_REASON = "non-spiking readout (outputs membrane potential)"
TERNARY_REASON = "ternary spikes (-1, 0, +1), which a 0/1 MF-PSN cannot give"
#: Why ``replace_neurons`` leaves a neuron alone, by ``_compat.output_kind``.
SKIP_REASONS = {"readout": READOUT_REASON, "ternary": TERNARY_REASON,
                "levels": "signed, multi-level or weighted spikes, which a 0/1 MF-PSN cannot give",
                "traces": "online-training neuron: its [spikes, traces] output feeds OTTT's layers"}


@dataclass
class ReplaceSummary:
    """What ``replace_neurons`` did.

    One row per replaced (or re-configured) neuron, in the order the neurons run, and in ``skipped`` the
    neurons it matched but left alone (non-spiking readouts, MF-PSN layers that already have the requested
    configuration), with the reason; in ``fused`` the ``(batch norm, neuron)`` pairs of
    ``fuse_bn=True``.
    """

    rows: list[Replacement] = field(default_factory=list)
    order: str = "registration"
    skipped: list[Skipped] = field(default_factory=list)
    fused: list[tuple[str, str]] = field(default_factory=list)

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
        if self.skipped:
            lines.append(f"left {len(self.skipped)} neuron(s) as they are:")
            lines.extend(f"{s.name or '<net>':<32} {s.old:<20} {s.reason}" for s in self.skipped)
        if self.fused:
            lines.append(f"fused {len(self.fused)} batch norm(s) into the neuron after them:")
            lines.extend(f"{bn:<32} -> {sn}" for bn, sn in self.fused)
        return "\n".join(lines)


def _is_target(targets, name: str, module: nn.Module) -> bool:
    if callable(targets) and not isinstance(targets, type):
        return bool(targets(name, module))
    return isinstance(module, targets)


def _readout_kept(explicit: tuple, module: nn.Module, include_readouts: bool) -> bool:
    """Whether ``module`` is a non-spiking readout to leave alone: it is, unless ``include_readouts`` or
    one of the ``explicit`` target classes it belongs to is itself a readout class."""
    readouts = _compat.readout_neuron_classes()
    if include_readouts or not isinstance(module, readouts):
        return False
    return not any(issubclass(cls, readouts) and isinstance(module, cls) for cls in explicit)


def _find(net: nn.Module, targets, include_readouts: bool) -> tuple[list, list[Skipped]]:
    """``(name, module)`` of each neuron to replace, in registration order, and the readouts left alone."""
    if isinstance(targets, (list, set, frozenset)) and all(isinstance(t, type) for t in targets):
        targets = tuple(targets)
    if not (targets is None or callable(targets) or isinstance(targets, tuple) and
            all(isinstance(t, type) for t in targets)):
        raise TypeError(f"targets must be a neuron class, a tuple or list of them, or a predicate (name, module) "
                        f"-> bool, got {targets!r}")
    explicit = (targets,) if isinstance(targets, type) else targets if isinstance(targets, tuple) else ()
    if targets is None:
        targets = _compat.spiking_neuron_classes() + (MulFreeChannelwisePSN,)
    found, skipped = [], []
    for name, m in net.named_modules():  # (visits a module registered at several places once)
        if not _is_target(targets, name, m):
            continue
        if _readout_kept(explicit, m, include_readouts):
            skipped.append(Skipped(name, type(m).__name__, SKIP_REASONS[_compat.output_kind(type(m))]))
        else:
            found.append((name, m))
    return found, skipped


def _device_dtype(net: nn.Module, module: nn.Module, example_input) -> tuple:
    for t in list(module.parameters()) + list(module.buffers()) + list(net.parameters()):
        if t.is_floating_point():
            return t.device, t.dtype
    if isinstance(example_input, torch.Tensor):
        return example_input.device, (example_input.dtype if example_input.is_floating_point()
                                      else torch.get_default_dtype())
    return torch.device("cpu"), torch.get_default_dtype()


def _run_order(net: nn.Module, found: list, example_input) -> dict[int, int]:
    """Input channel count of each ``(name, module)`` of ``found``, keyed by id, in the order they run;
    a module that runs at several places with different channel counts is refused (one channel-wise
    neuron cannot replace it)."""
    seen: dict[int, int] = {}

    def hook(name, mod, args):
        if args and isinstance(args[0], torch.Tensor):
            x = args[0]
            layout = mod.layout if isinstance(mod, MulFreeChannelwisePSN) else \
                "time_last" if runs_time_first_inside(mod) else "time_first"  # (hooks see an island's outside)
            multi_step = _compat.step_mode_of(mod) == "m" and x.dim() >= 3
            c = x.shape[ops.channel_dim(layout) if multi_step else 1] if x.dim() >= 2 else x.shape[0]
            if seen.setdefault(id(mod), c) != c:
                raise ValueError(f"neuron {name!r} runs at several places, with {seen[id(mod)]} and {c} channels; "
                                 "a channel-wise MF-PSN has one width: give each place its own neuron")

    with modes_kept(net):
        net.eval()
        run_hooked(net, example_input, [m.register_forward_pre_hook(functools.partial(hook, name))
                                        for name, m in found])
    return seen


# The constructor settings of an MF-PSN that a re-configured one keeps (besides channels, step_mode and
# surrogate_function, which every replacement keeps); its order and dilation are what changes.
_MF_PSN_SETTINGS = ("quantize", "ste", "threshold", "backend", "method", "layout", "momentum", "eps", "exp_init")


def _settings_of(old: nn.Module) -> dict:
    if not isinstance(old, MulFreeChannelwisePSN):
        return {}
    return {**{name: getattr(old, name) for name in _MF_PSN_SETTINGS}, "v_threshold": old.v_threshold_init}


# Settings an existing MF-PSN takes as they are (no new weights): set in place by a repeated replace_neurons.
_IN_PLACE = ("layout", "backend", "method", "step_mode", "surrogate_function")


def _already(old: nn.Module, k: int, dilation: int, neuron_kwargs: dict) -> bool:
    """Whether ``old`` is an MF-PSN of order ``k`` and ``dilation`` that has every setting of ``neuron_kwargs``
    but those it can take in place (:data:`_IN_PLACE`, which it then takes)."""
    if not isinstance(old, MulFreeChannelwisePSN) or (old.k, old.dilation) != (k, dilation):
        return False
    current = _settings_of(old)
    if not all(name in _IN_PLACE or name in current and current[name] == value
               for name, value in neuron_kwargs.items()):
        return False
    old.configure(**{name: neuron_kwargs[name] for name in _IN_PLACE if name in neuron_kwargs})
    return True


def _replacement(old: nn.Module, k: int, dilation: int, channels: Optional[int], device, dtype,
                 neuron_kwargs: dict) -> MulFreeChannelwisePSN:
    """A new MF-PSN for ``old``: its step mode, surrogate function, training mode and (an MF-PSN's)
    settings and channels, where ``neuron_kwargs`` does not set them."""
    kwargs = {**_settings_of(old), **neuron_kwargs}
    if "surrogate_function" not in kwargs and callable(getattr(old, "surrogate_function", None)):
        kwargs["surrogate_function"] = copy.deepcopy(old.surrogate_function)
    kwargs.setdefault("step_mode", _compat.step_mode_of(old))
    if runs_time_first_inside(old):  # (without its transposes, the new neuron must run time-last there itself)
        if kwargs.setdefault("layout", "time_last") != "time_last":
            raise ValueError(f"a {type(old).__name__} inside a time-last network becomes a time-last MF-PSN; got "
                             f"layout={kwargs['layout']!r} (convert the network with to_time_first(net) first)")
    if isinstance(old, MulFreeChannelwisePSN) and old.channels is not None:
        channels = old.channels
    new = MulFreeChannelwisePSN(channels=channels, k=k, dilation=dilation, **kwargs).to(device=device, dtype=dtype)
    if isinstance(old, MulFreeChannelwisePSN):
        new.set_input_bn(old.input_bn)  # (a batch norm fused into the old neuron: the new one applies it)
    return new.train(old.training)


def replace_neurons(net: nn.Module, k: int = 2, dilation: Union[str, int] = "sawtooth",
                    targets: Union[type, tuple, Callable, None] = None, example_input=None,
                    include_readouts: bool = False, fuse_bn: bool = False,
                    **neuron_kwargs) -> tuple[nn.Module, ReplaceSummary]:
    """Swap spiking neurons in ``net`` for :class:`MulFreeChannelwisePSN`, in place.

    Args:
        net: a SpikingJelly network (``net`` itself may be a neuron; the new neuron is returned)
        k: order of the new neurons
        dilation: ``'sawtooth'`` (1, 2, 3, 1, 2, 3, ... in the order the neurons run) or an int
        targets: neuron classes (a class, tuple or list) or a predicate ``(name, module) -> bool``;
            default: every neuron class SpikingJelly defines (IF, LIF, ParametricLIF, PSN family...) and
            MulFreeChannelwisePSN (re-configured to ``k`` and ``dilation``, with a warning: new weights)
        example_input: optional input for ``net`` (a tuple holds several positional inputs); when
            given, neurons are ordered as they run in a forward pass and get their channel count from it,
            otherwise registration order and lazy channels (a neuron shared by places with different
            channel counts, which one channel-wise neuron cannot replace, is then refused at once rather
            than at the first forward)
        include_readouts: also replace non-spiking readouts (the ``NonSpiking*`` nodes and ``LIAFNode``),
            which output membrane potentials or analog values, and the ternary nodes (-1/0/+1 spikes),
            which are otherwise left alone and listed in
            ``summary.skipped``; naming a readout class in ``targets`` includes that class
        fuse_bn: then let each new neuron apply the batch norm in front of it
            (:func:`fuse_batchnorm`; listed in ``summary.fused``)
        neuron_kwargs: passed to :class:`MulFreeChannelwisePSN` (``threshold``, ``quantize``, ...)
    Returns:
        ``(net, summary)``; each new neuron keeps the old one's ``step_mode``, surrogate function
        (where it had one, unless ``surrogate_function`` is given), device and dtype, and a re-configured
        MF-PSN its channels and other settings; one that already has ``k``, its dilation and every
        setting of ``neuron_kwargs`` but the run-time ones is kept, its weights too, and takes those
        (layout, backend, method, step_mode, surrogate_function) in place
    """
    _check_replace_args(net, dilation, neuron_kwargs)
    found, skipped = _find(net, targets, include_readouts)
    _check_replace_layout(net, found, neuron_kwargs)
    channels, order = _order(net, found, example_input)
    dilations = sawtooth(len(found)) if dilation == "sawtooth" else [dilation] * len(found)

    summary = ReplaceSummary(order=order, skipped=skipped)
    new_of: dict[int, MulFreeChannelwisePSN] = {}
    for (name, old), d in zip(found, dilations):
        if _already(old, k, d, neuron_kwargs):
            taken = ", ".join(f"{n}={neuron_kwargs[n]!r}" for n in _IN_PLACE if n in neuron_kwargs)
            summary.skipped.append(Skipped(name, type(old).__name__, f"already k={k}, dilation={d}"
                                           + (f" (set {taken} in place)" if taken else "")))
            continue
        new = _replacement(old, k, d, channels.get(id(old)), *_device_dtype(net, old, example_input), neuron_kwargs)
        new_of[id(old)] = new
        summary.rows.append(Replacement(name, type(old).__name__, new.channels, k, d, new.step_mode))
    reconfigured = sum(isinstance(old, MulFreeChannelwisePSN) for _, old in found if id(old) in new_of)
    if reconfigured:
        warnings.warn(f"replace_neurons re-configured {reconfigured} MulFreeChannelwisePSN layer(s) to k={k}, "
                      f"dilation={dilation!r}: their trained weights were re-initialised", UserWarning, stacklevel=2)

    if id(net) in new_of:
        return _as_converted(net, new_of[id(net)]), summary
    _swap(net, found, new_of, example_input)
    if fuse_bn:
        summary.fused = fuse_batchnorm(net, example_input)
    return net, summary


def _check_net(net) -> None:
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")


def _check_replace_args(net: nn.Module, dilation, neuron_kwargs: dict) -> None:
    _check_net(net)
    if "channels" in neuron_kwargs:
        raise ValueError("channels cannot be given: each new neuron takes its old one's channel count, or the one "
                         "example_input shows (lazy otherwise)")
    if dilation != "sawtooth" and (not isinstance(dilation, int) or dilation < 1):
        raise ValueError(f"dilation must be 'sawtooth' or an int >= 1, got {dilation!r}")
    # (the run-time settings an existing MF-PSN takes in place: checked before any neuron takes them)
    for name, check in (("layout", ops.check_layout), ("backend", ops.check_backend), ("method", ops.get)):
        if neuron_kwargs.get(name, "auto") != "auto":
            check(neuron_kwargs[name])
    if neuron_kwargs.get("step_mode", "s") not in ("s", "m"):
        raise ValueError(f"step_mode must be 's' or 'm', got {neuron_kwargs['step_mode']!r}")


def _check_replace_layout(net: nn.Module, found: list, neuron_kwargs: dict) -> None:
    """Refuse new neurons whose layout or step mode the layers around them do not hand them."""
    inside, alone = runs_time_last(net), any(m is net for _, m in found)
    layout, step_mode = neuron_kwargs.get("layout"), neuron_kwargs.get("step_mode")
    if layout == "time_first" and inside and not alone:
        raise ValueError("layout='time_first' for the neurons of a network converted by to_time_last (with or "
                         "without its boundary), whose layers hand them time-last sequences: call "
                         "to_time_first(net) first")
    if layout == "time_last" and not inside and not alone:
        raise ValueError("layout='time_last' for the neurons of a time-first network, whose layers hand them "
                         "time-first sequences: convert the network instead, to_time_last(net, example_input=x) "
                         "(its neurons then run time-last)")
    if step_mode == "s" and inside and not alone:
        raise ValueError("step_mode='s' for the neurons of a network that runs time-last (whole sequences only): "
                         "call to_time_first(net) first")


def _as_converted(old: nn.Module, new: MulFreeChannelwisePSN) -> nn.Module:
    """The new neuron for a lone ``old`` one, taking what ``old`` took: through a time-last boundary too."""
    if not has_time_last_boundary(old):
        return new
    new.layout = "time_first"
    return to_time_last(new)


def _swap(net: nn.Module, found: list, new_of: dict, example_input) -> None:
    """Put each new neuron where its old one was; with ``example_input``, warn of an old one the forward
    still runs (reached through a reference outside the module tree, e.g. a plain list)."""
    for parent, child_name, child in module_slots(net):
        if id(child) in new_of:
            setattr(parent, child_name, new_of[id(child)])
    _compat.invalidate_reset_cache(net)
    if example_input is None:
        return
    ran: list = []
    with modes_kept(net), contextlib.suppress(Exception):  # (a forward the new neurons fail: at the first call)
        net.eval()
        run_hooked(net, example_input, [old.register_forward_pre_hook(lambda m, args, n=name: ran.append(n))
                                        for name, old in found if id(old) in new_of])
    if ran:
        warnings.warn(f"replace_neurons swapped {', '.join(dict.fromkeys(ran))} in the network, but its forward "
                      f"still runs the old neuron(s), reached through a reference outside the module tree (e.g. "
                      f"a plain list or dict): use nn.ModuleList / nn.ModuleDict, or call the modules by their "
                      f"attributes", UserWarning, stacklevel=3)


def _order(net: nn.Module, found: list, example_input) -> tuple[dict, str]:
    """Sort ``found`` in place in the order its neurons run on ``example_input`` (when given):
    ``({id(neuron): channels}, 'forward')``, else ``({}, 'registration')``."""
    if example_input is None or not found:
        return {}, "registration"
    channels = _run_order(net, found, example_input)
    ranked = {mid: i for i, mid in enumerate(channels)}
    found.sort(key=lambda nm: ranked.get(id(nm[1]), len(ranked)))
    return channels, "forward"


def _slots(net: nn.Module) -> dict[int, list]:
    """Every ``(parent, name)`` slot each module (by id) fills in ``net``."""
    slots: dict[int, list] = {}
    for parent, name, child in module_slots(net):
        slots.setdefault(id(child), []).append((parent, name))
    return slots


@functools.lru_cache(maxsize=None)
def _plain_bn_forwards() -> frozenset:
    """The forwards of torch's and SpikingJelly's plain batch norms, the ones a neuron can apply."""
    names = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d")
    classes = [getattr(nn, n) for n in names] + [c for c in map(_compat.sj_layer, names) if c is not None] + \
        [_compat.BatchNorm1d]
    return frozenset(c.forward for c in classes)


def _output_bn(m: nn.Module, multi_step: bool) -> Optional[nn.Module]:
    """The batch norm whose output is ``m``'s output, normalising as the input batch norm of a neuron in
    that step mode does (a multi-step one over time, samples and features; a single-step one each step
    over samples and features), or None."""
    if isinstance(m, FusedBatchNorm):  # (fused into another neuron already)
        return None
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        if type(m).forward not in _plain_bn_forwards():  # (e.g. SyncBatchNorm, TEBN: not a plain normalisation)
            return None
        step_mode = getattr(m, "step_mode", None if multi_step else "s")
        fits = step_mode == ("m" if multi_step else "s") or (step_mode is None and not multi_step)
        tracked = m.track_running_stats and m.running_mean is not None
        lazy = any(nn.parameter.is_lazy(t) for t in (m.weight, m.running_mean) if t is not None)
        return m if fits and tracked and not lazy else None
    if type(m) is nn.Sequential and len(m):
        return _output_bn(m[-1], multi_step)
    if type(m) is _compat.sj_layer("SeqToANNContainer") and len(m) and multi_step:
        return _output_bn(m[-1], False)  # (its steps flattened into the batch)
    return None


def fuse_batchnorm(net: nn.Module, example_input=None) -> list[tuple[str, str]]:
    """Let each MF-PSN apply the batch norm in front of it, in place: ``[(batch norm name, neuron name)]``.

    A pair is a batch norm whose output goes only to the neuron: in a ``torch.fx`` trace of the forward
    (concrete tracing with ``example_input`` where it branches on its input), a batch norm call (or a
    ``SeqToANNContainer`` ending in one) that is the neuron's only input and has no other reader, as
    in ``nn.Sequential`` networks and forwards written by hand (``self.sn1(self.bn1(self.conv1(x)))``,
    SpikingJelly's model zoo). Where the forward does not trace, consecutive children of an
    ``nn.Sequential`` (the batch norm possibly the last layer of a ``Sequential`` or
    ``SeqToANNContainer`` before the neuron) are taken as pairs, in ``net`` and in the containers
    reached from it through ``nn.Sequential`` forwards only (another forward may read the batch norm's
    output elsewhere; a warning says where nothing could be fused for that reason). The batch
    norm becomes, in place, a :class:`~spikingjelly_mfpsn.neuron.FusedBatchNorm` of its own class (the
    same tensors and ``state_dict`` keys) that passes X through, and the neuron normalises its input
    itself, in the batch norm's training mode: on ``'triton'``
    inside its kernels, reading X instead of writing and reading the normalised copy. Same results, in
    training and eval. A pair where a hook could change the tensor between the two (a forward hook on the
    batch norm, a forward pre-hook on the neuron) is left apart, with a warning. :func:`unfuse_batchnorm`
    undoes it; ``deploy.fold`` and the exporters undo it on what they fold.
    """
    _check_net(net)
    slots, pairs, hooked, traced = _slots(net), [], [], _traced_pairs(net, example_input)
    if traced is None and type(net).forward is not nn.Sequential.forward and not runs_time_last(net) and \
            any(isinstance(m, MulFreeChannelwisePSN) and m.input_bn is None for m in net.modules()):
        warnings.warn(f"fuse_batchnorm cannot trace {type(net).__name__}.forward (to see what reads each batch "
                      f"norm's output), so it fuses no pair that this forward runs; a forward that traces (given "
                      f"example_input where it branches on its input's shape) can be fused", stacklevel=2)
    for before, sn in _sequential_pairs(net) if traced is None else traced:
        if not isinstance(sn, MulFreeChannelwisePSN) or sn.input_bn is not None or before is None:
            continue
        bn = _output_bn(before, sn.step_mode == "m")
        if bn is None or len(slots.get(id(bn), ())) != 1 or len(slots.get(id(sn), ())) != 1 or \
                (sn.channels is not None and (bn.num_features != sn.channels
                                              or bn.running_mean.dtype != sn.weight.dtype)):
            continue
        if _hooked_between(before, bn, sn):
            hooked.append((bn, sn))
            continue
        sn.set_input_bn(FusedBatchNorm.fuse(bn))
        pairs.append(sn)
    names = {id(m): name for name, m in net.named_modules()}
    if hooked:
        warnings.warn(f"fuse_batchnorm left {', '.join(f'{names[id(b)]} -> {names[id(n)]}' for b, n in hooked)} "
                      f"unfused: a forward hook on the batch norm or a forward pre-hook on the neuron could change "
                      f"the tensor between them, and fused, the neuron would normalise that tensor instead", stacklevel=2)
    _compat.invalidate_reset_cache(net)
    if not pairs and any(isinstance(m, layer.TimeLastBatchNorm) and not isinstance(m.time_first_module, FusedBatchNorm)
                         for m in net.modules()):
        warnings.warn("fuse_batchnorm fused nothing: it finds its pairs in time-first networks, and this one has "
                      "time-last batch norms. Fuse before to_time_last or autoselect (or convert back with "
                      "to_time_first, fuse, and convert again)", stacklevel=2)
    return [(names[id(sn.input_bn)], names[id(sn)]) for sn in pairs]


def _hooked_between(before: nn.Module, bn: nn.Module, sn: nn.Module) -> bool:
    """Whether a hook could change the tensor between a batch norm and the neuron after it: a forward hook on
    the batch norm (or on a container ending in it) or a forward pre-hook of the neuron (but for its lazy
    initialisation)."""
    lazy = getattr(sn, "_initialize_hook", None)
    if any(key != getattr(lazy, "id", None) for key in sn._forward_pre_hooks):
        return True
    m = before
    while m is not bn:
        if m._forward_hooks:
            return True
        m = m[-1]
    return bool(bn._forward_hooks)


def _sequential_pairs(net: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Consecutive children ``(before, neuron)`` of ``net`` and of the containers inside it, where each of
    them down from ``net`` runs ``nn.Sequential``'s forward (which hands a child's output to the next child
    only); none where another forward runs the children (it may read a batch norm's output elsewhere)."""
    if type(net).forward is not nn.Sequential.forward:
        return []
    children = [c for c in net._modules.values() if c is not None]
    pairs = [(a, b) for a, b in zip(children, children[1:]) if isinstance(b, MulFreeChannelwisePSN)]
    return pairs + [pair for child in children for pair in _sequential_pairs(child)]


def _traced_pairs(net: nn.Module, example_input) -> Optional[list[tuple[nn.Module, nn.Module]]]:
    """``(before, neuron)`` where, in the fx trace of ``net``'s forward, the module call ``before`` (called
    once) feeds only the neuron's call (called once), as its one argument; None if the forward does not
    trace, or not alike in every mode (it branches on ``self.training`` or switches gradient mode). The
    trace sees through ``nn.Sequential``: consecutive children whose batch norm output the forward also
    reads elsewhere (a block iterated by hand) are no pair."""
    try:
        graph, _, _ = tracing.trace(net, example_input, every_mode=True)
    except tracing.TraceFailure:
        return None
    calls = [n for n in graph.nodes if n.op == "call_module"]
    once = {target for target, count in Counter(n.target for n in calls).items() if count == 1}
    return [(net.get_submodule(n.args[0].target), net.get_submodule(n.target)) for n in calls
            if n.target in once and len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op == "call_module" and n.args[0].target in once and len(n.args[0].users) == 1]


def unfuse_batchnorm(net: nn.Module) -> nn.Module:
    """Undo :func:`fuse_batchnorm` in place and return ``net``.

    The batch norm modules go back where they were, with the tensors they hold now (inside their
    time-last wrappers too); the neurons normalise nothing."""
    _check_net(net)
    fused = {id(m): m for m in net.modules() if isinstance(m, FusedBatchNorm)}
    for m in net.modules():
        if isinstance(m, MulFreeChannelwisePSN) and m.input_bn is not None:
            fused[id(m.input_bn)] = m.input_bn
            m.set_input_bn(None)
    for bn in fused.values():
        bn.unfused()
    _compat.invalidate_reset_cache(net)
    return net


def update_bn(loader, model: nn.Module, device=None) -> None:
    """``torch.optim.swa_utils.update_bn`` that also recomputes the statistics of BN-threshold MF-PSNs.

    One pass over ``loader`` recomputes the running statistics of every batch norm (time-last wrapped ones
    too) and of every ``threshold='bn'`` neuron. torch's resets and recomputes batch norms only, so the
    neurons' statistics (of an ``AveragedModel``'s averaged weights, say) stayed those of other weights. As
    torch's: statistics reset, averaged over the batches (``momentum=None``), momenta put back; ``loader``
    yields inputs or ``(input, ...)`` sequences, moved to ``device`` where given; every module trains during
    the pass (folded, inference-only neurons excepted). Unlike torch's, it runs without gradients, puts back
    each module's own train/eval mode (a frozen batch norm's eval) and, where a batch fails, the statistics
    from before; it resets the network's state (``functional.reset_net``) before each batch and after.
    """
    _check_net(model)
    tracked = list({id(m): m for m in map(_tracked_stats, model.modules()) if m is not None}.values())
    saved = [(m, m.momentum, {name: t.clone() for name, t in _stats_of(m).items()}) for m in tracked]
    try:
        with modes_kept(model), torch.no_grad():
            for m in tracked:
                m.reset_running_stats()
                m.momentum = None
            model.train()
            for m in model.modules():  # (deploy.fold's neurons: inference only, no statistics)
                if isinstance(m, _ChargeNeuronBase) and not isinstance(m, MulFreeChannelwisePSN):
                    m.eval()
            for x in loader:
                x = x[0] if isinstance(x, (list, tuple)) else x
                _compat.functional.reset_net(model)
                model(x if device is None else x.to(device))
    except BaseException:
        with torch.no_grad():
            for m, _, before in saved:
                for name, t in before.items():
                    getattr(m, name).copy_(t)
        raise
    finally:
        for m, momentum, _ in saved:
            m.momentum = momentum
        _compat.functional.reset_net(model)


def _tracked_stats(m: nn.Module) -> Optional[nn.Module]:
    """The module holding running statistics that ``m`` updates (a time-last wrapper's batch norm), or None."""
    m = getattr(m, "time_first_module", m) if isinstance(m, layer.TimeLastModule) else m
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None:
        return m
    return m if isinstance(m, MulFreeChannelwisePSN) and m.threshold == "bn" else None


def _stats_of(m: nn.Module) -> dict:
    named = {name: getattr(m, name) for name in ("running_mean", "running_var", "num_batches_tracked")}
    return {name: t for name, t in named.items() if t is not None and not nn.parameter.is_lazy(t)}


def _check_instance(instance) -> None:
    if not (isinstance(instance, type) or isinstance(instance, tuple) and all(isinstance(t, type) for t in instance)):
        raise TypeError(f"instance must be a module class or a tuple of them, got {instance!r}")


def set_backend(net: nn.Module, backend: str, instance=(nn.Module,)) -> nn.Module:
    """Set ``backend`` on every module of type ``instance`` that has one and supports it.

    Modules that do not support ``backend`` are skipped, logged once per class and reason (SpikingJelly
    0.0.0.0.14 style).
    """
    _check_instance(instance)
    skipped: Counter = Counter()
    for m in net.modules():
        if not isinstance(m, instance) or not hasattr(m, "backend") or not hasattr(m, "supported_backends"):
            continue
        if backend in m.supported_backends:
            try:
                m.backend = backend
            except (ImportError, NotImplementedError, ValueError) as e:  # library missing at run time
                skipped[(type(m).__name__, f"cannot use backend={backend!r} ({e})", m.backend)] += 1
        else:
            skipped[(type(m).__name__, f"does not support backend={backend!r}", m.backend)] += 1
    for (name, why, kept), count in skipped.items():
        logger.warning("%s (%d module%s) %s; it keeps backend=%r", name, count, "s" * (count > 1), why, kept)
    return net


def set_method(net: nn.Module, method: str, layout: Optional[str] = None, instance=(nn.Module,),
               example_input=None) -> nn.Module:
    """Set ``method`` on every module of type ``instance`` that supports it.

    A module supports it when its ``supported_methods`` (or, for MF-PSN neurons, ``candidate_methods``: a
    method of another available backend, which switches the neuron's backend too) has it.

    ``'auto'`` is accepted by every such module; others are skipped, with one warning per class that has
    modules which do not support it, unless no module of that class does while modules of another class
    do (a neuron method is not meant for the time-last layer wrappers, nor theirs for neurons). With ``layout``, the
    network is first converted to that layout (:func:`~spikingjelly_mfpsn.to_time_last` /
    :func:`~spikingjelly_mfpsn.to_time_first`, sharing parameters; ``example_input`` is passed to
    ``to_time_last``, which needs it where the forward makes calls that depend on where the time axis
    is). Returns the network (use the return value: a network that is a single layer may come back wrapped).
    """
    _check_instance(instance)
    if layout is not None:
        from .convert import current_layout, to_time_first
        ops.check_layout(layout)
        if current_layout(net) != layout:
            net = to_time_last(net, example_input=example_input) if layout == "time_last" else to_time_first(net)
    taken, skipped = Counter(), {}
    for m in net.modules():
        supported = getattr(m, "supported_methods", None) if isinstance(m, instance) else None
        if supported is None:
            continue
        supported = list(supported) + [c for c in getattr(m, "candidate_methods", ()) if c not in supported]
        if method == "auto" or method in supported:
            m.method = method
            taken[type(m)] += 1
        else:
            skipped.setdefault(type(m), []).append((m, supported))
    for cls, modules in skipped.items():
        if taken[cls] or not taken:
            m, supported = modules[0]
            logger.warning("%s does not support method=%r (%d of its modules; it supports %s); they keep their "
                           "method (%s)", cls.__name__, method, len(modules), supported, m.method)
    return net


def autoselect(net: nn.Module, x_example, m: int = 2, layouts=("time_first", "time_last"), cache=True,
               measure_fn: Optional[Callable] = None, progress: Optional[bool] = None, verbose: bool = False,
               compile: Union[bool, str] = False, fallback: Optional[str] = None):
    """Time every layer's implementations in each layout and apply the fastest (paper Algorithm 1).

    Every argument as :func:`spikingjelly_mfpsn.tuner.autoselect` documents it.
    """
    from .tuner import autoselect as _autoselect
    return _autoselect(net, x_example, m=m, layouts=layouts, cache=cache, measure_fn=measure_fn, progress=progress,
                       verbose=verbose, compile=compile, fallback=fallback)
