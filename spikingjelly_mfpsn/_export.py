"""What the exporters (:mod:`.nir`, :mod:`.onnx`) share: a network's layers in execution order, a layer's
stateless op on one step, BatchNorm folding, and the walk over a traced forward."""
from __future__ import annotations

import copy
import math
import numbers
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from . import _compat, deploy, rewrite, tracing
from .convert import to_time_first
from .neuron import MulFreeChannelwisePSN


# SpikingJelly's containers that hand their children one step (or the steps as a batch) at a time.
STEP_CONTAINERS = tuple(c for c in map(_compat.sj_layer, ("SeqToANNContainer", "MultiStepContainer")) if c)


# The forwards of containers that run their children one after the other.
_CHAIN_FORWARDS = (nn.Sequential.forward, *(c.forward for c in STEP_CONTAINERS))
_KNOWN = ("torch", "spikingjelly", "spikingjelly_mfpsn")  # (packages whose layers the exporters know)


def is_chain(m: nn.Module) -> bool:
    """An ``nn.Sequential`` (SpikingJelly's step containers are ones) that runs its children in turn: not
    a subclass with a forward of its own (e.g. a residual block written as one)."""
    return isinstance(m, nn.Sequential) and type(m).forward in _CHAIN_FORWARDS


def layers(net: nn.Module, prefix: str = "", whole: bool = True,
           error: type = ValueError) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` in execution order: nested Sequential containers (SeqToANNContainer is one) opened.
    ``whole``: the modules see the whole (T, N, ...) sequence (not inside a SeqToANNContainer or
    MultiStepContainer, which hand them steps): a plain ``torch.nn.Flatten`` there is given as the same
    flatten of one step. ``error`` for a layer whose class overrides its forward (the exporters know
    layers by their class)."""
    if is_chain(net):
        out, whole = [], whole and not isinstance(net, STEP_CONTAINERS)
        for name, child in net._modules.items():  # (every place: a layer used twice is listed twice)
            if child is not None:
                out += layers(child, f"{prefix}{name}.", whole, error)
        return out
    name = prefix.rstrip(".") or type(net).__name__
    owner = next(c for c in type(net).__mro__ if "forward" in c.__dict__)
    if owner.__module__.split(".")[0] not in _KNOWN and not next(net.children(), None):
        raise error(f"layer {name!r} ({type(net).__name__}) has a forward of its own, defined in {owner.__module__}: "
                    f"the exporters know torch.nn's and SpikingJelly's layers by their class, so they cannot "
                    f"export what it computes")
    if whole and type(net) in BATCH_NORMS:  # (torch's own, not SpikingJelly's multi-step one)
        raise error(f"layer {name!r}: torch.nn.{type(net).__name__} in a multi-step network normalises dim 1 of the "
                    f"(T, N, ...) sequence, its batch axis, which no per-step layer does; use SpikingJelly's "
                    f"layer.{type(net).__name__} (or put it in a SeqToANNContainer)")
    return [(name, _StepFlatten(name, net) if whole and type(net) is nn.Flatten else net)]


def fresh(name: str, used: set) -> str:
    """``name``, or ``name_2``, ``name_3``... where it is in ``used`` (a layer called twice, or named like
    an exporter's own input and output); ``used`` gets the name returned."""
    new, i = name, 1
    while new in used:
        i += 1
        new = f"{name}_{i}"
    used.add(new)
    return new


def unique(seq: list, used: set) -> list:
    """``seq`` (``layers``' list) with each name :func:`fresh`."""
    return [(fresh(name, used), module) for name, module in seq]


class _StepFlatten(nn.Flatten):
    """The flatten of one step (N, ...) that a ``torch.nn.Flatten`` does on a whole time-first sequence
    (its dims counted from 0 one lower); a ValueError where it would flatten the time or batch axis."""

    def __init__(self, name: str, module: nn.Flatten):
        start, end = module.start_dim, module.end_dim
        if 0 <= start < 2 or 0 <= end < 2:
            raise _flattens_time_or_batch(name, module)
        super().__init__(start - 1 if start > 0 else start, end - 1 if end > 0 else end)
        self.name, self.whole = name, module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(d < 0 and x.dim() + d <= 0 for d in (self.start_dim, self.end_dim)):  # (reaches N, or T)
            raise _flattens_time_or_batch(self.name, self.whole)
        return super().forward(x)


def _flattens_time_or_batch(name: str, module: nn.Flatten) -> ValueError:
    return ValueError(f"layer {name!r}: torch.nn.Flatten(start_dim={module.start_dim}, end_dim={module.end_dim}) "
                      f"in a multi-step network flattens the time or batch axis of the (T, N, ...) sequence, "
                      f"which no per-step layer does; flatten from dim 2 on, or use SpikingJelly's layer.Flatten")


def check_dt(dt, name: str = "dt") -> float:
    """``dt`` as a float: a finite number > 0 (a Python or NumPy number, not a bool)."""
    if not isinstance(dt, numbers.Real) or isinstance(dt, bool) or not (math.isfinite(dt) and dt > 0):
        raise ValueError(f"{name} must be a positive number, got {dt!r}")
    return float(dt)


def described(x) -> str:
    """What ``x`` is, for an error about an example input: a tensor's dtype and shape, or another type."""
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    kind = type(x).__qualname__ if type(x).__module__ == "builtins" else f"{type(x).__module__}.{type(x).__qualname__}"
    return f"a {kind}" + (" (not a torch.Tensor)" if hasattr(x, "shape") else "")


def per_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s stateless op on one step ``x`` (N, ...), through its torch.nn base class's forward
    (a SpikingJelly layer in multi-step mode expects a time axis); a dropout, in eval, passes ``x``."""
    if is_dropout(module):
        return x
    if isinstance(module, _StepFlatten):
        return module(x)
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.modules") and "forward" in cls.__dict__ and cls is not nn.Module:
            return cls.forward(module, x)
    return module(x)


def is_dropout(module: nn.Module) -> bool:
    """torch's dropouts and SpikingJelly's (which pass their input unchanged in eval)."""
    return isinstance(module, (nn.modules.dropout._DropoutNd, nn.Identity)) or \
        type(module).__name__ in ("Dropout", "Dropout2d")


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)  # (SpikingJelly's subclass them)


def fold_bn(weight, bias, bn: nn.BatchNorm1d):
    """``(weight, bias)`` of a Conv/Linear followed by ``bn`` in eval: the BatchNorm folded in (constants)."""
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    scale = (bn.weight.detach() if bn.affine else torch.ones_like(bn.running_var)) / torch.sqrt(bn.running_var + bn.eps)
    shift = (bn.bias.detach() if bn.affine else torch.zeros_like(bn.running_mean)) - bn.running_mean * scale
    bias = torch.zeros_like(bn.running_mean) if bias is None else bias
    return weight * scale.reshape(-1, *[1] * (weight.dim() - 1)), bias * scale + shift


def bn_after(seq, i, feat: tuple, error: type = ValueError):
    """The BatchNorm right after layer ``i`` of ``seq`` (``layers``' list), or None; ``error`` where it has
    no running statistics to fold, or where it normalises other values than layer ``i``'s outputs: after a
    Linear on steps of per-sample shape ``feat`` with more than one dim (it acts on the last, a batch
    norm on dim 1)."""
    nxt = seq[i + 1][1] if i + 1 < len(seq) else None
    if not isinstance(nxt, BATCH_NORMS):
        return None
    if nxt.running_mean is None:
        raise error(f"layer {seq[i + 1][0]!r}: a BatchNorm without running statistics (track_running_stats=False) "
                    f"cannot be folded")
    if isinstance(seq[i][1], nn.Linear) and len(feat) != 1:
        raise error(f"layer {seq[i + 1][0]!r}: a BatchNorm after the Linear {seq[i][0]!r} on steps of shape (N, "
                    f"{', '.join(map(str, feat))}) normalises dim 1, not the Linear's output features (the last "
                    f"dim), so it cannot be folded into it")
    return nxt


def prepared(net: nn.Module, example_input: torch.Tensor) -> nn.Module:
    """A time-first, eval, folded copy of ``net``, checked to run on ``example_input`` (ValueError if
    not, or where ``net`` has lazy parameters or parameters of another dtype)."""
    if any(isinstance(t, nn.parameter.UninitializedTensorMixin) for t in list(net.parameters()) + list(net.buffers())):
        raise ValueError("net has uninitialised (lazy) parameters, e.g. a neuron built with channels=None: run it "
                         "once on an input first")
    dtypes = sorted({str(p.dtype) for p in net.parameters() if p.is_floating_point()})
    if dtypes and str(example_input.dtype) not in dtypes:
        raise ValueError(f"example_input is {example_input.dtype} but net's parameters are {', '.join(dtypes)}: "
                         f"give an example of the network's dtype")
    net = copy.deepcopy(net).eval()
    if any(getattr(m, "layout", "time_first") == "time_last" for m in net.modules()) or \
            getattr(net.forward, "time_first_calls", None) is not None:
        net = to_time_first(net)
    net = deploy.fold(net) if any(isinstance(m, MulFreeChannelwisePSN) for m in net.modules()) else net
    try:
        with torch.no_grad():
            net(example_input)
    except Exception as e:  # noqa: BLE001  (any failure of the user's network on the example)
        raise ValueError(f"net does not run on example_input of shape {tuple(example_input.shape)} "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                         f"give one input of the network, time-first (T, N, ...)") from e
    finally:
        _compat.functional.reset_net(net)
    return net


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.add, torch.add) and not node.kwargs) or \
        (node.op == "call_method" and node.target == "add" and not node.kwargs)


def _flatten_start(node: fx.Node, shapes: dict) -> Optional[int]:
    """The start dim (counted from 0) of a ``torch.flatten(x, start)`` / ``x.flatten(start)`` to the end,
    else None."""
    if node.target not in (torch.flatten, "flatten") or node.op not in ("call_function", "call_method"):
        return None
    args = list(node.args[1:]) + [node.kwargs.get(k) for k in ("start_dim", "end_dim") if k in node.kwargs]
    start = args[0] if args else 0
    end = args[1] if len(args) > 1 else -1
    if end != -1 or not isinstance(start, int):
        return None
    return start + len(shapes[node.args[0]]) if start < 0 else start


def walk(net: nn.Module, graph: fx.Graph, shapes: dict, out, error: type):
    """Visit every node of ``net``'s traced ``graph`` in order, building through ``out`` (an exporter's
    builder): ``out.input()``, ``out.chain(seq, value, feat)`` for modules (Sequential ones opened, a
    BatchNorm appended to the Conv/Linear whose only user it is), ``out.sum(name, a, b, feat)`` for an addition
    and ``out.flatten(name, value, start, feat)`` for a flatten to the end (``feat``: the per-step shape of
    the time-first value). Returns the output's value; anything else raises ``error`` naming the call."""
    values, folded_into, used = {}, {}, set(out.reserved)
    for node in graph.nodes:
        if node.op == "placeholder":
            values[node] = out.input()
        elif node.op == "output":
            if not isinstance(node.args[0], fx.Node):
                raise error(f"{type(net).__name__}'s forward returns {type(node.args[0]).__name__}: the exporters write "
                            f"a network with one output, a tensor")
            return values[node.args[0]]
        elif node in folded_into:  # a BatchNorm folded into the layer before it
            values[node] = values[folded_into[node]]
        elif node.op == "call_module":
            module = net.get_submodule(node.target)
            seq = layers(module, f"{node.target}.", error=error)
            user = next(iter(node.users)) if len(node.users) == 1 else None
            if len(seq) == 1 and user is not None and user.op == "call_module" and \
                    isinstance(net.get_submodule(user.target), BATCH_NORMS):
                seq += layers(net.get_submodule(user.target), f"{user.target}.", error=error)  # (its checks too)
                folded_into[user] = node
            values[node], _ = out.chain(unique(seq, used), values[node.args[0]], tuple(shapes[node.args[0]][2:]))
        elif _is_add(node) and all(isinstance(a, fx.Node) for a in node.args):
            values[node] = out.sum(fresh(node.name, used), values[node.args[0]], values[node.args[1]],
                                   tuple(shapes[node][2:]))
        elif (start := _flatten_start(node, shapes)) is not None and start >= 2:
            values[node] = out.flatten(fresh(node.name, used), values[node.args[0]], start,
                                       tuple(shapes[node.args[0]][2:]))
        else:
            raise error(f"{rewrite.describe(node)} cannot be exported: the exporters follow modules, "
                        f"additions (residual connections) and flatten")
    raise error("the traced forward has no output")


def follow(net: nn.Module, example_input: torch.Tensor, out, error: type):
    """``(output value, its per-step shape)`` of ``net`` built through ``out`` (see :func:`walk`): layer by
    layer for an ``nn.Sequential`` of layers (or a lone neuron), else along its forward traced on
    ``example_input`` (blocks with forwards of their own, e.g. residual ones, may sit in Sequentials)."""
    feat = tuple(example_input.shape[2:])
    if isinstance(net, deploy.FoldedMulFreePSN) or is_chain(net) and not any(
            next(m.children(), None) is not None and not tracing.is_leaf(m) for _, m in layers(net, error=error)):
        return out.chain(unique(layers(net, error=error), set(out.reserved)), out.input(), feat)  # (no block)
    try:
        graph, _, _ = tracing.trace(net, example_input)
    except tracing.TraceFailure as e:
        raise error(f"cannot follow {type(net).__name__}'s forward: {e}") from e
    result, shapes = tracing.run_graph(net, graph, example_input)
    return walk(net, graph, shapes, out, error), tuple(result.shape[2:])
