"""The paper's networks (Appendix E, Table "Network structure") as builder functions.

Every builder returns a SpikingJelly multi-step network in the time-first layout: it takes a whole
sequence ``(T, N, ...)`` and returns per-step class scores ``(T, N, num_classes)``; average them over
time (``out.mean(0)``) for the prediction, as the examples do. Call
``spikingjelly.activation_based.functional.reset_net(net)`` after every batch.

=====================  ===========================================================  ========================
builder                structure (paper notation)                                   input
=====================  ===========================================================  ========================
sequential_image_net   {{c128k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC{classes}           ``(T=W, N, C, H)``
pixel_image_net        FC128-BN-SN-{RB128}*2-APk4s4-FC256-BN-SN-{RB256}*2-FC10      ``(T=H*W, N, C)``
shd_net                {Dcls256-BN-SN-DP}*2-Dcls20-LIF(Vth=1e9)                     ``(T, N, 700)``
dvs_lip_resnet18       3D_c64k577s122p233-APk3s2p1-{RB64}*2-..-{RB512}*2-AAPk1-     ``(T, N, 2, H, W)``
                       DP-Stateful FC100
=====================  ===========================================================  ========================

``SN`` is the spiking neuron chosen by ``neuron``: ``'mfpsn'`` (this package's
:class:`~spikingjelly_mfpsn.MulFreeChannelwisePSN`), ``'lif'``, ``'plif'``, ``'psn'``,
``'sliding_psn'`` (the last two exist only in SpikingJelly >= 2.0), or any SpikingJelly neuron class.
MF-PSN layers get the sawtooth dilations 1, 2, 3, 1, 2, 3, ... (paper Eq. d) in the order they run
(``sawtooth=False``: dilation 1 everywhere).

``RB`` (not spelled out in the paper) is the Spiking ResNet basic block: ``SN(BN(W2 SN(BN(W1 x))) +
shortcut(x))``, where ``W`` is a fully connected layer in the pixel network and a 3x3 convolution in
the ResNet-18, and the shortcut is the identity, or ``W 1x1 + BN`` when the shape changes.

A few layers mix time steps and so know where the time axis is: :class:`TemporalAvgPool`,
:class:`TemporalConv3d`, :class:`DelayedLinear` and :class:`MembraneReadout`. Each has a ``layout``
attribute (``'time_first'`` or ``'time_last'``), like the MF-PSN neuron, which a layout conversion sets.
"""
from __future__ import annotations

import copy
import importlib.util
import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _compat
from .._compat import layer
from ..functional import sawtooth_dilation
from ..neuron import MulFreeChannelwisePSN

NEURONS = ("mfpsn", "lif", "plif", "psn", "sliding_psn")
_PSN_CLASSES = {"psn": "PSN", "sliding_psn": "SlidingPSN"}


def psn_available(name: str) -> bool:
    """Whether the installed SpikingJelly has the PSN-family neuron ``name`` ('psn' or 'sliding_psn')."""
    return hasattr(_compat.neuron, _PSN_CLASSES[name])


class NeuronFactory:
    """Makes the spiking-neuron layers of one network, in the order they run.

    Args:
        neuron: one of :data:`NEURONS`, or a SpikingJelly neuron class (built with
            ``step_mode='m'``, ``surrogate_function`` and ``neuron_kwargs``)
        k: order of MF-PSN and Sliding PSN
        sawtooth: MF-PSN dilations 1, 2, 3, ... in running order; ``False``: all 1, or all ``dilation``
        surrogate_function: a SpikingJelly surrogate, copied into every neuron (``ATan()`` by default)
        neuron_kwargs: passed to every neuron (e.g. ``threshold='param'`` for MF-PSN); ``dilation=d``
            (with ``sawtooth=False``) gives every MF-PSN dilation ``d``
    """

    def __init__(self, neuron: Union[str, type] = "mfpsn", k: int = 2, sawtooth: bool = True,
                 surrogate_function=None, **neuron_kwargs):
        if isinstance(neuron, str):
            if neuron not in NEURONS:
                raise ValueError(f"neuron must be one of {NEURONS} or a SpikingJelly neuron class, got {neuron!r}")
            if neuron in _PSN_CLASSES and not psn_available(neuron):
                raise ValueError(f"neuron={neuron!r} needs SpikingJelly >= 2.0 (neuron.{_PSN_CLASSES[neuron]}); "
                                 f"the installed SpikingJelly {_compat.SJ_VERSION} has no PSN family. "
                                 f"Use 'mfpsn', 'lif' or 'plif'")
        elif not (isinstance(neuron, type) and issubclass(neuron, nn.Module)):
            raise TypeError(f"neuron must be a name in {NEURONS} or an nn.Module class, got {neuron!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k (the order) must be an int >= 1, got {k!r}")
        self.neuron = neuron
        self.k = k
        self.sawtooth = bool(sawtooth)
        self.surrogate_function = (surrogate_function if surrogate_function is not None
                                   else _compat.default_surrogate())
        if "step_mode" in neuron_kwargs:
            raise ValueError("step_mode: the networks are built multi-step ('m'); switch the whole network "
                             "afterwards with functional.set_step_mode(net, 's')")
        if "dilation" in neuron_kwargs and self.sawtooth:
            d = neuron_kwargs["dilation"]
            raise ValueError(f"dilation={d!r} and sawtooth=True: the sawtooth sets every MF-PSN's dilation "
                             f"(1, 2, 3, ...); pass sawtooth=False for dilation {d!r} in every MF-PSN")
        self.neuron_kwargs = neuron_kwargs
        self.mfpsn_count = 0  # MF-PSN layers made so far: the next one's sawtooth position

    def __call__(self, channels: int, T: Optional[int] = None) -> nn.Module:
        """A multi-step neuron for ``channels`` features; ``T`` is needed only by ``'psn'``."""
        sg = copy.deepcopy(self.surrogate_function)
        kw = dict(self.neuron_kwargs)
        mfpsn = MulFreeChannelwisePSN if self.neuron == "mfpsn" else self.neuron
        if isinstance(mfpsn, type) and issubclass(mfpsn, MulFreeChannelwisePSN):  # (the class too: k, the sawtooth)
            d = sawtooth_dilation(self.mfpsn_count) if self.sawtooth else kw.pop("dilation", 1)
            self.mfpsn_count += 1
            return mfpsn(channels, k=self.k, dilation=d, surrogate_function=sg, step_mode="m", **kw)
        if self.neuron == "lif":
            kw.setdefault("tau", 2.0)
            kw.setdefault("detach_reset", True)
            return _compat.neuron.LIFNode(surrogate_function=sg, step_mode="m", **kw)
        if self.neuron == "plif":
            kw.setdefault("init_tau", 2.0)
            kw.setdefault("detach_reset", True)
            return _compat.neuron.ParametricLIFNode(surrogate_function=sg, step_mode="m", **kw)
        if self.neuron == "psn":
            if T is None:
                raise ValueError("neuron='psn' needs the number of time steps T of this layer")
            return _compat.neuron.PSN(T=T, surrogate_function=sg, **kw)
        if self.neuron == "sliding_psn":
            kw.setdefault("exp_init", True)
            return _compat.neuron.SlidingPSN(k=self.k, surrogate_function=sg, step_mode="m", **kw)
        return self.neuron(surrogate_function=sg, step_mode="m", **kw)


def _factory(neuron, k, sawtooth, surrogate_function, neuron_kwargs) -> NeuronFactory:
    if isinstance(neuron, NeuronFactory):
        return neuron
    return NeuronFactory(neuron, k=k, sawtooth=sawtooth, surrogate_function=surrogate_function, **neuron_kwargs)


def _check_positive(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ---------------------------------------------------------------------------------------------------
# Layers that mix time steps (layout-aware)

class _TimeMixing(nn.Module, _compat.StepModule):
    """Base of layers that mix time steps; ``layout`` says where the time axis of their input is. They run
    whole sequences only: ``step_mode='s'`` (``functional.set_step_mode(net, 's')``) makes the next forward
    raise, rather than read the batch axis as time."""

    layout_aware = True  # to_time_last / to_time_first set ``layout`` instead of wrapping

    def __init__(self):
        super().__init__()
        self.layout = "time_first"
        self.step_mode = "m"

    def _time_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``(N, C, ..., T)``."""
        if self.step_mode != "m":
            raise ValueError(f"{type(self).__name__} mixes time steps and runs whole sequences only, but has "
                             f"step_mode={self.step_mode!r}: functional.set_step_mode(net, 'm')")
        return x.movedim(0, -1) if self.layout == "time_first" else x

    def _restore(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_time_last`."""
        return y.movedim(-1, 0) if self.layout == "time_first" else y

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"


class TemporalAvgPool(_TimeMixing):
    """Average pooling along time, kernel = stride = ``kernel_size`` (the pixel network's APk4s4).

    The last window may be shorter (ceil mode): no time step is dropped. ``T`` becomes ``ceil(T / k)``.
    """

    def __init__(self, kernel_size: int):
        super().__init__()
        _check_positive(kernel_size=kernel_size)
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._time_last(x)
        shape = y.shape
        y = F.avg_pool1d(y.reshape(-1, 1, shape[-1]), self.kernel_size, self.kernel_size, ceil_mode=True)
        return self._restore(y.reshape(*shape[:-1], y.shape[-1]))

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, " + super().extra_repr()


class TemporalConv3d(_TimeMixing):
    """A 3D convolution over (time, height, width) of a sequence of frames (the DVS-Lip front end).

    Time-first input ``(T, N, C, H, W)``; with ``stride[0] == 1`` and ``padding[0] == (kT - 1) / 2`` the
    number of steps is kept (the convolution looks ``padding[0]`` steps ahead: it is not causal).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, bias: bool = False):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride, padding, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self._time_last(x).movedim(-1, 2))  # (N, C, T, H, W)
        return self._restore(y.movedim(2, -1))


class DelayedLinear(_TimeMixing):
    """Fully connected layer with learnable synaptic delays, applied causally along time.

    It is ``Dcls1d`` from the ``dcls`` package (Hammouamri et al. 2023, the SHD network of the paper).

    Each synapse has one weight and one learnable delay in ``[0, max_delay - 1]`` steps (an even
    ``max_delay`` is rounded up to the next odd one: Dcls centres its kernel). Call
    :func:`clamp_delays` after every optimiser step to keep the delays in range.
    """

    def __init__(self, in_features: int, out_features: int, max_delay: int = 25, bias: bool = True):
        super().__init__()
        _check_positive(max_delay=max_delay)
        from DCLS.construct.modules import Dcls1d  # the dcls package
        if max_delay % 2 == 0:
            max_delay += 1  # Dcls centres its kernel: an odd size keeps the delays symmetric around it
        self.max_delay = max_delay
        self.dcls = Dcls1d(in_features, out_features, kernel_count=1, dilated_kernel_size=max_delay,
                           bias=bias, version="gauss")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._time_last(x)  # (N, F, T)
        lead = y.shape[:-2]
        y = F.pad(y.reshape(-1, *y.shape[-2:]), (self.max_delay - 1, 0))  # causal: only past inputs
        y = self.dcls(y)
        return self._restore(y.reshape(*lead, *y.shape[-2:]))

    def extra_repr(self) -> str:
        return f"max_delay={self.max_delay}, " + super().extra_repr()


class MembraneReadout(_TimeMixing):
    """LIF neuron with an infinite threshold whose membrane potential is the output.

    This is the paper's LIF(Vth=1e9), the "stateful synapse" readout:
    ``V[t] = V[t-1] + (X[t] - V[t-1]) / tau``, ``V[-1] = 0``.

    Not a SpikingJelly neuron on purpose: it never spikes, and neuron-replacing utilities must not
    turn it into one.
    """

    def __init__(self, tau: float = 2.0):
        super().__init__()
        if not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau >= 1.0):
            raise ValueError(f"tau must be a number >= 1, got {tau!r}")
        self.tau = float(tau)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._time_last(x)
        v = torch.zeros_like(x[..., 0])
        out = []
        for t in range(x.shape[-1]):
            v = v + (x[..., t] - v) / self.tau
            out.append(v)
        return self._restore(torch.stack(out, -1))

    def extra_repr(self) -> str:
        return f"tau={self.tau}, " + super().extra_repr()


def dcls_available() -> bool:
    """Whether the ``dcls`` package (learnable delays) is installed."""
    return importlib.util.find_spec("DCLS") is not None


def clamp_delays(net: nn.Module) -> None:
    """Keep every :class:`DelayedLinear` delay inside its range (call after each optimiser step)."""
    for m in net.modules():
        if isinstance(m, DelayedLinear):
            m.dcls.clamp_parameters()


# ---------------------------------------------------------------------------------------------------
# Residual block

class ResidualBlock(nn.Module):
    """Spiking ResNet basic block: ``sn(body(x) + shortcut(x))``; ``shortcut=None`` is the identity."""

    def __init__(self, body: nn.Module, sn: nn.Module, shortcut: Optional[nn.Module] = None):
        super().__init__()
        self.body = body
        self.shortcut = shortcut if shortcut is not None else nn.Identity()
        self.sn = sn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sn(self.body(x) + self.shortcut(x))


def _fc_bn(in_features: int, out_features: int) -> list[nn.Module]:
    return [layer.Linear(in_features, out_features, bias=False, step_mode="m"),
            _compat.BatchNorm1d(out_features, step_mode="m")]


def fc_residual_block(in_features: int, out_features: int, sn: NeuronFactory, T: Optional[int] = None) -> ResidualBlock:
    """RB for sequences of vectors ``(T, N, F)``: FC-BN-SN-FC-BN (+ shortcut) -SN."""
    body = nn.Sequential(*_fc_bn(in_features, out_features), sn(out_features, T), *_fc_bn(out_features, out_features))
    shortcut = nn.Sequential(*_fc_bn(in_features, out_features)) if in_features != out_features else None
    return ResidualBlock(body, sn(out_features, T), shortcut)


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> list[nn.Module]:
    return [layer.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False, step_mode="m"),
            layer.BatchNorm2d(out_channels, step_mode="m")]


def conv_residual_block(in_channels: int, out_channels: int, stride: int, sn: NeuronFactory,
                        T: Optional[int] = None) -> ResidualBlock:
    """RB for sequences of images ``(T, N, C, H, W)``: c3-BN-SN-c3-BN (+ shortcut) -SN."""
    body = nn.Sequential(*_conv_bn(in_channels, out_channels, 3, stride), sn(out_channels, T),
                         *_conv_bn(out_channels, out_channels, 3))
    shortcut = (nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride))
                if stride != 1 or in_channels != out_channels else None)
    return ResidualBlock(body, sn(out_channels, T), shortcut)


# ---------------------------------------------------------------------------------------------------
# The networks

def sequential_image_net(in_channels: int = 3, height: int = 32, num_classes: int = 10, T: Optional[int] = None,
                         neuron="mfpsn", k: int = 2, sawtooth: bool = True, channels: int = 128,
                         convs_per_stage: int = 3, stages: int = 2, hidden: int = 256,
                         surrogate_function=None, **neuron_kwargs) -> nn.Sequential:
    """Sequential CIFAR: ``{{c128k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC{classes}``.

    Images are fed column by column: input ``(T=W, N, C, H)`` (``images.permute(3, 0, 1, 2)``), the
    convolutions and pools are 1D along the column's height. Output ``(T, N, num_classes)``.

    Args:
        height: image height (must be divisible by ``2 ** stages``)
        T: number of columns (image width); needed only for ``neuron='psn'``
        channels, convs_per_stage, stages, hidden: width and depth (paper: 128, 3, 2, 256)
    """
    _check_positive(in_channels=in_channels, height=height, num_classes=num_classes, channels=channels,
                    convs_per_stage=convs_per_stage, stages=stages, hidden=hidden)
    if height % (2 ** stages):
        raise ValueError(f"height={height} must be divisible by 2**stages={2 ** stages} (one 2x pool per stage)")
    sn = _factory(neuron, k, sawtooth, surrogate_function, neuron_kwargs)
    layers, c_in = [], in_channels
    for _ in range(stages):
        for _ in range(convs_per_stage):
            layers += [layer.Conv1d(c_in, channels, 3, padding=1, bias=False, step_mode="m"),
                       _compat.BatchNorm1d(channels, step_mode="m"), sn(channels, T)]
            c_in = channels
        layers.append(layer.AvgPool1d(2, 2, step_mode="m"))
    layers += [layer.Flatten(step_mode="m"),
               layer.Linear(channels * (height >> stages), hidden, step_mode="m"), sn(hidden, T),
               layer.Linear(hidden, num_classes, step_mode="m")]
    return nn.Sequential(*layers)


def pixel_image_net(in_channels: int = 3, num_classes: int = 10, T: Optional[int] = None, neuron="mfpsn",
                    k: int = 2, sawtooth: bool = True, widths: Sequence[int] = (128, 256), blocks: int = 2,
                    time_pool: int = 4, surrogate_function=None, **neuron_kwargs) -> nn.Sequential:
    """Pixel CIFAR: ``FC128-BN-SN-{RB128}*2-APk4s4-FC256-BN-SN-{RB256}*2-FC10``.

    Images are fed pixel by pixel: input ``(T=H*W, N, C)`` (``images.flatten(2).permute(2, 0, 1)``).
    ``APk4s4`` is read as average pooling along time (the only spatial axis of a pixel sequence), so
    the second stage runs ``ceil(T / time_pool)`` steps; output ``(ceil(T / time_pool), N, num_classes)``.

    Args:
        T: sequence length; needed only for ``neuron='psn'``
        widths: features of each stage (paper: 128, 256), a pool between consecutive stages
        blocks: residual blocks per stage (paper: 2)
        time_pool: pooling kernel and stride along time (paper: 4; 1 disables pooling)
    """
    _check_positive(in_channels=in_channels, num_classes=num_classes, blocks=blocks, time_pool=time_pool)
    if not widths:
        raise ValueError("widths must list at least one stage width")
    _check_positive(**{f"widths[{i}]": w for i, w in enumerate(widths)})
    sn = _factory(neuron, k, sawtooth, surrogate_function, neuron_kwargs)
    layers, f_in = [], in_channels
    for stage, width in enumerate(widths):
        if stage > 0 and time_pool > 1:
            layers.append(TemporalAvgPool(time_pool))
            T = None if T is None else math.ceil(T / time_pool)
        layers += [*_fc_bn(f_in, width), sn(width, T)]
        layers += [fc_residual_block(width, width, sn, T) for _ in range(blocks)]
        f_in = width
    layers.append(layer.Linear(f_in, num_classes, step_mode="m"))
    return nn.Sequential(*layers)


def shd_net(in_features: int = 700, num_classes: int = 20, T: Optional[int] = None, neuron="mfpsn", k: int = 2,
            sawtooth: bool = True, hidden: int = 256, layers: int = 2, dropout: float = 0.4,
            delays: Optional[bool] = None, max_delay: int = 25, readout_tau: float = 2.0,
            surrogate_function=None, **neuron_kwargs) -> nn.Sequential:
    """SHD network: ``{Dcls256-BN-SN-DP}*2-Dcls20-LIF(Vth=1e9)``.

    Input ``(T, N, in_features)`` binned spikes, output ``(T, N, num_classes)`` membrane potentials of the
    readout.

    Args:
        delays: ``True``: learnable-delay :class:`DelayedLinear` layers (needs the ``dcls``
            package); ``False``: plain fully connected layers; ``None``: delays when ``dcls`` is installed
        max_delay: largest synaptic delay, in time steps
        T: number of time steps; needed only for ``neuron='psn'``
    """
    _check_positive(in_features=in_features, num_classes=num_classes, hidden=hidden, layers=layers)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if delays is None:
        delays = dcls_available()
    elif delays and not dcls_available():
        raise ImportError("shd_net(delays=True) needs the dcls package (pip install dcls); "
                          "pass delays=False for plain fully connected layers")
    sn = _factory(neuron, k, sawtooth, surrogate_function, neuron_kwargs)

    def fc(i, o, bias):
        return DelayedLinear(i, o, max_delay, bias=bias) if delays else layer.Linear(i, o, bias=bias, step_mode="m")

    seq, f_in = [], in_features
    for _ in range(layers):
        seq += [fc(f_in, hidden, False), _compat.BatchNorm1d(hidden, step_mode="m"), sn(hidden, T),
                layer.Dropout(dropout, step_mode="m")]
        f_in = hidden
    seq += [fc(f_in, num_classes, True), MembraneReadout(readout_tau)]
    return nn.Sequential(*seq)


def dvs_lip_resnet18(in_channels: int = 2, num_classes: int = 100, T: Optional[int] = None, neuron="mfpsn",
                     k: int = 2, sawtooth: bool = True, widths: Sequence[int] = (64, 128, 256, 512),
                     blocks: Sequence[int] = (2, 2, 2, 2), dropout: float = 0.5, readout_tau: float = 2.0,
                     surrogate_function=None, **neuron_kwargs) -> nn.Sequential:
    """DVS-Lip Modified Spiking ResNet-18.

    Architecture: ``3D_c64k577s122p233-APk3s2p1-{RB64}*2-{RB128}*2-{RB256}*2-{RB512}*2-AAPk1-DP-Stateful FC100``.

    Input ``(T, N, 2, H, W)`` event frames (paper: T = 90, 88x88 crops); output ``(T, N, num_classes)``.
    The front end is a 3D convolution over (time, H, W) with stride (1, 2, 2), followed by BN and a
    spiking neuron; the pooling layer has no spiking neuron ("modified"). Stages after the first
    halve H and W. The readout is a fully connected layer with a stateful (leaky-integrating)
    synapse, :class:`MembraneReadout`.

    Args:
        widths, blocks: channels and residual blocks per stage (ResNet-18: 64..512, 2 each)
        T: number of time steps; needed only for ``neuron='psn'``
    """
    _check_positive(in_channels=in_channels, num_classes=num_classes)
    if len(widths) != len(blocks) or not widths:
        raise ValueError(f"widths and blocks must have the same, non-zero length; got {widths} and {blocks}")
    _check_positive(**{f"widths[{i}]": w for i, w in enumerate(widths)},
                    **{f"blocks[{i}]": b for i, b in enumerate(blocks)})
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    sn = _factory(neuron, k, sawtooth, surrogate_function, neuron_kwargs)
    seq = [TemporalConv3d(in_channels, widths[0], (5, 7, 7), (1, 2, 2), (2, 3, 3)),
           layer.BatchNorm2d(widths[0], step_mode="m"), sn(widths[0], T),
           layer.AvgPool2d(3, 2, 1, step_mode="m")]
    c_in = widths[0]
    for stage, (width, n) in enumerate(zip(widths, blocks)):
        for b in range(n):
            seq.append(conv_residual_block(c_in, width, 2 if stage > 0 and b == 0 else 1, sn, T))
            c_in = width
    seq += [layer.AdaptiveAvgPool2d(1, step_mode="m"), layer.Flatten(step_mode="m"),
            layer.Dropout(dropout, step_mode="m"), layer.Linear(c_in, num_classes, step_mode="m"),
            MembraneReadout(readout_tau)]
    return nn.Sequential(*seq)


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "sequential_cifar": sequential_image_net,
    "pixel_cifar": pixel_image_net,
    "shd": shd_net,
    "dvs_lip": dvs_lip_resnet18,
}


def build(name: str, **kwargs) -> nn.Module:
    """Build one of :data:`BUILDERS` by name.

    The names are ``'sequential_cifar'``, ``'pixel_cifar'``, ``'shd'`` and ``'dvs_lip'``.
    """
    if name not in BUILDERS:
        raise ValueError(f"name must be one of {sorted(BUILDERS)}, got {name!r}")
    return BUILDERS[name](**kwargs)


def spiking_layers(net: nn.Module) -> list[nn.Module]:
    """The spiking-neuron layers of ``net`` (SpikingJelly neurons and MF-PSN), in module order."""
    types = tuple(t for t in (getattr(_compat.neuron, "BaseNode", None), getattr(_compat.neuron, "PSN", None),
                              getattr(_compat.neuron, "SlidingPSN", None), MulFreeChannelwisePSN) if t is not None)
    return [m for m in net.modules() if isinstance(m, types)]


__all__ = ["NEURONS", "BUILDERS", "NeuronFactory", "ResidualBlock", "TemporalAvgPool", "TemporalConv3d",
           "DelayedLinear", "MembraneReadout", "build", "clamp_delays", "conv_residual_block", "dcls_available",
           "dvs_lip_resnet18", "fc_residual_block", "pixel_image_net", "psn_available", "sawtooth_dilation",
           "sequential_image_net", "shd_net", "spiking_layers"]
