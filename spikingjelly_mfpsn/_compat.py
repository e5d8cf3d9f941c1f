"""The only module that knows which SpikingJelly is installed, and where torch itself needs working around.

Supported: SpikingJelly 2.0.x (no ``backend`` on neurons, no ``functional.set_backend``, ships
``layer.TLastSeqToANNContainer``) and 0.0.0.0.14 (neurons take ``backend=``,
``functional.set_backend`` exists, no PSN family, no time-last containers).
"""
from __future__ import annotations

import importlib.metadata
import logging

import torch
import torch.nn as nn
from packaging.version import Version
from spikingjelly.activation_based import base, functional, layer, neuron, surrogate

logger = logging.getLogger("spikingjelly_mfpsn")

SJ_VERSION = Version(importlib.metadata.version("spikingjelly"))
SJ2 = SJ_VERSION >= Version("0.0.0.1")  # 2.x; 0.0.0.0.14 sorts below it
HAS_SET_BACKEND = hasattr(functional, "set_backend")
TLastSeqToANNContainer = getattr(layer, "TLastSeqToANNContainer", None)
PSN = getattr(neuron, "PSN", None)  # the parallel spiking neuron (2.x only)
try:  # operation counters and energy profilers (2.x only)
    from spikingjelly.activation_based import op_counter
except ImportError:
    op_counter = None

MemoryModule = base.MemoryModule
MultiStepModule = base.MultiStepModule
StepModule = base.StepModule


def sj_layer(name: str):
    """``spikingjelly.activation_based.layer.<name>``, or None where this version lacks it."""
    return getattr(layer, name, None)


def t_last_seq_to_ann_forward(x_seq: torch.Tensor, fn) -> torch.Tensor:
    """Apply the single-step ``fn`` to every step of a time-last ``(N, ..., T)`` sequence at once
    (``torch.vmap`` over the last dim): SpikingJelly's own function where installed."""
    sj_fn = getattr(functional, "t_last_seq_to_ann_forward", None)
    if sj_fn is not None:
        return sj_fn(x_seq, fn)
    return torch.vmap(fn, in_dims=-1, out_dims=-1)(x_seq)


if SJ2:
    BatchNorm1d = layer.BatchNorm1d
else:
    class BatchNorm1d(layer.BatchNorm1d):
        """``layer.BatchNorm1d`` that also takes multi-step ``(T, N, C)`` (0.0.0.0.14 wants ``(T, N, C, L)``)."""

        def forward(self, x):
            if self.step_mode == "m" and x.dim() == 3:
                return nn.BatchNorm1d.forward(self, x.flatten(0, 1)).view(x.shape)
            return super().forward(x)


class _DenseGrad(torch.autograd.Function):
    """The identity, whose gradient leaves contiguous."""

    @staticmethod
    def forward(y):
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form runs under torch.func transforms too)
        pass

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def dense_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, whose gradient leaves contiguous on the CPU where ``x`` has a size-1 dim, so that a batch norm
    in front of the call that gets ``x`` computes its gradients right (see :func:`batch_norm`)."""
    if x.device.type == "cpu" and 1 in x.shape and x.requires_grad and torch.is_grad_enabled():
        return _DenseGrad.apply(x)
    return x


def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps) -> torch.Tensor:
    """``torch.nn.functional.batch_norm``, on the CPU given a contiguous weight and bias, and where ``x`` has a
    size-1 dim, a contiguous input and output gradient.

    A workaround: torch's CPU batch-norm backward (2.13 and earlier) gives wrong gradients, silently,
    where it reads an input or an output gradient whose memory format a size-1 dim makes ambiguous
    (channels the innermost dim, e.g. strides (2, 1, 2, 4) of shape (1, 2, 2, 1)) in the other one's
    format (a sweep of every memory order found it with a size-1 dim only), and the wrong dL/dX of an
    (N, C) input with a strided weight. tests/test_layer.py tells when torch fixes them."""
    if x.device.type == "cpu":
        weight, bias = (None if t is None else t.contiguous() for t in (weight, bias))
        if 1 in x.shape:
            return dense_grad(torch.nn.functional.batch_norm(x.contiguous(), running_mean, running_var, weight,
                                                             bias, training, momentum, eps))
    return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def step_mode_of(module) -> str:
    """A module's step mode: its ``step_mode``, else ``'m'`` for a multi-step-only SpikingJelly module
    (``PSN`` has no ``step_mode``), else ``'s'``."""
    return getattr(module, "step_mode", "m" if isinstance(module, MultiStepModule) else "s")


def default_surrogate():
    return surrogate.ATan()


def invalidate_reset_cache(*nets) -> None:
    """SpikingJelly 2.x caches, per network ``reset_net`` was called on, the modules it resets; after
    modules inside ``nets`` were swapped, drop the entry of each of them, of every block inside them and
    of every cached network holding one of them (``reset_net(parent)`` would otherwise go on resetting
    old modules that a wrapper or a user's variable keeps alive). SpikingJelly lists no cached networks
    publicly: its cache is read where it exists, else only ``nets`` themselves are dropped."""
    fn = getattr(functional, "invalidate_reset_cache", None)
    if fn is None:
        return
    ours = {id(m) for net in nets for m in net.modules()}
    cache = getattr(getattr(functional, "net_config", None), "_RESET_MODULE_CACHE", {})
    for root in [*nets, *list(cache.keys())]:
        if id(root) in ours or any(m is net for m in root.modules() for net in nets):
            fn(root)


def add_to_namespace(namespace, name: str, obj) -> bool:
    """Add ``obj`` to a SpikingJelly namespace as ``name`` unless SpikingJelly defines that name.

    Idempotent: adding the same object twice is a no-op. Returns True when ``namespace.name`` is
    ``obj`` afterwards.
    """
    current = getattr(namespace, name, None)
    if current is obj:
        return True
    if current is not None and not getattr(current, "__module__", "").startswith("spikingjelly_mfpsn"):
        logger.warning("%s.%s already exists; spikingjelly_mfpsn leaves it alone",
                       namespace.__name__, name)
        return False
    setattr(namespace, name, obj)
    return True


def spiking_neuron_classes() -> tuple:
    """Every neuron class SpikingJelly's ``neuron`` namespace defines (IF, LIF, PLIF, the PSN family, ...),
    i.e. the default targets of ``replace_neurons``; this includes the non-spiking readouts of
    :func:`readout_neuron_classes`, which ``replace_neurons`` leaves alone unless asked."""
    return tuple(obj for obj in vars(neuron).values() if isinstance(obj, type) and issubclass(obj, nn.Module)
                 and obj.__module__.startswith("spikingjelly.activation_based.neuron"))


# Neurons whose output is not a 0/1 spike train though their names do not say "NonSpiking", by kind: LIAF
# (leaky integrate and analog fire) outputs ``act(v)``; ternary nodes -1, 0, +1; STBIF (SpikeZIP) signed
# levels, I-LIF integer spike counts, the few-spike family (HG, outlier-aware) and DSR's nodes weighted spikes
# (v_threshold * spike); OTTT's LIF ``[spikes, traces]`` in training, for OTTT's layers.
OTHER_OUTPUTS = {"LIAFNode": "readout", "TernaryIFNode": "ternary", "TernaryLIFNode": "ternary",
                 "STBIFNode": "levels", "ILIFNode": "levels", "FewSpikeNode": "levels", "DSRIFNode": "levels",
                 "DSRLIFNode": "levels", "OTTTLIFNode": "traces"}


def output_kind(cls: type) -> str:
    """What a SpikingJelly neuron class outputs: ``'readout'`` (``NonSpiking*``), a kind of
    :data:`OTHER_OUTPUTS` (also for their subclasses), or ``'spikes'``."""
    names = [c.__name__ for c in cls.__mro__]
    if any("NonSpiking" in n for n in names):
        return "readout"
    return next((OTHER_OUTPUTS[n] for n in names if n in OTHER_OUTPUTS), "spikes")


def readout_neuron_classes() -> tuple:
    """The classes of :func:`spiking_neuron_classes` that output membrane potentials, analog values,
    signed or multi-level spikes or spike traces rather than 0/1 spikes (:func:`output_kind`): every
    ``NonSpiking*`` node (2.x only), ``LIAFNode``, the ternary nodes and those of :data:`OTHER_OUTPUTS`;
    those this version defines."""
    return tuple(cls for cls in spiking_neuron_classes() if output_kind(cls) != "spikes")


__all__ = ["SJ_VERSION", "SJ2", "HAS_SET_BACKEND", "TLastSeqToANNContainer", "BatchNorm1d", "PSN", "op_counter",
           "MemoryModule", "MultiStepModule", "StepModule", "batch_norm", "step_mode_of", "dense_grad", "default_surrogate", "sj_layer",
           "t_last_seq_to_ann_forward", "invalidate_reset_cache", "add_to_namespace", "spiking_neuron_classes",
           "readout_neuron_classes", "output_kind", "OTHER_OUTPUTS", "base", "functional", "layer", "neuron", "surrogate"]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread (where
    ``torch.utils.checkpoint`` runs a forward again). torch has no public form of this; its checkpoint module
    reads the same private function."""
    return torch._C._current_graph_task_id() != -1
