"""See a network's forward: torch.fx tracing with SpikingJelly's modules as leaves, and the time axis of
every value.

* :func:`trace` records ``net.forward`` as an fx graph whose ``call_module`` nodes are SpikingJelly's
  layers and neurons, MF-PSN, torch.nn's built-in layers and this package's time-last wrappers, and
  whose other nodes are the functional calls in between (``torch.flatten``, ``x.mean(0)``, ``+``...).
  Symbolic tracing first; where the forward branches on its input (``if x.ndim == 4``) and an example
  input is given, concrete tracing: every node is also run on the example, and control flow follows
  the values (the branch taken for the example's rank is the one recorded).
* :func:`time_axes` runs the graph on the example and on the same example one step longer, and finds in
  every tensor value the dimension that grew with it: that value's time axis (or none, e.g. after
  ``mean(0)`` or where time is merged into another dimension).
"""
from __future__ import annotations

import contextlib
import operator
import os
import re
import traceback
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import _compat, layer
from ._util import as_args, modes_kept
from .neuron import ChargeNeuronBase

_LEAF_TYPES = (_compat.StepModule, _compat.MemoryModule, _compat.MultiStepModule, ChargeNeuronBase,
               layer.TimeLastModule, layer.TimeLastDropout, layer.TimeLastSequential, layer.TLastSeqToANNContainer)


def is_leaf(m: nn.Module) -> bool:
    """Modules the conversion treats as one unit: SpikingJelly's (layers, neurons, containers,
    surrogate functions), MF-PSN, the time-last wrappers, layout-aware modules and any layer that has
    a time-last wrapper. Other modules (blocks, ``nn.Sequential``) are traced through."""
    return (isinstance(m, _LEAF_TYPES) or isinstance(m, _compat.surrogate.SurrogateFunctionBase)
            or getattr(m, "layout_aware", False) or layer.wrapper_class(m) is not None)


def _grad_modes() -> tuple:
    return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")


class _Tracer(fx.Tracer):
    record_stack_traces = True  # so that a message can name the source line of a call

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf(m) or super().is_leaf_module(m, qualname)

    watch_modes = False

    def trace(self, root, concrete_args=None) -> fx.Graph:
        """The graph; with ``watch_modes``, :class:`TraceFailure` where the forward switches gradient or
        autocast mode (a graph does not record it, so its calls would run in the caller's mode)."""
        self.modes, self.switched = _grad_modes(), False
        graph = super().trace(root, concrete_args)
        if self.switched and self.watch_modes:
            raise TraceFailure("its forward switches gradient or autocast mode (torch.no_grad, enable_grad, "
                               "autocast), which a trace does not record")
        return graph

    def create_node(self, *args, **kwargs) -> fx.Node:
        self.switched = self.switched or _grad_modes() != self.modes
        return super().create_node(*args, **kwargs)


class _ConcreteProxy(fx.Proxy):
    """A proxy that also holds the value its node takes on the example input."""

    @property
    def value(self):
        return self.tracer.values[self.node]

    def __len__(self):
        return self.tracer.guarded(self, len(self.tracer._shape_value(self, tensors=True)), "len")

    def __index__(self):
        return self.tracer.guarded(self, operator.index(self.tracer._shape_value(self)), "index")

    def __getattr__(self, k):
        return _ConcreteAttribute(self, k)


class _ConcreteAttribute(fx.proxy.Attribute, _ConcreteProxy):
    pass


class _ConcreteTracer(_Tracer):
    """Symbolic tracing that runs every node on the example as it records it (``values``), so that
    ``bool``, ``len``, iteration and indexing of proxies take the example's values; with ``guards``, the
    graph then checks at every run that they take the same values (:func:`traced_as`)."""

    def __init__(self, inputs: tuple, guards: bool = False):
        super().__init__()
        self.inputs, self.values, self._placeholders, self._running = inputs, {}, 0, False
        self.guards = guards
        self.data = set()  # nodes whose value comes from tensor data (.item(), .tolist())

    # While a node runs on the example, module calls and attributes are the real ones (fx patches them).
    def call_module(self, m, forward, args, kwargs):
        return forward(*args, **kwargs) if self._running else super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        return attr_val if self._running else super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self._running = True
        try:
            self.values[p.node] = self._run(kind, target, args, kwargs)
        finally:
            self._running = False
        if kind == "call_method" and target in ("item", "tolist") or self.data.intersection(p.node.all_input_nodes):
            self.data.add(p.node)
        return p

    def _run(self, kind, target, args, kwargs):
        args, kwargs = tree_map(self._value, (args, kwargs))
        if kind == "placeholder":
            i, self._placeholders = self._placeholders, self._placeholders + 1
            return self.inputs[i] if i < len(self.inputs) else (args[0] if args else None)
        if kind == "get_attr":
            return operator.attrgetter(target)(self.root)
        if kind == "call_module":
            return self.root.get_submodule(target)(*args, **kwargs)
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return None

    def _value(self, a):
        return self.values[a.node] if isinstance(a, fx.Proxy) else a

    def _shape_value(self, obj: fx.Proxy, tensors: bool = False):
        """A value control flow may follow: one computed from shapes, not from a tensor's data (a
        branch on the data would be recorded for the example's data only); ``tensors``: a tensor too
        (its length is a shape)."""
        value = self._value(obj)
        if isinstance(value, torch.Tensor) and not tensors or obj.node in self.data:
            raise fx.proxy.TraceError(f"control flow depends on tensor data (node {obj.node.name})")
        return value

    def to_bool(self, obj: fx.Proxy) -> bool:
        return self.guarded(obj, bool(self._shape_value(obj)), "bool")

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(self.guarded(obj, len(self._value(obj)), "len"))])

    def guarded(self, obj: fx.Proxy, value, kind: str):
        """``value``, the example's, after recording (with ``guards``) a check of it at every run: the
        forward branched or looped on it. A tensor's length is checked as its size along dim 0."""
        if self.guards:
            if kind == "len" and isinstance(self._value(obj), torch.Tensor):
                obj, kind = obj.size(0), "index"
            self.create_proxy("call_function", traced_as, (obj, kind, value, _source_line()), {})
        return value

    def keys(self, obj: fx.Proxy):
        return self._value(obj).keys()


_KINDS = {"bool": bool, "len": len, "index": operator.index}
_OWN_CODE = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _source_line() -> str:
    """The line of the user's forward being traced (the innermost frame outside torch and this package)."""
    frames = [f for f in traceback.extract_stack() if not os.path.abspath(f.filename).startswith(_OWN_CODE)]
    return f"{frames[-1].line!r} ({frames[-1].filename}:{frames[-1].lineno})" if frames else "a shape branch"


def traced_as(value, kind: str, expected, where: str) -> None:
    """Check that a traced branch or loop follows the same value as on the example input.

    Raises ValueError where ``value`` (``kind``: its ``bool``, ``len`` or ``index``) is not ``expected``,
    what it was on the example input that a concrete trace followed at ``where`` (a branch or loop on a
    shape or size, which the graph holds for the example's values only)."""
    now = _KINDS[kind](value)
    if now != expected:
        raise ValueError(f"{where} gives {now!r} on this input but gave {expected!r} on the example input the "
                         f"network was converted with (its number of steps, two of its samples), and the converted "
                         f"forward holds the example's branch or number of iterations only: convert with an "
                         f"example_input of the length you run, or keep that block time-first (convert the "
                         f"blocks around it)")


class TraceFailure(Exception):
    """Neither symbolic nor concrete tracing could record the forward (the message says why)."""


_MODULE_OWN = frozenset(vars(nn.Module()))  # nn.Module's own attributes (training, hook flags...)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or isinstance(v, tuple) and all(map(_plain, v))


class _reads_recorded:
    """While tracing, record in ``reads`` the plain Python values (numbers, strings, tuples of them) that
    the traced forwards read from their modules' attributes (``self.T``): ``(path, module, name, value)``,
    the value at the first read. A graph holds them as constants."""

    def __init__(self, net: nn.Module, reads: list):
        leaf = _Tracer().is_leaf_module
        self.traced = [(p, m) for p, m in net.named_modules() if not p or not leaf(m, p)]
        self.reads, self.seen = reads, {(id(m), name) for _, m, name, _ in reads}

    def _record(self, path: str, m: nn.Module, name: str, value) -> None:
        if (id(m), name) not in self.seen:
            self.seen.add((id(m), name))
            self.reads.append((path, m, name, value))

    def _recording(self, cls: type, path: str) -> type:
        record = self._record

        def __getattribute__(m, name):
            value = cls.__getattribute__(m, name)
            if name not in _MODULE_OWN and name in object.__getattribute__(m, "__dict__") and _plain(value):
                record(path, m, name, value)
            return value
        return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})

    def __enter__(self):
        self.classes = [type(m) for _, m in self.traced]
        for (path, m), cls in zip(self.traced, self.classes):
            m.__class__ = self._recording(cls, path)

    def __exit__(self, *exc):
        for (_, m), cls in zip(self.traced, self.classes):
            m.__class__ = cls


def changed_reads(reads: list) -> list[str]:
    """The recorded reads (see :func:`trace`) whose attribute no longer holds the value read."""
    missing = object()
    return [f"{path + '.' if path else 'self.'}{name}: {value!r} -> {now!r}" for path, m, name, value in reads
            if (now := m.__dict__.get(name, missing)) is not value and not (_plain(now) and now == value)]


def _graph(net: nn.Module, tracer: fx.Tracer) -> fx.Graph:
    return tracer.trace(net)


def trace(net: nn.Module, example_input=None, every_mode: bool = False,
          reads: Optional[list] = None, guards: bool = False) -> tuple[fx.Graph, str, Optional[dict]]:
    """``(graph, how, shapes)``: ``how`` is ``'symbolic'`` or ``'concrete'`` (then ``shapes`` holds every
    node's value's shape on ``example_input``, else None); :class:`TraceFailure` if neither works
    (concrete tracing needs ``example_input``), and with ``every_mode`` where the graph would not be the
    forward in every mode: the forward branches on ``self.training`` or switches gradient or autocast
    mode. ``reads``: a list that gets the plain attribute values the forwards read (see
    :func:`changed_reads`); a forward that changes one it reads raises :class:`TraceFailure`. ``guards``:
    a concrete graph checks at every run the values its control flow followed (:func:`traced_as`)."""
    reads = [] if reads is None else reads
    with _reads_recorded(net, reads):
        traced = _trace(net, example_input, every_mode, guards)
    changed = changed_reads(reads)
    if changed:  # (the trace's runs of the forward leave the values as they were)
        for _, m, name, value in reads:
            m.__dict__[name] = value
        raise TraceFailure(f"its forward changes attributes it reads ({', '.join(changed)}), which a trace "
                           f"records as constants")
    return traced


def _trace(net: nn.Module, example_input, every_mode: bool, guards: bool) -> tuple[fx.Graph, str, Optional[dict]]:
    def tracer(*args) -> _Tracer:
        t = _ConcreteTracer(*args, guards=guards) if args else _Tracer()
        t.watch_modes = every_mode
        return t

    def both(trace_fn) -> fx.Graph:
        return _in_both_modes(net, trace_fn) if every_mode else trace_fn()
    try:
        return both(lambda: _graph(net, tracer())), "symbolic", None
    except TraceFailure:
        raise
    except Exception as e:  # noqa: BLE001  (fx raises TraceError, TypeError, RuntimeError... from user code)
        symbolic_error = e
    if example_input is None:
        raise TraceFailure(f"symbolic tracing failed ({_first_line(symbolic_error)}); concrete tracing needs "
                           f"example_input") from symbolic_error
    tracers = []

    def concrete() -> fx.Graph:
        tracers.append(tracer(as_args(example_input)))
        with torch.enable_grad():  # (so that a torch.no_grad block in forward shows)
            return _graph(net, tracers[-1])
    with quiet(net), _state_kept(net):
        try:
            graph = both(concrete)
        except TraceFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise TraceFailure(f"symbolic tracing failed ({_first_line(symbolic_error)}), and concrete "
                               f"tracing with the example input failed ({_first_line(e)})") from e
    return graph, "concrete", {n: _shapes(v) for n, v in tracers[0].values.items()}


def _in_both_modes(net: nn.Module, trace_fn) -> fx.Graph:
    """``trace_fn()``'s graph with ``net`` as it is, after checking that a trace with every module in the
    other training mode records the same forward (:class:`TraceFailure` if not: a trace would keep one
    branch of an ``if self.training``)."""
    graph = trace_fn()
    attrs = set(net.__dict__)
    try:
        with modes_kept(net):
            net.train(not net.training)
            other = trace_fn()
    finally:
        for name in set(net.__dict__) - attrs:  # the second trace's tensor constants (fx names them anew)
            delattr(net, name)
    if _code(graph) != _code(other):
        raise TraceFailure("its forward depends on self.training (a trace records one branch of it)")
    return graph


def _code(graph: fx.Graph) -> str:
    """The graph's code, tensor constants unnumbered (each trace stores its own under a new number)."""
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", graph.python_code("self").src)


class _state_kept:
    """Every buffer of ``net`` (running statistics...) as it was before, and torch's random state."""

    def __init__(self, net: nn.Module):
        self.net = net

    def __enter__(self):
        self.buffers = [(b, b.clone()) for b in self.net.buffers()]
        self.rng = torch.random.get_rng_state()

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.random.set_rng_state(self.rng)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


# Layers drawing random numbers per element, which a time-first and a time-last network draw in another order
RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                 _compat.sj_layer("Dropout"), layer.TimeLastDropout)


@contextlib.contextmanager
def quiet(net: nn.Module, training: bool = False):
    """Eval mode, no gradients, and neuron states reset after: runs on examples leave no trace. With
    ``training``, training mode but for the random layers (:data:`RANDOM_LAYERS`), and every buffer and
    torch's random state as they were before (two runs draw the same numbers)."""
    with modes_kept(net), torch.no_grad(), _state_kept(net) if training else contextlib.nullcontext():
        net.train(training)
        for m in net.modules():
            if isinstance(m, RANDOM_LAYERS):
                m.eval()
        try:
            yield
        finally:
            _compat.functional.reset_net(net)


# ---------------------------------------------------------------------------- time axes
def probes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two inputs made from ``x`` (``(T, N, ...)``): two of its samples, and one of them one step longer
    (the last step repeated). Every dimension that depends on T, and only those, differ by one step
    between the two; a dimension that merges T with N (``T * N``) does not."""
    if x.dim() < 2:
        return x, torch.cat([x, x[-1:]])
    two = x[:, :2] if x.shape[1] >= 2 else torch.cat([x, x], dim=1)
    return two, torch.cat([two, two[-1:]])[:, :1]


def _shapes(value):
    return tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None, value)


class _ShapeRecorder(fx.Interpreter):
    def __init__(self, module: nn.Module, graph: fx.Graph):
        super().__init__(module, graph=graph)
        self.shapes = {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        self.shapes[n] = _shapes(value)
        return value


def run_graph(net: nn.Module, graph: fx.Graph, x) -> tuple[object, dict]:
    """``graph``'s outputs on input ``x`` (run on ``net``'s modules) and every node's value's shape."""
    rec = _ShapeRecorder(net, graph)
    with quiet(net):
        out = rec.run(*as_args(x))
    return out, rec.shapes


def time_axis(shape_a, shape_b, steps: int):
    """The one dimension of size ``steps`` in ``shape_a`` and ``steps + 1`` in ``shape_b``; None if
    there is not exactly one (or the values are not tensors, or their ranks differ)."""
    if not isinstance(shape_a, tuple) or not isinstance(shape_b, tuple) or len(shape_a) != len(shape_b):
        return None
    if not all(isinstance(s, int) for s in shape_a + shape_b):
        return None
    hits = [d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a == steps and b == steps + 1]
    return hits[0] if len(hits) == 1 else None
