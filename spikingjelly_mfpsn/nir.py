"""Export MF-PSN networks to NIR, the Neuromorphic Intermediate Representation, and import them back.

NIR 1.0 has no PSN-family neuron, but it has the pieces of a folded MF-PSN: per tap ``i`` a
:class:`nir.Delay` of ``(k-1-i) * dilation`` steps and a :class:`nir.Scale` by the tap's power of two
(per channel), whose outputs add up at a :class:`nir.Threshold`. NIR's threshold fires on ``v >
threshold`` and MF-PSN on ``H = sum_i Wq_i X_i + b >= 0``, so the exported threshold is the largest
value of the exported dtype below ``-b``: for a charge of that dtype, ``v > threshold`` is exactly
``v >= -b``. The batch norm of a BN-threshold neuron is folded first (:func:`.deploy.fold`), so the
weights are powers of two (a neuron with ``quantize=False`` is refused, not approximated).

Stateless layers: Linear (:class:`nir.Affine`, or :class:`nir.Linear` without bias), Conv1d and Conv2d
(with a BatchNorm after them folded into their weight and bias), AvgPool1d of a power-of-two size (a
:class:`nir.Conv1d` with weights ``1/size``, exact), AvgPool2d, Flatten, and Dropout (nothing, in
eval). A network is exported as its forward runs: ``nn.Sequential`` containers (nested ones and
SpikingJelly's ``SeqToANNContainer`` included) layer by layer, any other forward traced with torch.fx,
where an addition of two values (a residual connection) becomes edges into the same node and
``torch.flatten`` a Flatten node; time-first or time-last (converted back first). Any other layer or
call raises :class:`NIRExportError` naming it. Needs ``pip install "spikingjelly_mfpsn[nir]"``.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import nir as _nir
except ImportError:  # pragma: no cover (the message is tested by simulating a missing package)
    _nir = None

from . import deploy
from ._export import bn_after, check_dt, described, fold_bn, follow, is_dropout, per_step, prepared

__all__ = ["NIRExportError", "NIRImportError", "NIRNetwork", "export_to_nir", "import_from_nir"]


class NIRExportError(ValueError):
    """A layer of the network has no exact NIR 1.0 equivalent."""


class NIRImportError(ValueError):
    """A NIR graph holds a node this package cannot run."""


def _require_nir():
    if _nir is None:
        raise ImportError("spikingjelly_mfpsn.nir needs the nir package: pip install \"spikingjelly_mfpsn[nir]\" "
                          "(or pip install nir)")
    return _nir


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


# ---------------------------------------------------------------------------------- export
def _weighted(name, module, bn, feat):
    """The NIR node of a Linear/Conv1d/Conv2d (``bn``, if any, folded in)."""
    nir = _nir
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if bn is not None:
        weight, bias = fold_bn(weight, bias, bn)
    if isinstance(module, nn.Linear):
        return nir.Linear(_np(weight)) if bias is None else nir.Affine(_np(weight), _np(bias))
    if module.padding_mode != "zeros" or isinstance(module.padding, str) and module.padding != "valid":
        raise NIRExportError(f"layer {name!r}: NIR convolutions take zero padding given as numbers, got "
                             f"padding={module.padding!r}, padding_mode={module.padding_mode!r}")
    bias = np.zeros(weight.shape[0], dtype=_np(weight).dtype) if bias is None else _np(bias)
    weight = _np(_ungrouped(weight, module.groups))
    if isinstance(module, nn.Conv1d):
        padding = 0 if module.padding == "valid" else module.padding[0]
        return nir.Conv1d(feat[-1], weight, module.stride[0], padding, module.dilation[0], 1, bias)
    node = nir.Conv2d(tuple(feat[-2:]), weight, module.stride, module.padding, module.dilation, 1, bias)
    _check_conv2d_output(name, node, module)
    return node


def _check_conv2d_output(name, node, module) -> None:
    """NIRExportError where the NIR package infers another output size than the layer's: NIR 1.0.8 reads
    a Conv2d's kernel size from its height alone, so a graph with a non-square kernel fails its type
    check (and ``nir.read`` would refuse the file)."""
    from nir.ir.conv import calculate_conv_output
    hw = calculate_conv_output(node.input_shape, node.padding, node.dilation, node.weight.shape[2:], node.stride)
    if list(node.output_type["output"][1:]) != list(hw):
        raise NIRExportError(f"layer {name!r}: this NIR package ({getattr(_nir, '__version__', '?')}) gives a Conv2d "
                             f"the output size of a square kernel, and kernel_size={module.kernel_size} is not; a "
                             f"graph holding it fails NIR's type check")


def _ungrouped(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped convolution's weight as the dense one it equals (zeros across groups): NIR 1.0's type
    inference takes a convolution's input channels from its weight, which a grouped weight does not give.
    The extra terms are exact zeros, so the output is unchanged."""
    if groups == 1:
        return weight
    out_g, in_g = weight.shape[0] // groups, weight.shape[1]
    dense = weight.new_zeros(weight.shape[0], in_g * groups, *weight.shape[2:])
    for g in range(groups):
        dense[g * out_g:(g + 1) * out_g, g * in_g:(g + 1) * in_g] = weight[g * out_g:(g + 1) * out_g]
    return dense


def _avgpool1d(name, module, feat, dtype):
    """AvgPool1d as a Conv1d with weights 1/size on the diagonal: exact when the size is a power of two."""
    size, stride, pad = (v[0] if isinstance(v, tuple) else v for v in (module.kernel_size, module.stride,
                                                                      module.padding))
    if size & (size - 1) or module.ceil_mode or (pad and not module.count_include_pad):
        raise NIRExportError(f"layer {name!r}: AvgPool1d is exported as a Conv1d with weights 1/kernel_size, exact only "
                             f"for a power-of-two kernel_size without ceil_mode, and with count_include_pad where it "
                             f"pads (got {module})")
    c = feat[0]
    weight = _ungrouped(torch.full((c, 1, size), 1.0 / size, dtype=dtype), c)
    return _nir.Conv1d(feat[-1], _np(weight), stride, pad, 1, 1, np.zeros(c, dtype=_np(weight).dtype))


def _avgpool2d(name, module):
    if module.ceil_mode or module.divisor_override is not None or (np.any(module.padding)
                                                                    and not module.count_include_pad):
        raise NIRExportError(f"layer {name!r}: NIR's AvgPool2d has no ceil_mode, divisor_override or "
                             f"count_include_pad=False (got {module})")
    def pair(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    return _nir.AvgPool2d(np.array(pair(module.kernel_size)), np.array(pair(module.stride or module.kernel_size)),
                          np.array(pair(module.padding)))


def _stateless(name, module, seq, i, feat, dtype):
    """``(node or None, index of the last layer it covers)`` for a stateless layer; raises for the rest."""
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        bn = bn_after(seq, i, feat, NIRExportError)
        if isinstance(module, nn.Linear) and len(feat) != 1:
            raise NIRExportError(f"layer {name!r}: a Linear on steps of shape (N, {', '.join(map(str, feat))}): "
                                 f"NIR's Linear and Affine take one dim of features per sample")
        return _weighted(name, module, bn, feat), i + (bn is not None)
    if isinstance(module, nn.AvgPool1d):
        return _avgpool1d(name, module, feat, dtype), i
    if isinstance(module, nn.AvgPool2d):
        return _avgpool2d(name, module), i
    if isinstance(module, nn.Flatten):  # (N, ...) -> NIR's per-sample dims; negative ones count from the end
        start, end = (d - 1 if d > 0 else d for d in (module.start_dim, module.end_dim))
        return _nir.Flatten({"input": np.array(feat)}, start, end), i
    if is_dropout(module):
        return None, i
    raise NIRExportError(f"layer {name!r} ({type(module).__name__}) has no exact NIR 1.0 equivalent; export_to_nir "
                         f"takes MF-PSN neurons, Linear, Conv1d/Conv2d (+ BatchNorm), AvgPool1d/AvgPool2d, "
                         f"Flatten and Dropout")


def _threshold_below(value: np.ndarray) -> np.ndarray:
    """The largest value of ``value``'s dtype below each element: ``v > it`` is ``v >= value``."""
    return np.nextafter(value, np.array(-np.inf, dtype=value.dtype))


def _neuron_nodes(name, folded: deploy.FoldedMulFreePSN, feat, dt):
    """The nodes and edges of one folded neuron: per tap Delay -> Scale, summed into a Threshold."""
    wq, b = (_np(t) for t in folded.fused_weight_bias())
    per_channel = (-1,) + (1,) * (len(feat) - 1)
    nodes, edges, entries = {}, [], []
    for i in range(folded.k):
        lag = (folded.k - 1 - i) * folded.dilation
        scale = f"{name}.tap{i}"
        nodes[scale] = _nir.Scale(np.broadcast_to(wq[:, i].reshape(per_channel), feat).copy())
        if lag:
            nodes[f"{scale}.delay"] = _nir.Delay(np.full(feat, lag * dt))  # (float64: a float16 lag rounds)
            edges.append((f"{scale}.delay", scale))
            entries.append(f"{scale}.delay")
        else:
            entries.append(scale)
        edges.append((scale, name))
    nodes[name] = _nir.Threshold(np.broadcast_to(_threshold_below(-b).reshape(per_channel), feat).copy())
    return nodes, edges, entries


class _Builder:
    """The NIR nodes and edges of an export in progress. A value of the network is a list of node names
    whose outputs add up to it (NIR adds the edges that enter a node), so ``a + b`` needs no node."""

    reserved = {"input", "output"}  # (names of its own; a layer named so is renamed)

    def __init__(self, dt: float, dtype: torch.dtype):
        self.dt, self.dtype, self.nodes, self.edges = dt, dtype, {}, []

    def chain(self, seq, sources: list, feat: tuple) -> tuple[list, tuple]:
        """Add the layers ``seq`` (``(name, module)`` in order) fed by ``sources``: ``(their output's
        sources, its per-step shape)``."""
        probe, i = torch.zeros(1, *feat, dtype=self.dtype), 0
        while i < len(seq):
            name, module = seq[i]
            if isinstance(module, deploy.FoldedMulFreePSN):
                more, more_edges, entries = _neuron_nodes(name, module, feat, self.dt)
                self.nodes.update(more)
                self.edges += [(src, dst) for src in sources for dst in entries] + more_edges
                sources = [name]
            else:
                node, j = _stateless(name, module, seq, i, feat, self.dtype)
                with torch.no_grad():
                    for _, m in seq[i:j + 1]:
                        probe = per_step(m, probe)
                feat = tuple(probe.shape[1:])
                if node is not None:
                    self.add(name, node, sources)
                    sources = [name]
                i = j
            i += 1
        return sources, feat

    def add(self, name, node, sources):
        self.nodes[name] = node
        self.edges += [(src, name) for src in sources]

    def input(self):
        return ["input"]

    def sum(self, name, a, b, feat):
        """``a + b``: edges from both into each consumer (NIR adds them); a source in both (``x + x``) goes
        through a Scale by its count, as NIR has one edge per pair of nodes."""
        out = []
        for src, count in Counter(a + b).items():
            if count > 1:
                self.add(f"{name}.{count}x{src}", _nir.Scale(_np(torch.full(feat, count, dtype=self.dtype))), [src])
                src = f"{name}.{count}x{src}"
            out.append(src)
        return out

    def flatten(self, name, sources, start, feat):
        """``torch.flatten(x, start)`` of a time-first value whose per-step shape is ``feat``."""
        self.add(name, _nir.Flatten({"input": np.array(feat)}, start - 2, -1), sources)
        return [name]


def export_to_nir(net: nn.Module, example_input: torch.Tensor, dt: float = 1.0):
    """The NIR graph of a network of MF-PSN neurons and stateless layers (see the module's docstring).

    Args:
        net: a SpikingJelly network in either layout whose forward runs its modules, adds values
            (residual connections) and flattens; ``nn.Sequential`` containers are opened. MF-PSN neurons
            are folded (BN threshold included) on a copy, and ``net`` itself is left as it is; the graph
            holds the float network (integer formats set with ``deploy.set_integer`` are left out, with a
            warning).
        example_input: one input of the network, time-first ``(T, N, ...)``: it fixes each layer's shape.
        dt: the time step, in the units of the exported delays (a delay of ``n`` steps is ``n * dt``).

    Returns:
        A ``nir.NIRGraph`` with nodes named after the modules (a neuron's taps ``NAME.tap{i}``), an
        ``input`` and an ``output`` node; ``nir.write(path, graph)`` saves it.

    Raises:
        NIRExportError: a layer or call with no exact NIR 1.0 equivalent (named), or a forward that
            cannot be traced.
    """
    nir = _require_nir()
    dt = check_dt(dt)
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 3:
        raise ValueError("example_input must be a time-first tensor (T, N, ...) with at least 3 dims, got "
                         + described(example_input))
    if example_input.dtype not in (torch.float16, torch.float32, torch.float64):
        raise ValueError(f"example_input (and net) must be float16, float32 or float64, the dtypes a NIR graph's "
                         f"NumPy arrays have, got {example_input.dtype}: export a copy, e.g. net.float()")
    integer = [name for name, m in net.named_modules()
               if isinstance(m, deploy.FoldedMulFreePSN) and m.frac_bits is not None]
    if integer:
        warnings.warn(f"export_to_nir writes the float network: the integer formats deploy.set_integer gave "
                      f"{', '.join(integer)} are not part of a NIR graph (NIR has no fixed-point types); "
                      f"export_onnx keeps them", stacklevel=2)
    net = prepared(net, example_input)
    b = _Builder(float(dt), example_input.dtype)
    b.nodes["input"] = nir.Input({"input": np.array(example_input.shape[2:])})
    sources, feat = follow(net, example_input, b, NIRExportError)
    b.nodes["output"] = nir.Output({"output": np.array(feat)})
    b.edges += [(src, "output") for src in sources]
    return nir.NIRGraph(b.nodes, b.edges, metadata={"dt": float(dt), "source": "spikingjelly_mfpsn"})


# ---------------------------------------------------------------------------------- import
class _Node(nn.Module):
    """One NIR node on time-first ``(T, N, ...)`` tensors: ``op`` runs on one step (N, ...) at a time, or
    on the whole sequence where it needs time (``whole``)."""

    def __init__(self, op, whole: bool = False):
        super().__init__()
        self.op, self.whole = op, whole

    def forward(self, x):
        if self.whole:
            return self.op(x)
        y = self.op(x.flatten(0, 1))
        return y.reshape(x.shape[0], x.shape[1], *y.shape[1:])


class _Delay(nn.Module):
    """``y[t] = x[t - steps]`` per element (zeros before the start), ``steps`` a non-negative integer tensor."""

    def __init__(self, steps: torch.Tensor):
        super().__init__()
        self.register_buffer("steps", steps)

    def forward(self, x):
        y = torch.zeros_like(x)
        for lag in self.steps.unique().tolist():
            where = self.steps == lag
            if lag < x.shape[0]:
                shifted = torch.cat((x.new_zeros(lag, *x.shape[1:]), x[:x.shape[0] - lag])) if lag else x
                y = torch.where(where, shifted, y)
        return y


class _Buffer(nn.Module):
    """A tensor applied by ``fn(x, tensor)`` (Scale, Threshold)."""

    def __init__(self, value: torch.Tensor, fn):
        super().__init__()
        self.register_buffer("value", value)
        self.fn = fn

    def forward(self, x):
        return self.fn(x, self.value)


def _conv(node, dims):
    weight = torch.as_tensor(np.asarray(node.weight))
    conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(
        weight.shape[1] * node.groups, weight.shape[0], tuple(weight.shape[2:]), node.stride, node.padding,
        node.dilation, node.groups, bias=True, dtype=weight.dtype)  # (a float64 graph stays float64)
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(torch.as_tensor(np.asarray(node.bias)))
    return conv


def _linear(node):
    weight = torch.as_tensor(np.asarray(node.weight))
    bias = getattr(node, "bias", None)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(torch.as_tensor(np.asarray(bias)))
    return linear


def _sum_pool(node):
    k, s, p = (tuple(int(v) for v in np.atleast_1d(a)) * (2 // len(np.atleast_1d(a)))
               for a in (node.kernel_size, node.stride, node.padding))

    def pool(x):
        ones = x.new_ones(x.shape[1], 1, *k)
        return F.conv2d(x, ones, stride=s, padding=p, groups=x.shape[1])
    return pool


def _module_of(name, node, dt):
    """The torch module that runs NIR node ``node``; raises :class:`NIRImportError` for another type."""
    nir = _nir
    kind = type(node).__name__
    if isinstance(node, (nir.Input, nir.Output)):
        return nn.Identity()
    if isinstance(node, (nir.Affine, nir.Linear)):
        return _Node(_linear(node))
    if isinstance(node, nir.Conv1d):
        return _Node(_conv(node, 1))
    if isinstance(node, nir.Conv2d):
        return _Node(_conv(node, 2))
    if isinstance(node, nir.AvgPool2d):
        return _Node(nn.AvgPool2d(tuple(np.atleast_1d(node.kernel_size).tolist()),
                                  tuple(np.atleast_1d(node.stride).tolist()),
                                  tuple(np.atleast_1d(node.padding).tolist())))
    if isinstance(node, nir.SumPool2d):
        return _Node(_sum_pool(node))
    if isinstance(node, nir.Flatten):
        return _Node(nn.Flatten(*(d + 1 if d >= 0 else d for d in (node.start_dim, node.end_dim))))
    if isinstance(node, nir.Scale):
        return _Buffer(torch.as_tensor(np.asarray(node.scale)), torch.mul)
    if isinstance(node, nir.Threshold):
        return _Buffer(torch.as_tensor(np.asarray(node.threshold)), lambda x, thr: (x > thr).to(x.dtype))
    if isinstance(node, nir.Delay):
        delay = np.asarray(node.delay)
        steps = delay.astype(np.float64) / dt  # (a whole number of steps to within the delay's rounding)
        tol = 4 * (np.finfo(delay.dtype).eps if np.issubdtype(delay.dtype, np.floating) else 1e-15)
        if not (np.all(steps >= 0) and np.all(np.abs(steps - np.round(steps)) <= tol * np.maximum(1, steps))):
            raise NIRImportError(f"node {name!r}: a Delay must be a non-negative multiple of dt={dt}, got "
                                 f"{np.unique(np.asarray(node.delay))[:5]}")
        return _Delay(torch.as_tensor(np.round(steps).astype(np.int64)))
    raise NIRImportError(f"node {name!r} is a nir.{kind}, which import_from_nir cannot run (it runs Input, Output, "
                         f"Affine, Linear, Conv1d, Conv2d, AvgPool2d, SumPool2d, Flatten, Scale, Delay and "
                         f"Threshold: the nodes export_to_nir writes)")


def _order(graph) -> list[str]:
    """The nodes in an order where every edge goes forward; raises for a cycle or a dangling edge."""
    preds = {name: [] for name in graph.nodes}
    for src, dst in graph.edges:
        if src not in preds or dst not in preds:
            raise NIRImportError(f"edge ({src!r}, {dst!r}) names a node the graph does not have")
        preds[dst].append(src)
    order, done = [], set()
    while len(order) < len(preds):
        ready = [n for n in preds if n not in done and all(p in done for p in preds[n])]
        if not ready:
            raise NIRImportError("the graph has a cycle (a recurrent connection), which import_from_nir does not run")
        order += ready
        done.update(ready)
    return order


class NIRNetwork(nn.Module):
    """A NIR graph as a torch module.

    ``forward(x)`` takes a time-first sequence ``(T, N, ...)`` of the input node's shape and returns the
    output node's ``(T, N, ...)``; a node with several incoming edges adds them in the order the edges are
    listed. Stateless: each call is a fresh sequence.
    """

    def __init__(self, graph, dt: Optional[float] = None):
        super().__init__()
        dt = check_dt(graph.metadata.get("dt", 1.0) if dt is None else dt,
                      "dt" if dt is not None else "the graph's metadata['dt']")
        inputs = [n for n, node in graph.nodes.items() if isinstance(node, _nir.Input)]
        outputs = [n for n, node in graph.nodes.items() if isinstance(node, _nir.Output)]
        if len(inputs) != 1 or len(outputs) != 1:
            raise NIRImportError(f"import_from_nir runs graphs with one Input and one Output node, got inputs "
                                 f"{inputs} and outputs {outputs}")
        self.order = _order(graph)
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.preds = {n: [s for s, d in graph.edges if d == n] for n in self.order}
        self.nodes = nn.ModuleDict({str(i): _module_of(n, graph.nodes[n], dt) for i, n in enumerate(self.order)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtypes = {str(t.dtype) for t in list(self.parameters()) + list(self.buffers()) if t.is_floating_point()}
        if dtypes and dtypes != {str(getattr(x, "dtype", None))}:
            raise ValueError(f"the graph's arrays are {', '.join(sorted(dtypes))} and x is "
                             f"{getattr(x, 'dtype', type(x).__name__)}: give x their dtype, or make them one with "
                             f"this network's .float() or .double()")
        values = {}
        for i, name in enumerate(self.order):
            if name == self.input_name:
                inp = x
            else:
                if not self.preds[name]:
                    raise NIRImportError(f"node {name!r} has no input")
                inp = values[self.preds[name][0]]
                for src in self.preds[name][1:]:
                    inp = inp + values[src]
            values[name] = self.nodes[str(i)](inp)
        return values[self.output_name]


def import_from_nir(graph, dt: Optional[float] = None) -> NIRNetwork:
    """A runnable torch module of a NIR graph (or of a file ``nir.write`` wrote).

    Args:
        graph: a ``nir.NIRGraph``, or the path of a NIR file.
        dt: the time step of the graph's delays (default: the graph's ``metadata['dt']``, else 1).

    Returns:
        A :class:`NIRNetwork`, time-first: ``(T, N, ...)`` in, ``(T, N, ...)`` out.

    Raises:
        NIRImportError: a node type it cannot run (named), a cycle, several inputs or outputs, or a delay
            that is not a whole number of steps.
    """
    nir = _require_nir()
    if not isinstance(graph, nir.NIRGraph):
        graph = nir.read(graph)
    return NIRNetwork(graph, dt)
