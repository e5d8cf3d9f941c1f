"""Operation counts and inference energy of spiking networks (paper Sec. 5.4, App. F, Tables 1, 5, 11).

Neuron layers (per neuron, i.e. per channel and feature position, over ``T`` steps; the paper's
convention counts one ADD per multiply/shift, accumulating, plus one ADD per step for the threshold):

* MF-PSN: ``S`` SHIFT and ``S + T`` ADD, ``S`` = taps that fall inside the sequence. The paper's
  ``S = (T + (1-k)/2) k`` assumes ``d = 1`` and ``T >= k``; in general
  ``S = sum_j max(0, T - j d) = m T - d m (m-1) / 2`` with ``m = min(k, ceil(T / d))`` (tap ``j`` steps
  back reaches ``T - j d`` outputs), see :func:`taps_in_sequence`.
* PSN: ``T^2`` MUL and ``T^2 + T`` ADD (a dense ``(T, T)`` matrix product plus the threshold).

Synaptic layers (paper Eq. syn energy, after Spikformer): an *encoding* layer (a Conv/Linear that runs
before any spiking neuron on non-spike input) costs its dense MACs (FLOPs), and so does a *dense* one
(a Conv/Linear after a neuron whose input is not spikes: values outside [0, 1], e.g. the output of
another Linear); every other Conv/Linear costs ``SOPs = fr x T x FLOPs(l)`` accumulates (AC), ``fr`` =
the mean of its input (the firing rate for spikes, the mean spike count per element for average-pooled
spikes). Energy at 45 nm:
:data:`COSTS_45NM`, all overridable.

Two counts are kept per layer and compared by the tests: ``counts`` (the closed forms / paper
formulas above, what the energy uses) and ``counted`` (what runs: the integer neuron's tap schedule,
the PSN's matrix shapes, and for synapses the exact spike events ``sum(input x fan-out)``). With
SpikingJelly 2.x the synaptic side also comes from SpikingJelly's own ``op_counter`` (MACCounter for
encoding layers, SynOpCounter for spike inputs), and :class:`NeuronOpCounter` registers MF-PSN / PSN
rules there (ADD and SHIFT, no MUL, for MF-PSN) so SpikingJelly's profilers count them correctly
(:class:`MulFreeEnergyProfiler`). All counts are per sample.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _compat, ops
from ._util import as_args, modes_kept, run_hooked
from .convert import runs_time_first_inside
from .layer import TimeLastModule
from .deploy import FoldedMulFreePSN
from .ops.registry import tap_schedule
from .neuron import FusedBatchNorm, MulFreeChannelwisePSN

#: Energy per operation in pJ at 45 nm (paper Sec. 5.4: FP32 MUL/ADD, FIX32 SHIFT, MAC/AC of Eq. syn).
COSTS_45NM = {"mul": 3.7, "add": 0.9, "shift": 0.13, "mac": 4.6, "ac": 0.9}

NEURON_OPS = ("shift", "add", "mul")
SYNAPTIC_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
MFPSN_TYPES = (MulFreeChannelwisePSN, FoldedMulFreePSN)
NEURON_TYPES = MFPSN_TYPES + ((_compat.PSN,) if _compat.PSN is not None else ())


def check_costs(costs: Optional[dict] = None) -> dict:
    """:data:`COSTS_45NM` with ``costs`` (pJ per op) overriding it; unknown or negative values raise."""
    merged = dict(COSTS_45NM)
    for name, value in (costs or {}).items():
        if name not in COSTS_45NM:
            raise ValueError(f"costs: unknown operation {name!r}; expected some of {tuple(COSTS_45NM)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"costs[{name!r}] must be a finite number >= 0 (pJ), got {value!r}")
        merged[name] = float(value)
    return merged


# ---------------------------------------------------------------------------------- closed forms
def taps_in_sequence(t: int, k: int, dilation: int = 1) -> int:
    """Number of (step, tap) pairs with the tap inside the sequence: ``sum_j max(0, T - j d)``, j < k.

    Closed form ``m T - d m (m-1) / 2``, ``m = min(k, ceil(T / d))``; equals the paper's
    ``(T + (1-k)/2) k`` when ``d = 1`` and ``T >= k``.
    """
    for name, value, least in (("t", t, 0), ("k", k, 1), ("dilation", dilation, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    m = min(k, -(-t // dilation)) if t > 0 else 0
    return m * t - dilation * m * (m - 1) // 2


def neuron_ops(kind: str, t: int, k: Optional[int] = None, dilation: int = 1) -> dict[str, int]:
    """SHIFT/ADD/MUL of one neuron over ``t`` steps (Table 1, generalised to any ``d`` and ``T``).

    ``kind``: ``'mfpsn'`` (SHIFT), ``'channelwise_psn'`` (the unquantised MF-PSN: MUL) or ``'psn'``.
    """
    if kind == "psn":
        taps_in_sequence(t, 1)  # (checks t as the other kinds do)
        return {"shift": 0, "add": t * t + t, "mul": t * t}
    if kind not in ("mfpsn", "channelwise_psn"):
        raise ValueError(f"kind must be 'mfpsn', 'channelwise_psn' or 'psn', got {kind!r}")
    s = taps_in_sequence(t, k, dilation)
    op = "shift" if kind == "mfpsn" else "mul"
    return {"shift": 0, "mul": 0, op: s, "add": s + t}


def table1(t: int, k: int) -> dict[str, dict[str, float]]:
    """The paper's Table 1 formulas as printed (``d = 1``, ``T >= k``), per neuron."""
    s = (t + (1 - k) / 2) * k
    return {"psn": {"add": t * t + t, "mul": t * t},
            "sliding_psn": {"add": s + t, "mul": s},
            "mfpsn": {"add": s + t, "shift": s}}


def table11(costs: Optional[dict] = None) -> dict[str, str]:
    """The paper's Table 11: each neuron's operations and its energy in pJ as a formula in T and k.

    With the default costs: PSN ``4.6 T^2 + 0.9 T``, MF-PSN ``1.03 (T+(1-k)/2) k + 0.9 T``, whose
    maximum at ``k = T`` is ``0.515 T^2 + 1.415 T``.
    """
    c = check_costs(costs)
    ours = c["shift"] + c["add"]
    return {"psn": f"(T^2+T) ADD, T^2 MUL: {c['mul'] + c['add']:g} T^2 + {c['add']:g} T pJ",
            "mfpsn": f"((T+(1-k)/2) k + T) ADD, ((T+(1-k)/2) k) SHIFT: "
                     f"{ours:g} (T+(1-k)/2) k + {c['add']:g} T pJ",
            "mfpsn_max": f"k = T: {ours / 2:g} T^2 + {ours / 2 + c['add']:g} T pJ"}


def neuron_energy_pj(kind: str, t: int, k: Optional[int] = None, dilation: int = 1,
                     costs: Optional[dict] = None) -> float:
    """Energy of one neuron over ``t`` steps (Table 11's numbers)."""
    c = check_costs(costs)
    return sum(n * c[op] for op, n in neuron_ops(kind, t, k, dilation).items())


# ---------------------------------------------------------------------------------- per-module counts
def neuron_kind(module: nn.Module) -> Optional[str]:
    """The kind of neuron ``module`` is, as the energy model names it (see :func:`neuron_ops`).

    Args:
        module: any module.

    Returns:
        ``'channelwise_psn'`` for a :class:`MulFreeChannelwisePSN` without quantisation, ``'mfpsn'`` for
        another MF-PSN, ``'psn'`` for SpikingJelly's PSN, else None.
    """
    if isinstance(module, MulFreeChannelwisePSN) and not module.quantize:
        return "channelwise_psn"
    if isinstance(module, MFPSN_TYPES):
        return "mfpsn"
    return "psn" if _compat.PSN is not None and isinstance(module, _compat.PSN) else None


def _sequence_geometry(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(T, neurons) of a multi-step neuron call."""
    if getattr(module, "step_mode", "m") != "m":
        raise ValueError(f"operation counts need whole sequences: {type(module).__name__} is in step_mode "
                         f"{module.step_mode!r}; count with functional.set_step_mode(net, 'm')")
    t = x.shape[ops.time_dim(module.layout)] if isinstance(module, MFPSN_TYPES) else x.shape[0]
    return t, x.numel() // t


def closed_form_neuron_ops(module: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """:func:`neuron_ops` times the number of neurons of this call."""
    t, n = _sequence_geometry(module, x)
    k, d = getattr(module, "k", None), getattr(module, "dilation", 1)
    return {op: v * n for op, v in neuron_ops(neuron_kind(module), t, k, d).items()}


def counted_neuron_ops(module: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Operations the neuron runs on ``x``, counted from what it computes.

    For MF-PSN the integer path's tap schedule (:func:`ops.tap_schedule`, one shift and one add per tap
    element, one threshold add per step); for PSN the shapes of its ``addmm(bias, W, X)``.
    """
    t, n = _sequence_geometry(module, x)
    kind = neuron_kind(module)
    if kind == "psn":
        rows, cols = module.weight.shape
        return {"shift": 0, "mul": rows * cols * n, "add": rows * cols * n + rows * n}
    taps = sum((t - first) * n for _, _, first in tap_schedule(t, module.k, module.dilation))
    op = "shift" if kind == "mfpsn" else "mul"
    return {"shift": 0, "mul": 0, op: taps, "add": taps + t * n}


def dense_macs(module: nn.Module, out: torch.Tensor) -> int:
    """MACs of a dense (non-event) Conv/Linear call with output ``out``: its FLOPs in the paper."""
    if isinstance(module, nn.Linear):
        return out.numel() * module.in_features
    return out.numel() * (module.in_channels // module.groups) * prod(module.kernel_size)


@torch.no_grad()
def spike_events(module: nn.Module, x: torch.Tensor) -> Union[int, float]:
    """Accumulates an event-driven Conv/Linear runs on input ``x``.

    The count is ``sum over inputs of value x fan-out`` (for spikes, each spike adds one weight to every
    output it reaches; zero padding reaches nothing): an int for spikes, a fraction for pooled ones.
    """
    if isinstance(module, nn.Linear):
        return _whole_if_integral(float(x.double().sum()) * module.out_features)
    dims = len(module.kernel_size)
    x = x.reshape(-1, *x.shape[-dims - 1:]).double()  # (T*N or N, C, *spatial)
    padding = module.padding
    if module.padding_mode != "zeros":
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = 0
    ones = x.new_ones(module.groups, module.in_channels // module.groups, *module.kernel_size)
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    reach = conv(x, ones, None, module.stride, padding, module.dilation, module.groups)
    return _whole_if_integral(float(reach.sum()) * (module.out_channels // module.groups))


def _whole_if_integral(count: float) -> Union[int, float]:
    return int(count) if count.is_integer() else count


def _synaptic_layer(module: nn.Module) -> Optional[nn.Module]:
    """The Conv/Linear ``module`` runs: itself, or the one a time-last wrapper runs on ``(N, ..., T)``
    (the wrapper calls it without its hooks, so the wrapper is what gets counted)."""
    inner = module.time_first_module if isinstance(module, TimeLastModule) else module
    return inner if isinstance(inner, SYNAPTIC_TYPES) else None


# ---------------------------------------------------------------------------------- report
@dataclass
class LayerCount:
    """One neuron or synaptic layer of an :class:`EnergyReport` (all counts per sample).

    ``role``: ``'neuron'``, ``'encoding'`` or ``'dense'`` (dense MACs: non-spike input before any neuron,
    or after one) or ``'synaptic'`` (SOPs). ``counts``: what the
    energy uses (closed forms; SOPs by the paper's formula or the events, see ``sops``);
    ``counted``: what ran; ``spikingjelly``: SpikingJelly's counters (2.x), else ``None``.
    """

    name: str
    role: str
    kind: str
    counts: dict
    counted: dict
    spikingjelly: Optional[dict] = None
    firing_rate: Optional[float] = None
    time_steps: Optional[int] = None


@dataclass
class EnergyReport:
    """Operation counts and energy of one inference, per sample, as :func:`estimate` returns them.

    ``layers``: a :class:`LayerCount` per neuron or synaptic layer; ``costs``: pJ per operation;
    ``batch_size``: samples in the input; ``sops``: how synaptic operations were counted (``'formula'`` or
    ``'events'``); ``notes``: remarks on how the counts were made.
    """

    layers: list
    costs: dict
    batch_size: int
    sops: str
    notes: list = field(default_factory=list)

    def ops(self, roles=("neuron",)) -> dict[str, float]:
        total = Counter()
        for layer in self.layers:
            if layer.role in roles:
                total.update(layer.counts)
        return dict(total)

    @property
    def neuron_ops(self) -> dict[str, float]:
        return self.ops()

    @property
    def synaptic_ops(self) -> dict[str, float]:
        """``{'mac': encoding and dense MACs (FLOPs), 'sop': SOPs}`` per sample."""
        ops_ = self.ops(("encoding", "dense", "synaptic"))
        return {"mac": ops_.get("mac", 0), "sop": ops_.get("sop", 0)}

    @property
    def neuron_energy_uj(self) -> float:
        n = self.neuron_ops
        return sum(n.get(op, 0) * self.costs[op] for op in NEURON_OPS) * 1e-6

    @property
    def synaptic_energy_uj(self) -> float:
        s = self.synaptic_ops
        return (s["mac"] * self.costs["mac"] + s["sop"] * self.costs["ac"]) * 1e-6

    @property
    def total_energy_uj(self) -> float:
        return self.neuron_energy_uj + self.synaptic_energy_uj

    def row(self, label: str) -> list[str]:
        n, s = self.neuron_ops, self.synaptic_ops
        neuron = ", ".join(f"{n[op]:.3g} {op.upper()}" for op in NEURON_OPS if n.get(op))
        return [label, neuron or "-", f"{self.neuron_energy_uj:.2f}", f"{s['mac']:.4g} FLOPs, {s['sop']:.4g} SOPs",
                f"{self.synaptic_energy_uj:.2f}", f"{self.total_energy_uj:.2f}"]

    def layer_table(self) -> str:
        """Per-layer counts (per sample) and firing rates."""
        rows = [[layer.name, layer.role, layer.kind, str(layer.time_steps or "-"),
                 "-" if layer.firing_rate is None else f"{layer.firing_rate:.4f}",
                 ", ".join(f"{v:.4g} {op.upper()}" for op, v in layer.counts.items() if v)] for layer in self.layers]
        return _format([["layer", "role", "kind", "T", "input fr", "counts"]] + rows)

    def __str__(self) -> str:
        return table5({"net": self})


def _format(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def table5(reports: dict[str, EnergyReport]) -> str:
    """A table like the paper's Table 5: one row per report (neuron ops, synaptic ops, energies in uJ)."""
    header = ["Neuron", "Neuron layer ops", "Energy (uJ)", "Synaptic layer ops", "Energy (uJ)", "Total (uJ)"]
    costs = next(iter(reports.values())).costs if reports else COSTS_45NM
    title = ("Energy per sample at " + ", ".join(f"{op.upper()} {v:g}" for op, v in costs.items()) + " pJ")
    return title + "\n" + _format([header] + [r.row(label) for label, r in reports.items()])


# ---------------------------------------------------------------------------------- estimate
def _per_sample(counts: Optional[dict], batch: int) -> Optional[dict]:
    return None if counts is None else {op: v / batch for op, v in counts.items()}


def _own_pass(net: nn.Module, x) -> list[dict]:
    """Run ``net`` once with forward hooks; one record per neuron / synaptic call, in call order."""
    records: list[dict] = []

    def on_neuron(module, inputs, out, name):
        x_in = inputs[0] if not runs_time_first_inside(module) else inputs[0].movedim(-1, 0)  # (hooks see time-last)
        t, _ = _sequence_geometry(module, x_in)
        records.append(dict(name=name, role="neuron", kind=neuron_kind(module), time_steps=t,
                            counts=closed_form_neuron_ops(module, x_in), counted=counted_neuron_ops(module, x_in)))

    def on_synapse(wrapper, inputs, out, name, module):
        time_last = wrapper is not module or runs_time_first_inside(wrapper)  # (a wrapper, or an island's outside)
        x_in = inputs[0].movedim(-1, 0) if time_last else inputs[0]  # (T first)
        binary = bool(((x_in == 0) | (x_in == 1)).all())
        macs = dense_macs(module, out.movedim(-1, 0) if runs_time_first_inside(wrapper) else out)
        record = dict(name=name, kind=type(module).__name__, binary=binary)
        after_neuron = any(r["role"] == "neuron" for r in records)
        if binary or after_neuron and bool(((x_in >= 0) & (x_in <= 1)).all()):  # (spikes, or pooled spikes)
            record.update(role="synaptic", firing_rate=float(x_in.double().mean()), dense=macs,
                          counted={"sop": spike_events(module, x_in)})
        else:  # non-spike input, before any neuron or after one
            record.update(role="dense" if after_neuron else "encoding", counts={"mac": macs}, counted={"mac": macs})
        records.append(record)

    hooks = []
    for name, module in net.named_modules():
        label = name or type(net).__name__
        if neuron_kind(module) is not None:
            hooks.append(module.register_forward_hook(partial(on_neuron, name=label)))
        elif (layer := _synaptic_layer(module)) is not None:
            hooks.append(module.register_forward_hook(partial(on_synapse, name=label, module=layer)))
    run_hooked(net, x, hooks)
    return records


def _spikingjelly_pass(net: nn.Module, x) -> dict[str, dict]:
    """SpikingJelly's counters on one run: ``{scope: {'mac', 'sop'} or neuron ops}``; resets the network
    after its run."""
    oc = _compat.op_counter
    mac = oc.MACCounter(extra_ignore_modules=list(NEURON_TYPES))
    synop = oc.SynOpCounter(extra_ignore_modules=list(NEURON_TYPES))
    neuron = NeuronOpCounter()
    with oc.ModuleCounterMode([neuron], model=net), oc.DispatchCounterMode([mac, synop]):
        net(*as_args(x))
    _compat.functional.reset_net(net)
    scopes: dict[str, dict] = {}
    for counter, op in ((mac, "mac"), (synop, "sop")):
        for scope, per_func in counter.get_counts().items():
            scopes.setdefault(scope, {})[op] = sum(per_func.values())
    for scope, per_op in neuron.get_counts().items():
        scopes.setdefault(scope, {}).update(per_op)
    return scopes


def _check_rates(firing_rate) -> None:
    """A firing rate is a fraction of the inputs that spike: a number in [0, 1] (or a dict of them)."""
    if firing_rate is None:
        return
    rates = firing_rate.items() if isinstance(firing_rate, dict) else [("firing_rate", firing_rate)]
    for name, rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"firing_rate{'' if name == 'firing_rate' else f'[{name!r}]'} must be a number in "
                             f"[0, 1] (the fraction of inputs that spike per step), got {rate!r}")


@torch.no_grad()
def estimate(net: nn.Module, x, *, costs: Optional[dict] = None, sops: str = "formula",
             firing_rate: Union[None, float, dict] = None, batch_size: Optional[int] = None,
             layout: str = "time_first", use_spikingjelly: bool = True) -> EnergyReport:
    """Operation counts and energy of one inference of ``net`` on ``x``, per sample.

    Args:
        net: a multi-step network with MulFreeChannelwisePSN (folded or not) and/or PSN neurons
        x: its input sequence, or a tuple of its positional inputs (the first a sequence: it gives
            the batch size); ``net`` runs once in eval mode (its train/eval flags are restored)
        costs: pJ per operation overriding :data:`COSTS_45NM` (keys mul, add, shift, mac, ac)
        sops: ``'formula'`` (paper: ``fr x T x FLOPs``) or ``'events'`` (exact spike x fan-out
            count) for the energy of non-encoding synaptic layers
        firing_rate: override the measured input firing rate of the SOP formula: one value for
            every synaptic layer, or ``{layer name: rate}``
        batch_size: samples in ``x`` (default: dim 1 for ``layout='time_first'``, dim 0 otherwise)
        use_spikingjelly: with SpikingJelly 2.x, take encoding MACs and spike events from its
            ``op_counter`` (a second run) and record its counts in ``LayerCount.spikingjelly`` (not for a
            module called more than once: its counter totals the calls, so those keep this plugin's counts)
    """
    if sops not in ("formula", "events"):
        raise ValueError(f"sops must be 'formula' or 'events', got {sops!r}")
    first = next(iter(as_args(x)), None)
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (or a tuple of inputs, the first a tensor), got "
                        f"{type(x).__name__}" + (f" of {type(first).__name__}" if isinstance(x, tuple) else ""))
    if batch_size is None:
        if first.dim() < 2:
            raise ValueError(f"cannot infer the batch size from x of shape {tuple(first.shape)}; pass batch_size=")
        batch_size = first.shape[1] if ops.check_layout(layout) == "time_first" else first.shape[0]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if first.dim() and not first.shape[0 if ops.check_layout(layout) == "time_first" else -1]:
        raise ValueError(f"x has no time steps (shape {tuple(first.shape)}): nothing to count")
    cost_table = check_costs(costs)
    _check_rates(firing_rate)
    with modes_kept(net):
        net.eval()
        _compat.functional.reset_net(net)
        records = _own_pass(net, x)  # (both passes reset the network after their run)
        sj = _spikingjelly_pass(net, x) if use_spikingjelly and _compat.op_counter is not None else None
    if not records:
        raise ValueError("net ran no Conv/Linear layer and no MF-PSN/PSN neuron: nothing to count")
    notes = [] if sj is not None else ["synaptic counts derived by this plugin (SpikingJelly's op_counter not used)"]
    layers = _layer_counts(records, sj, type(net).__name__, firing_rate, sops, batch_size)
    return EnergyReport(layers, cost_table, batch_size, sops, notes)


def _layer_counts(records: list[dict], sj: Optional[dict], root: str, firing_rate, sops: str,
                  batch: int) -> list[LayerCount]:
    """Each layer's counts per sample: this plugin's records, with SpikingJelly's counts ``sj`` where
    taken (scopes under the network's class name ``root``)."""
    if isinstance(firing_rate, dict):
        synaptic = [r["name"] for r in records if r["role"] == "synaptic"]
        unknown = sorted(set(firing_rate) - set(synaptic))
        if unknown:
            raise ValueError(f"firing_rate names no synaptic layer {unknown}; the synaptic layers are {synaptic}")
    layers, calls = [], Counter(r["name"] for r in records)
    for r in records:
        scope = r["name"] if r["name"] == root else f"{root}.{r['name']}"
        # (SpikingJelly totals a module's calls in its scope: a module called twice keeps this plugin's counts)
        theirs = None if sj is None or calls[r["name"]] > 1 else sj.get(scope, {})
        if r["role"] == "synaptic":
            fr = r["firing_rate"]
            if firing_rate is not None:
                fr = firing_rate.get(r["name"], fr) if isinstance(firing_rate, dict) else float(firing_rate)
            # SpikingJelly counts events only for binary inputs (it treats pooled spikes as dense MACs).
            events = theirs["sop"] if theirs is not None and r["binary"] else r["counted"]["sop"]
            r["counts"] = {"sop": fr * r["dense"] if sops == "formula" else events}
        elif r["role"] in ("encoding", "dense") and theirs is not None:
            r["counts"] = {"mac": theirs.get("mac", 0)}
        layers.append(LayerCount(r["name"], r["role"], r["kind"], _per_sample(r["counts"], batch),
                                 _per_sample(r["counted"], batch), _per_sample(theirs, batch),
                                 r.get("firing_rate"), r.get("time_steps")))
    return layers


# ---------------------------------------------------------------------------------- SpikingJelly 2.x
if _compat.op_counter is not None:
    class NeuronOpCounter(_compat.op_counter.ModuleCounter):
        """SpikingJelly ``ModuleCounter`` rules for MF-PSN (SHIFT and ADD, no MUL) and PSN (MUL and ADD).

        Use it in ``op_counter.ModuleCounterMode([NeuronOpCounter()], model=net)``; ``get_counts()``
        gives ``{scope: {'shift': n, 'add': n, 'mul': n}}``.
        """

        def __init__(self):
            super().__init__()
            self.rules = {("forward", t): self._count for t in NEURON_TYPES}
            self._pending: dict[str, int] = {}

        def _count(self, module, args, kwargs, out) -> int:
            x = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
            self._pending = counted_neuron_ops(module, x)
            return sum(self._pending.values())

        def record(self, scope, func, value) -> None:
            for op, n in self._pending.items():
                self.records[scope][op] += n

        def finalize_record(self) -> None:
            self._pending = {}

        def get_total(self) -> int:
            return sum(self.records.get("Global", {}).values())

    class MulFreeEnergyProfiler(_compat.op_counter.SimpleEnergyProfiler):
        """SpikingJelly's ``SimpleEnergyProfiler`` that knows MF-PSN and PSN neurons.

        Their internal tensor ops (which depend on the charge implementation and are not what a
        mul-free neuron runs) are ignored by the MAC/AC/SynOp counters; :class:`NeuronOpCounter`
        counts their SHIFT/ADD/MUL instead, charged at ``costs`` (default :data:`COSTS_45NM`). The
        report gains ``counts['neuron_shift'|'neuron_add'|'neuron_mul']`` and
        ``breakdown_pj['neuron_pj']``, included in the compute and total energy.
        """

        def __init__(self, *, config=None, costs: Optional[dict] = None):
            config = copy.deepcopy(config or _compat.op_counter.SimpleEnergyConfig())
            config.extra_ignore_modules = list(config.extra_ignore_modules or []) + list(NEURON_TYPES)
            super().__init__(config=config)
            self.costs = check_costs(costs)
            self.neuron_counter = NeuronOpCounter()
            self._neuron_mode = None

        def bind_model(self, model: nn.Module) -> None:
            super().bind_model(model)
            self._neuron_mode = _compat.op_counter.ModuleCounterMode([self.neuron_counter], model=model)
            self._fused = [m for m in model.modules() if isinstance(m, FusedBatchNorm)]

        def __enter__(self):
            if self._neuron_mode is None:
                raise RuntimeError("MulFreeEnergyProfiler.bind_model() must be called before entering.")
            self.neuron_counter.reset()
            self._neuron_mode.__enter__()
            self._hooks = [m.register_forward_hook(_run_fused_batch_norm) for m in self._fused]
            try:
                return super().__enter__()
            except BaseException:
                self._leave(None, None, None)
                raise

        def __exit__(self, exc_type, exc, tb):
            try:
                return super().__exit__(exc_type, exc, tb)
            finally:
                self._leave(exc_type, exc, tb)

        def _leave(self, *exc) -> None:
            for h in self._hooks:
                h.remove()
            self._neuron_mode.__exit__(*exc)

        def get_report(self):
            report = super().get_report()
            ops_ = self.neuron_counter.get_counts().get("Global", {})
            neuron_pj = sum(ops_.get(op, 0) * self.costs[op] for op in NEURON_OPS)
            report.counts.update({f"neuron_{op}": ops_.get(op, 0) for op in NEURON_OPS})
            report.breakdown_pj["neuron_pj"] = neuron_pj
            report.energy_compute_pj += neuron_pj
            report.energy_total_pj += neuron_pj
            return report

    @torch.no_grad()
    def _run_fused_batch_norm(module, args, out) -> None:
        """A fused batch norm's normalisation, run where SpikingJelly's counters see it (the neuron that
        applies it is ignored by them) on copies of its statistics and discarded: the same counts as the
        network before ``fuse_batchnorm``. The counts depend on the input's size and channels only."""
        stats = [None if t is None else t.clone() for t in (module.running_mean, module.running_var)]
        if module.training and module.num_batches_tracked is not None:  # (torch's BatchNorm counts its batches)
            module.num_batches_tracked.clone().add_(1)
        F.batch_norm(args[0].reshape(-1, module.num_features), *stats, module.weight, module.bias,
                     module.training or stats[0] is None, 0.0, module.eps)
else:
    def _needs_spikingjelly2(name: str):
        def missing(*args, **kwargs):
            """Raise ``ImportError``: this needs SpikingJelly 2.x's ``op_counter``."""
            raise ImportError(f"{name} plugs into spikingjelly.activation_based.op_counter, which SpikingJelly "
                              f"{_compat.SJ_VERSION} does not have (it ships with 2.x); energy.estimate() "
                              f"works without it")
        return missing

    NeuronOpCounter = _needs_spikingjelly2("NeuronOpCounter")
    MulFreeEnergyProfiler = _needs_spikingjelly2("MulFreeEnergyProfiler")


__all__ = ["COSTS_45NM", "EnergyReport", "LayerCount", "MulFreeEnergyProfiler", "NeuronOpCounter",
           "check_costs", "closed_form_neuron_ops", "counted_neuron_ops", "dense_macs", "estimate",
           "neuron_energy_pj", "neuron_kind", "neuron_ops", "spike_events", "table1", "table11", "table5",
           "taps_in_sequence"]
