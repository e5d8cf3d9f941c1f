"""Export the folded integer inference network to ONNX, whole-sequence or streaming.

The neurons run the integer arithmetic of :mod:`.deploy`: each neuron's float input is put on its
fixed-point grid (``round(x * 2**F)``, the only float operations of a neuron), and the charge is integer
multiplication by a signed power of two per tap, additions, the integer bias, and ``>= 0``. The
stateless layers (Linear, Conv1d/Conv2d with a following BatchNorm folded in, average and max pooling,
Flatten, Dropout) stay float. The network is followed as its forward runs: ``nn.Sequential`` layer by
layer, any other forward traced with torch.fx (additions of two values, as in residual connections,
and ``torch.flatten`` to the end are exported; other calls are refused with their source line).
Two forms:

* whole-sequence: ``x`` of the example's shape ``(T, N, ...)`` in, the network's ``(T, N, ...)`` out;
  a tap's delay is a Pad and a Slice along time;
* streaming: one step ``x`` ``(N, ...)`` in and out, and per neuron with taps in the past its last
  ``(k-1)*dilation`` fixed-point inputs as an explicit state: input ``"NAME.state"`` and output
  ``"NAME.state_out"`` (int64, ``(L, N, C, ...)``, oldest first; zeros at the start of a sequence).

Needs ``pip install "spikingjelly_mfpsn[onnx]"`` (onnx; onnxruntime to run the files).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn as nn

try:
    import onnx as _onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError:  # pragma: no cover (the message is tested with the package hidden)
    _onnx = None

from . import deploy
from ._export import STEP_CONTAINERS, bn_after, described, fold_bn, follow, is_dropout, per_step, prepared
from .neuron import MulFreeChannelwisePSN

__all__ = ["ONNXExportError", "export_onnx"]


class ONNXExportError(ValueError):
    """A layer of the network has no ONNX form here, or its neurons' integer format cannot be exported."""


def _require_onnx():
    if _onnx is None:
        raise ImportError("spikingjelly_mfpsn.onnx needs the onnx package: pip install \"spikingjelly_mfpsn[onnx]\" "
                          "(or pip install onnx onnxruntime)")
    return _onnx


class _Graph:
    """The nodes and constants of the ONNX graph under construction (value names are unique). A value of
    the network is a tensor of shape ``(B, ...)``: ``B = T * N`` (whole sequence) or ``N`` (streaming)."""

    reserved = {"x", "x.flat", "x.flat_shape", "y", "y.shape"}  # (names of its own; a layer named so is renamed)

    def __init__(self, t: int, n: int, streaming: bool):
        self.nodes, self.constants, self.inputs, self.outputs = [], [], [], []
        self.t, self.n, self.streaming = t, n, streaming

    def const(self, name: str, value) -> str:
        self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list, name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    # the visitor protocol of :func:`._export.walk`
    def input(self):
        return "x.flat"

    def chain(self, seq, x: str, feat: tuple):
        """Add the layers ``seq`` on value ``x`` of per-step shape ``feat``: ``(value, its per-step shape)``."""
        probe, i = torch.zeros(1, *feat, dtype=torch.float32), 0  # (the default dtype may be another)
        while i < len(seq):
            name, module = seq[i]
            if isinstance(module, deploy.FoldedMulFreePSN):
                x = (_neuron_step(self, name, module, x, (self.n,) + feat) if self.streaming
                     else _neuron_sequence(self, name, module, x, (self.t, self.n) + feat))
            else:
                with torch.no_grad():
                    probe = per_step(module, probe)
                    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and \
                            bn_after(seq, i, feat, ONNXExportError) is not None:
                        probe = per_step(seq[i + 1][1], probe)
                feat = tuple(probe.shape[1:])
                x, i = _stateless(self, name, module, seq, i, x, feat)
            i += 1
        return x, feat

    def sum(self, name, a, b, feat):
        return self.op("Add", [a, b], name)

    def flatten(self, name, x, start, feat):
        shape = (-1,) + tuple(feat[:start - 2]) + (int(np.prod(feat[start - 2:])),)
        return self.op("Reshape", [x, self.const(f"{name}.shape", np.array(shape, dtype=np.int64))], name)


# ---------------------------------------------------------------------------------- stateless layers
def _weighted(g: _Graph, name, module, bn, x):
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if bn is not None:
        weight, bias = fold_bn(weight, bias, bn)
    b = [] if bias is None else [g.const(f"{name}.bias", bias.float().numpy())]
    if isinstance(module, nn.Linear):
        y = g.op("MatMul", [x, g.const(f"{name}.weight_t", weight.float().t().numpy())], f"{name}.matmul")
        return g.op("Add", [y, b[0]], name) if b else y
    if module.padding_mode != "zeros" or module.padding == "same":
        raise ONNXExportError(f"layer {name!r}: only zero padding given as numbers (or 'valid') is exported "
                              f"(padding={module.padding!r}, padding_mode={module.padding_mode!r})")
    w = g.const(f"{name}.weight", weight.float().numpy())
    pads = [0] * (weight.dim() - 2) if module.padding == "valid" else list(module.padding)
    return g.op("Conv", [x, w] + b, name, strides=list(module.stride), dilations=list(module.dilation),
                pads=pads * 2, group=module.groups)


def _pool(g: _Graph, name, module, x):
    dims = 1 if isinstance(module, (nn.AvgPool1d, nn.MaxPool1d)) else 2
    tup = (lambda v: [v] * dims if isinstance(v, int) else list(v))
    kernel = tup(module.kernel_size)
    attrs = dict(kernel_shape=kernel, strides=tup(module.stride or module.kernel_size),
                 pads=tup(module.padding) * 2, ceil_mode=int(module.ceil_mode))
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d)):
        if any(d != 1 for d in tup(module.dilation)) or module.return_indices:
            raise ONNXExportError(f"layer {name!r}: max pooling with dilation or indices is not exported")
        return g.op("MaxPool", [x], name, **attrs)
    if getattr(module, "divisor_override", None) is not None:
        raise ONNXExportError(f"layer {name!r}: AvgPool2d's divisor_override is not exported")
    return g.op("AveragePool", [x], name, count_include_pad=int(module.count_include_pad), **attrs)


def _stateless(g: _Graph, name, module, seq, i, x, out_shape):
    """``(value, index of the last layer it covers)`` of a stateless layer on ``x`` (B, ...)."""
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        bn = bn_after(seq, i, out_shape, ONNXExportError)
        return _weighted(g, name, module, bn, x), i + (bn is not None)
    if isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.MaxPool1d, nn.MaxPool2d)):
        return _pool(g, name, module, x), i
    if isinstance(module, nn.Flatten):
        return g.op("Reshape", [x, g.const(f"{name}.shape", np.array((-1,) + out_shape, dtype=np.int64))], name), i
    if is_dropout(module):
        return x, i
    raise ONNXExportError(f"layer {name!r} ({type(module).__name__}) has no ONNX form here; export_onnx takes "
                          f"folded MF-PSN neurons, Linear, Conv1d/Conv2d (+ BatchNorm), average and max pooling, "
                          f"Flatten and Dropout")


# ---------------------------------------------------------------------------------- the integer neuron
def _taps(name, m: deploy.FoldedMulFreePSN, feat):
    """Per tap ``(lag, int64 multiplier (C, 1, ...))`` and the int64 bias: ``sign * 2**(shift + P - F)``."""
    extra, bias_int = _format(m)
    amount = m.shift.to(torch.int64) + extra
    if int(amount.min()) < 0:
        raise ONNXExportError(f"neuron {name!r}: its accumulator format (acc_frac_bits={m.acc_frac_bits}) needs right "
                              f"shifts, which are not exported; leave acc_frac_bits=None (the exact format)")
    view = (-1,) + (1,) * (len(feat) - 1)
    mult = (m.sign.to(torch.int64) * torch.bitwise_left_shift(torch.ones_like(amount), amount))
    taps = [((m.k - 1 - i) * m.dilation, mult[:, i].reshape(view).numpy()) for i in range(m.k)]
    return taps, bias_int.reshape(view).numpy()


def _format(m: deploy.FoldedMulFreePSN):
    """``(P - F, int64 bias)`` of the neuron's integer format (the exact accumulator when not set)."""
    acc = m.acc_frac_bits if m.acc_frac_bits is not None else deploy.exact_acc_frac_bits(m.shift, m.frac_bits)
    return acc - m.frac_bits, deploy.int_bias(m.bias, acc)


def _to_fixed(g: _Graph, name, x, frac_bits):
    """``round(x * 2**F)`` as int64 (round half to even, as :func:`.deploy.to_fixed`)."""
    d = g.op("Cast", [x], f"{name}.to_fixed.double", to=TensorProto.DOUBLE)
    d = g.op("Mul", [d, g.const(f"{name}.to_fixed.scale", np.array(2.0 ** frac_bits))], f"{name}.to_fixed.scaled")
    d = g.op("Round", [d], f"{name}.to_fixed.round")
    return g.op("Cast", [d], f"{name}.to_fixed.int", to=TensorProto.INT64)


def _fire(g: _Graph, name, terms, bias):
    acc = terms[0]
    for i, term in enumerate(terms[1:], 1):
        acc = g.op("Add", [acc, term], f"{name}.core.sum{i}")
    acc = g.op("Add", [acc, g.const(f"{name}.core.bias", bias)], f"{name}.core.charge")
    s = g.op("GreaterOrEqual", [acc, g.const(f"{name}.core.zero", np.array(0, dtype=np.int64))], f"{name}.core.fire")
    return g.op("Cast", [s], name, to=TensorProto.FLOAT)


def _neuron_sequence(g: _Graph, name, m, x, shape):
    """The whole-sequence neuron on ``x`` (T*N, C, ...) of time-first ``shape`` (T, N, C, ...)."""
    taps, bias = _taps(name, m, shape[2:])
    q = _to_fixed(g, name, x, m.frac_bits)
    q = g.op("Reshape", [q, g.const(f"{name}.seq_shape", np.array(shape, dtype=np.int64))], f"{name}.core.seq")
    terms = []
    for i, (lag, mult) in enumerate(taps):
        xi = q
        if lag:
            pads = np.zeros(2 * len(shape), dtype=np.int64)
            pads[0] = lag
            xi = g.op("Pad", [q, g.const(f"{name}.core.pads{i}", pads)], f"{name}.core.padded{i}")
            xi = g.op("Slice", [xi, g.const(f"{name}.core.start{i}", np.array([0])),
                                g.const(f"{name}.core.end{i}", np.array([shape[0]])),
                                g.const(f"{name}.core.axis{i}", np.array([0]))], f"{name}.core.delayed{i}")
        terms.append(g.op("Mul", [xi, g.const(f"{name}.core.w{i}", mult)], f"{name}.core.tap{i}"))
    s = _fire(g, f"{name}.spikes", terms, bias)
    return g.op("Reshape", [s, g.const(f"{name}.flat_shape", np.array((-1,) + tuple(shape[2:]), dtype=np.int64))],
                name)


def _neuron_step(g: _Graph, name, m, x, shape):
    """The streaming neuron on one step ``x`` (N, C, ...); its state is a graph input and output."""
    taps, bias = _taps(name, m, shape[1:])
    q = _to_fixed(g, name, x, m.frac_bits)
    depth = (m.k - 1) * m.dilation
    if depth:
        state = f"{name}.state"
        g.inputs.append(helper.make_tensor_value_info(state, TensorProto.INT64, [depth] + list(shape)))
        now = g.op("Unsqueeze", [q, g.const(f"{name}.core.axis", np.array([0]))], f"{name}.core.now")
        window = g.op("Concat", [state, now], f"{name}.core.window", axis=0)
        g.op("Slice", [window, g.const(f"{name}.core.keep_start", np.array([1])),
                       g.const(f"{name}.core.keep_end", np.array([depth + 1])),
                       g.const(f"{name}.core.keep_axis", np.array([0]))], f"{name}.state_out")
        g.outputs.append(helper.make_tensor_value_info(f"{name}.state_out", TensorProto.INT64,
                                                       [depth] + list(shape)))
    terms = []
    for i, (lag, mult) in enumerate(taps):
        xi = q if not lag else g.op("Gather", [window, g.const(f"{name}.core.index{i}", np.array(depth - lag))],
                                    f"{name}.core.delayed{i}", axis=0)
        terms.append(g.op("Mul", [xi, g.const(f"{name}.core.w{i}", mult)], f"{name}.core.tap{i}"))
    return _fire(g, name, terms, bias)


# ---------------------------------------------------------------------------------- the model
def _integer_copy(net: nn.Module, example_input: torch.Tensor) -> nn.Module:
    """A time-first, eval, folded copy of ``net`` in integer arithmetic (its neurons' formats, else
    calibrated on ``example_input`` as :func:`.deploy.set_integer` does)."""
    _check_net(net)
    net = prepared(net, example_input)
    neurons = deploy.folded_neurons(net)
    if any(m.frac_bits is None for _, m in neurons):
        kept = [(m, m.frac_bits, m.acc_frac_bits) for _, m in neurons if m.frac_bits is not None]
        with torch.no_grad():
            deploy.set_integer(net, calibrate=example_input)  # (calibrates every neuron: the set ones get theirs back)
        for m, frac_bits, acc_frac_bits in kept:
            m.frac_bits, m.acc_frac_bits = frac_bits, acc_frac_bits
    return net


def _check_net(net: nn.Module) -> None:
    """ONNXExportError where ``net`` is not float32, has no MF-PSN, or has single-step modules."""
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in net.parameters()):
        raise ONNXExportError("export_onnx writes float32 layers, and net has parameters of another dtype: "
                              "export a float32 copy (copy.deepcopy(net).float())")
    neuron_types = (MulFreeChannelwisePSN, deploy.FoldedMulFreePSN)
    if not any(isinstance(m, neuron_types) for m in net.modules()):
        raise ONNXExportError("export_onnx writes networks of MF-PSN neurons (MulFreeChannelwisePSN), and net has none")
    inside = {id(c) for m in net.modules() if isinstance(m, STEP_CONTAINERS) for c in m.modules() if c is not m}
    single = [n or type(net).__name__ for n, m in net.named_modules() if getattr(m, "step_mode", "m") == "s"
              and (id(m) not in inside or isinstance(m, neuron_types))]
    if single:
        raise ONNXExportError(f"export_onnx runs the network on whole (T, N, ...) sequences, and {', '.join(single)} "
                              f"{'is' if len(single) == 1 else 'are'} in step_mode='s': functional.set_step_mode(net, "
                              f"'m') first (a neuron inside a MultiStepContainer too)")


def _check_args(onnx, example_input, opset, streaming):
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 3 \
            or example_input.dtype != torch.float32:
        raise ValueError("example_input must be a float32 time-first tensor (T, N, ...) with at least 3 dims, got "
                         + described(example_input))
    if not example_input.numel():
        raise ValueError(f"example_input must have no empty dim (it fixes the model's shapes), got shape "
                         f"{tuple(example_input.shape)}")
    newest = onnx.defs.onnx_opset_version()
    if opset is not None and (not isinstance(opset, int) or isinstance(opset, bool) or not 13 <= opset <= newest):
        raise ValueError(f"opset must be an int in [13, {newest}] (the installed onnx's newest), got {opset!r}")
    if not isinstance(streaming, bool):
        raise ValueError(f"streaming must be True or False, got {streaming!r}")


def export_onnx(net: nn.Module, example_input: torch.Tensor, path: Optional[str] = None, streaming: bool = False,
                opset: Optional[int] = None):
    """The ONNX model of ``net``'s folded integer inference network (see the module's docstring).

    Args:
        net: a network of MF-PSN neurons (folded or not; a copy is folded) and stateless layers, in either
            layout: an ``nn.Sequential``, or a forward that also adds values and flattens. Its folded neurons' integer formats (:func:`.deploy.set_integer`) are kept;
            where none is set, each is calibrated on ``example_input``.
        example_input: float32, time-first ``(T, N, ...)``: it fixes the model's shapes (T and N too).
        path: where to save the model (``.onnx``), if given.
        streaming: one step per run, with each neuron's past inputs as state inputs and outputs.
        opset: ONNX opset (default: the installed onnx's newest).

    Returns:
        The ``onnx.ModelProto`` (checked with ``onnx.checker``).

    Raises:
        ONNXExportError: a layer with no ONNX form here (named), or an accumulator format that needs
            right shifts.
    """
    onnx = _require_onnx()
    _check_args(onnx, example_input, opset, streaming)
    net = _integer_copy(net, example_input)
    t, n, feat = example_input.shape[0], example_input.shape[1], tuple(example_input.shape[2:])
    g = _Graph(t, n, streaming)
    g.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, *feat] if streaming
                                                  else list(example_input.shape)))
    g.op("Reshape", ["x", g.const("x.flat_shape", np.array((-1,) + feat, dtype=np.int64))], "x.flat")
    x, feat = follow(net, example_input, g, ONNXExportError)
    out_shape = [n, *feat] if streaming else [t, n, *feat]
    g.op("Reshape", [x, g.const("y.shape", np.array(out_shape, dtype=np.int64))], "y")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)] + g.outputs
    model = helper.make_model(helper.make_graph(g.nodes, "mfpsn_integer", g.inputs, outputs, g.constants),
                              opset_imports=[helper.make_opsetid("", opset or onnx.defs.onnx_opset_version())],
                              producer_name="spikingjelly_mfpsn")
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, path)
    return model
