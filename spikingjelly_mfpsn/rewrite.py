"""Rewrite a traced forward for the time-last layout.

Every value of the traced graph (see :mod:`.tracing`) is kept in one of two forms: *original* (as the
time-first network computes it) or *time-last* (the same tensor with its time axis moved to the end).
Layers that have a time-last version take and give time-last values; the functional calls between
them are rewritten so that they give the same values in the time-last form:

* element-wise calls (``+``, ``*``, ``torch.where``, activations...): unchanged, with each operand
  that has no time axis reshaped so that it broadcasts as before;
* calls with dimension arguments (``flatten``, ``mean``/``sum``/``amax``..., ``softmax``, ``cat``,
  ``stack``, ``transpose``/``permute``, ``unsqueeze``/``squeeze``): the dimensions renumbered;
* ``reshape``/``view`` that keep the time axis apart, ``x[...]`` with plain indices, ``x.shape`` and
  ``x.size()`` (which report the time-first shape, so shape arithmetic is unchanged);
* any other call runs on the original form (its time-last operands moved back, a copy each way),
  which is always correct; :attr:`GraphForward.time_first_calls` lists those calls.
"""
from __future__ import annotations

import importlib
import math
import operator
import types

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_arg

from .tracing import changed_reads, time_axis

TIME_LAST, ORIGINAL = "time_last", "original"

_ELEMENTWISE_NAMES = frozenset("""
add sub pos subtract mul multiply div divide true_divide floor_divide remainder fmod pow where clamp clip
clamp_min clamp_max maximum minimum abs neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid
tanh relu relu6 sign sgn logical_and logical_or logical_xor logical_not bitwise_and bitwise_or bitwise_xor
bitwise_not eq ne lt le gt ge heaviside floor ceil round trunc frac sin cos erf square reciprocal lerp
addcmul addcdiv masked_fill nan_to_num float double half bfloat16 int long bool to type type_as detach
clone contiguous leaky_relu gelu silu elu selu celu mish hardtanh hardsigmoid hardswish softplus softsign
logsigmoid threshold dropout sigmoid_ relu_ add_ sub_ mul_ div_ clamp_ masked_fill_ requires_grad_
""".split())
_OPERATORS = {getattr(operator, name): name for name in
              "add sub mul truediv floordiv mod pow and_ or_ xor neg pos invert eq ne lt le gt ge abs".split()}
_NAMESPACES = (torch, F, torch.special)
_REDUCTIONS = frozenset("mean sum amax amin prod nansum nanmean logsumexp".split())
_SAME_SHAPE = frozenset("softmax log_softmax cumsum cumprod".split())
_TRANSPOSES = frozenset("transpose swapaxes swapdims".split())
_CATS = frozenset("cat concat concatenate".split())
_SAME_IN_BOTH = frozenset("dtype device ndim is_cuda requires_grad".split())  # attributes


def op_name(n: fx.Node):
    """The name a rule is looked up by: a Tensor method's name, or a torch/functional/operator
    function's (operator.add -> 'add'); None for anything else (user functions)."""
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return None
    if n.target in _OPERATORS:
        name = _OPERATORS[n.target]
        return {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and",
                "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not"}.get(name, name)
    if n.target in (operator.getitem, getattr):
        return n.target.__name__
    name = getattr(n.target, "__name__", None)
    return name if any(getattr(ns, name or "", None) is n.target for ns in _NAMESPACES) else None


def is_layout_free(n: fx.Node) -> bool:
    """A call whose result does not depend on where the time axis is (other calls do, or may): an
    element-wise call, a reduction of a whole tensor, a layout-free attribute, a tuple built."""
    name = op_name(n)
    return (name in _ELEMENTWISE_NAMES or name == "getattr" and n.args[1] in _SAME_IN_BOTH
            or name in _REDUCTIONS and len(n.args) == 1 and not n.kwargs
            or n.op == "call_function" and isinstance(n.target, type) and issubclass(n.target, tuple))


def describe(n: fx.Node) -> str:
    """``n``'s call and, where tracing recorded it, the module and source line it comes from."""
    call = f"{n.target if isinstance(n.target, str) else getattr(n.target, '__name__', n.target)}"
    stack = n.meta.get("nn_module_stack")
    where = ""
    if stack:
        path, kind = list(stack.values())[-1]
        where = f" in {path or '(the network)'} ({getattr(kind, '__name__', kind)})"
    trace = (n.stack_trace or "").strip().splitlines()
    user = [i for i, t in enumerate(trace) if t.strip().startswith("File") and "/torch/" not in t
            and "spikingjelly_mfpsn" not in t]
    if not user:
        return call + where
    i = user[-1]
    code = trace[i + 1].strip() if i + 1 < len(trace) and not trace[i + 1].strip().startswith("File") else ""
    return f"{call}{where} ({trace[i].strip()}: {code})"


# ---------------------------------------------------------------------------- helpers the graph calls
def time_first_shape(x: torch.Tensor, tpos: int) -> torch.Size:
    """The time-first shape of time-last ``x`` whose time axis was at ``tpos``."""
    shape = list(x.shape)
    return torch.Size(shape[:tpos] + shape[-1:] + shape[tpos:-1])


def reshape_time_last(x: torch.Tensor, tpos: int, *shape) -> torch.Tensor:
    """``x`` (time-last) reshaped as the time-first value to ``shape`` (time at ``tpos``), time-last."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = x.numel() // known if known else 0
    return x.reshape(shape[:tpos] + shape[tpos + 1:] + [shape[tpos]])


# ---------------------------------------------------------------------------- the rewriter
class _NoRule(Exception):
    """This call cannot be rewritten for the time-last form: run it on the original form."""


class Unrewritable(Exception):
    """The forward cannot be rewritten (the message names the call)."""


def call_time_first(module: torch.nn.Module, *args, **kwargs):
    """``module`` on time-first values: a layer called on a time-last sequence at one place of a forward
    and on a value without a time axis at another (``fc(y) + fc(y.mean(0))``) is a wrapper at both."""
    return getattr(module, "time_first_module", module)(*args, **kwargs)


def _in_place(n: fx.Node) -> bool:
    """``n`` writes into its first argument, a node (``x.zero_()``, ``x[i] = v``, ``torch.relu_(x)``)."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (n.op in ("call_method", "call_function") and bool(n.args) and isinstance(n.args[0], fx.Node)
            and (n.target is operator.setitem or isinstance(name, str) and name.endswith("_")
                 and not name.startswith("_")))


def _dims(value, ndim: int) -> list:
    """Dimension arguments as non-negative ints; one computed in the graph (``x.ndim - 2``) has no rule."""
    dims = value if isinstance(value, (tuple, list)) else [value]
    if not all(isinstance(d, int) for d in dims):
        raise _NoRule
    return [d + ndim if d < 0 else d for d in dims]


def _bind(n: fx.Node, params: tuple) -> dict:
    """``n``'s arguments after the first by name: ``params`` is ``((name, default), ...)``."""
    out = {name: default for name, default in params}
    names = [name for name, _ in params]
    if len(n.args) - 1 > len(names) or set(n.kwargs) - set(names):
        raise _NoRule
    out.update(zip(names, n.args[1:]))
    out.update(n.kwargs)
    return out


class Rewriter:
    """Builds the time-last graph of ``graph`` (traced from ``root``), node by node.

    Args:
        shapes: each node's value's shape on the example (``shapes[0]``) and on another input
            (``shapes[1]``), from :func:`.tracing.run_graph`; ``steps`` is the example's T
        grown: the other input is one step longer, so a value's time axis is the dimension that grew;
            else (a network that runs for one number of steps only) it has one sample fewer, and the time
            axes are followed from the input through the rules (a call no rule covers gives none)
        convert_module: ``(module, path) -> bool``: records the module's time-last version, or says
            (False) that it runs as it is
    """

    def __init__(self, root, graph: fx.Graph, shapes: tuple, steps: int, convert_module, boundary: bool,
                 grown: bool = True):
        self.root, self.graph, self.convert_module, self.boundary = root, graph, convert_module, boundary
        (self.shape, self.shape_b), self.steps, self.grown = shapes, steps, grown
        self.tpos = {n: time_axis(shapes[0].get(n), shapes[1].get(n), steps) for n in graph.nodes} if grown else {}
        self.new = fx.Graph()
        self.env, self.moved, self.time_first_calls = {}, {}, []

    def run(self) -> fx.Graph:
        for n in self.graph.nodes:
            getattr(self, f"_{n.op}")(n)
            self.tpos.setdefault(n, None)
            if _in_place(n) or n.op == "call_module" and getattr(self.root.get_submodule(n.target), "inplace", False):
                self.moved.clear()  # (the copies made before, of it or of a view of it, are stale)
        self.new.lint()
        return self.new

    # -- forms
    def get(self, a, form: str):
        """The new graph's node for argument ``a`` of the old graph, in ``form``."""
        if not isinstance(a, fx.Node):
            return a
        new, have = self.env[a]
        if have == form:
            return new
        if (a, form) not in self.moved:
            t = self.tpos[a]
            src, dst = (t, -1) if form == TIME_LAST else (-1, t)
            moved = self.new.call_method("movedim", (new, src, dst))
            self.moved[a, form] = self.new.call_method("contiguous", (moved,))
        return self.moved[a, form]

    def emit(self, n: fx.Node, args, kwargs, form: str, target=None, op=None) -> None:
        new = self.new.create_node(op or n.op, n.target if target is None else target, tuple(args), dict(kwargs),
                                   name=n.name)
        new.meta = dict(n.meta)
        self.env[n] = (new, form)

    def as_original(self, n: fx.Node) -> None:
        if _in_place(n) and self.env[n.args[0]][1] == TIME_LAST:  # (it would change a copy)
            raise Unrewritable(f"{describe(n)} changes a tensor in place that has no time-last rule")
        if not self.grown:  # a value of T steps first, whatever the batch size: time first; else none known
            self.tpos[n] = None
            self._keeps_time(n)
        if any(self.env[a][1] == TIME_LAST for a in n.all_input_nodes):
            self.time_first_calls.append(describe(n))
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.get(a, ORIGINAL))
        if n.op == "call_module":  # (its module may be converted for a call elsewhere)
            args, op, target = (self.new.get_attr(n.target),) + args, "call_function", call_time_first
        else:
            op = target = None
        self.emit(n, args, kwargs, ORIGINAL, target, op)

    def _is_tensor(self, a) -> bool:
        shape = self.shape.get(a) if isinstance(a, fx.Node) else None
        return isinstance(shape, tuple) and all(isinstance(s, int) for s in shape)

    # -- node kinds
    def _placeholder(self, n: fx.Node) -> None:
        first = not self.env
        if first and not self.grown:
            self.tpos[n] = 0  # (T, N, ...)
        new = self.new.node_copy(n, lambda a: a)
        self.env[n] = (new, TIME_LAST if first and not self.boundary else ORIGINAL)

    def _get_attr(self, n: fx.Node) -> None:
        self.env[n] = (self.new.node_copy(n, lambda a: a), ORIGINAL)

    def _output(self, n: fx.Node) -> None:
        keep = lambda a: self.get(a, TIME_LAST if not self.boundary and self.tpos[a] is not None else ORIGINAL)  # noqa
        self.new.output(map_arg(n.args[0], keep))

    def _call_module(self, n: fx.Node) -> None:
        x = n.args[0] if n.args else None
        if (isinstance(x, fx.Node) and self.tpos[x] == 0 and self._keeps_time(n)
                and self.convert_module(self.root.get_submodule(n.target), n.target)):
            args = (self.get(x, TIME_LAST),) + map_arg(n.args[1:], lambda a: self.get(a, ORIGINAL))
            self.emit(n, args, map_arg(n.kwargs, lambda a: self.get(a, ORIGINAL)), TIME_LAST)
        else:
            self.as_original(n)

    def _keeps_time(self, n: fx.Node) -> bool:
        """A module's output has its time axis first, as its input (a network of one number of steps:
        its first dim has T steps on both probes, whose batch sizes differ)."""
        if self.grown:
            return self.tpos[n] == 0
        shapes = (self.shape.get(n), self.shape_b.get(n))
        if self._is_tensor(n) and all(isinstance(s, tuple) and s[:1] == (self.steps,) for s in shapes):
            self.tpos[n] = 0
        return self.tpos.get(n) == 0

    def _call_function(self, n: fx.Node) -> None:
        name = op_name(n)
        rule = _RULES.get("elementwise" if name in _ELEMENTWISE_NAMES else name)
        if rule is None or not any(self.tpos[a] is not None for a in n.all_input_nodes) or not self._apply(rule, n):
            self.as_original(n)

    def _apply(self, rule, n: fx.Node) -> bool:
        """Run ``rule`` on ``n``; where it does not apply, take back the nodes it added on the way."""
        mark, moved = len(self.new.nodes), dict(self.moved)
        try:
            rule(self, n)
            return True
        except _NoRule:
            for node in reversed(list(self.new.nodes)[mark:]):
                self.new.erase_node(node)
            self.moved = moved
            return False

    _call_method = _call_function

    # -- rules (each emits the node in time-last or original form, or raises _NoRule)
    def _time_input(self, n: fx.Node, a=None):
        a = n.args[0] if a is None else a
        if not isinstance(a, fx.Node) or self.tpos[a] is None or not self._is_tensor(a):
            raise _NoRule
        return a, self.tpos[a], len(self.shape[a])

    def _out_tpos(self, n: fx.Node, expected: int) -> int:
        """The time axis of ``n``'s value, where the rule says it is (checked against the probe)."""
        if not self.grown:
            self.tpos[n] = expected
        elif self.tpos[n] != expected:
            raise _NoRule
        return expected

    def elementwise(self, n: fx.Node) -> None:
        if not self._is_tensor(n) or _in_place(n) and self.env[n.args[0]][1] != TIME_LAST:
            raise _NoRule  # (an in-place call on the time-last copy of an original value would change the copy)
        n_out = len(self.shape[n])
        timed = [a for a in n.all_input_nodes if self._is_tensor(a) and self.tpos[a] is not None]
        aligned = {self.tpos[a] + n_out - len(self.shape[a]) for a in timed}
        if len(aligned) != 1:
            raise _NoRule
        t_out = self._out_tpos(n, aligned.pop())

        def operand(a):
            if not self._is_tensor(a):
                return self.get(a, ORIGINAL)
            k = len(self.shape[a])
            if self.tpos[a] is not None:
                return self.get(a, TIME_LAST)
            new = self.get(a, ORIGINAL)
            if k == 0:
                return new
            if n_out - k > t_out:  # does not reach the time axis: one more trailing dim
                return self.new.call_method("unsqueeze", (new, -1))
            return self.new.call_method("movedim", (new, t_out - (n_out - k), -1))

        args, kwargs = map_arg((n.args, n.kwargs), operand)
        self.emit(n, args, kwargs, TIME_LAST)

    def _map(self, d: int, ndim: int, t: int) -> int:
        return ndim - 1 if d == t else d - (d > t)

    def flatten(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        p = _bind(n, (("start_dim", 0), ("end_dim", -1)))
        start, end = _dims([p["start_dim"], p["end_dim"]], nd)
        if start <= t <= end:
            raise _NoRule
        self._out_tpos(n, t if t < start else t - (end - start))
        args = (self.get(a, TIME_LAST), self._map(start, nd, t), self._map(end, nd, t))
        self.emit(n, args, {}, TIME_LAST, target="flatten", op="call_method")

    def reduction(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        p = _bind(n, (("dim", None), ("keepdim", False), ("dtype", None)))
        if p["dim"] is None:
            form = ORIGINAL  # the whole tensor: a number
            if n.args[1:] or set(n.kwargs) - {"dtype"}:
                raise _NoRule
            dims = None
        else:
            dims = _dims(p["dim"], nd)
            if t in dims and p["keepdim"]:
                raise _NoRule
            form = ORIGINAL if t in dims else TIME_LAST
            if form == TIME_LAST:
                self._out_tpos(n, t - sum(d < t for d in dims))
            elif self.tpos.get(n) is not None:
                raise _NoRule
            dims = [self._map(d, nd, t) for d in dims]
        kwargs = {} if dims is None else {"dim": dims if isinstance(p["dim"], (tuple, list)) else dims[0]}
        kwargs.update({"keepdim": True} if p["keepdim"] else {})
        kwargs.update({} if p["dtype"] is None else {"dtype": p["dtype"]})
        self.emit(n, (self.get(a, TIME_LAST),), kwargs, form, target=n.target, op=n.op)

    def same_shape(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        p = _bind(n, (("dim", None), ("dtype", None)))
        if p["dim"] is None:
            raise _NoRule
        self._out_tpos(n, t)
        kwargs = {"dim": self._map(_dims(p["dim"], nd)[0], nd, t), **({"dtype": p["dtype"]} if p["dtype"] else {})}
        self.emit(n, (self.get(a, TIME_LAST),), kwargs, TIME_LAST)

    def permutation(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        name = op_name(n)
        if name in _TRANSPOSES:
            p = _bind(n, (("dim0", None), ("dim1", None)))
            d0, d1 = _dims([p["dim0"], p["dim1"]], nd)
            perm = list(range(nd))
            perm[d0], perm[d1] = d1, d0
        else:
            dims = n.args[1:] if n.args[1:] else (n.kwargs.get("dims"),)
            dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
            perm = _dims(list(dims), nd)
        if sorted(perm) != list(range(nd)):
            raise _NoRule
        self._out_tpos(n, perm.index(t))
        order = [self._map(d, nd, t) for d in perm if d != t] + [nd - 1]
        self.emit(n, (self.get(a, TIME_LAST), *order), {}, TIME_LAST, target="permute", op="call_method")

    def unsqueeze(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        (d,) = _dims(_bind(n, (("dim", None),))["dim"], nd + 1)
        t_out = self._out_tpos(n, t + (d <= t))
        self.emit(n, (self.get(a, TIME_LAST), d - (d > t_out)), {}, TIME_LAST)

    def squeeze(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        dim = _bind(n, (("dim", None),))["dim"]
        if dim is None:
            if self.steps == 1:
                raise _NoRule
            self._out_tpos(n, t - sum(size == 1 for size in self.shape[a][:t]))
            args = (self.get(a, TIME_LAST),)
        else:
            dims = _dims(dim, nd)
            if t in dims:
                raise _NoRule
            self._out_tpos(n, t - sum(d < t for d in dims))
            mapped = [self._map(d, nd, t) for d in dims]
            args = (self.get(a, TIME_LAST), mapped[0] if isinstance(dim, int) else tuple(mapped))
        self.emit(n, args, {}, TIME_LAST, target="squeeze", op="call_method")

    def concatenation(self, n: fx.Node) -> None:
        tensors = n.args[0] if n.args else n.kwargs.get("tensors")
        p = _bind(n, (("dim", 0),)) if n.args else {"dim": n.kwargs.get("dim", 0)}
        if not isinstance(tensors, (tuple, list)) or not tensors:
            raise _NoRule
        found = {self._time_input(n, a)[1:] for a in tensors}
        if len(found) != 1:
            raise _NoRule
        ((t, nd),) = found
        stack = op_name(n) == "stack"
        (d,) = _dims(p["dim"], nd + stack)
        if stack:
            t_out = self._out_tpos(n, t + (d <= t))
            new_d = d - (d > t_out)
        else:
            if d == t:
                raise _NoRule
            self._out_tpos(n, t)
            new_d = self._map(d, nd, t)
        args = ([self.get(a, TIME_LAST) for a in tensors], new_d)
        self.emit(n, args, {}, TIME_LAST, target=torch.stack if stack else torch.cat, op="call_function")

    def size(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        if n.op == "call_function":  # getattr(x, 'shape'), or another attribute
            if n.args[1] in _SAME_IN_BOTH:
                return self.emit(n, (self.get(a, TIME_LAST), n.args[1]), {}, ORIGINAL)
            if n.args[1] != "shape":
                raise _NoRule
            dim = None
        else:
            dim = _bind(n, (("dim", None),))["dim"]
        x = self.get(a, TIME_LAST)
        if dim is None:
            self.emit(n, (x, t), {}, ORIGINAL, target=time_first_shape, op="call_function")
        else:
            self.emit(n, (x, self._map(_dims(dim, nd)[0], nd, t)), {}, ORIGINAL, target="size", op="call_method")

    def reshape(self, n: fx.Node) -> None:
        a, t, _ = self._time_input(n)
        if not self._is_tensor(n):
            raise _NoRule
        out = self.shape[n]  # where the time axis is: after the dims that hold what was before it
        t_out = next((d for d, size in enumerate(out) if size == self.steps
                      and math.prod(out[:d]) == math.prod(self.shape[a][:t])), None)
        if t_out is None:
            raise _NoRule
        self._out_tpos(n, t_out)
        for shapes in (self.shape, self.shape_b):  # the dims before time hold the same elements
            if math.prod(shapes[a][:t]) != math.prod(shapes[n][:t_out]):
                raise _NoRule
        shape = map_arg(n.args[1:] or (n.kwargs.get("shape"),), lambda s: self.get(s, ORIGINAL))
        self.emit(n, (self.get(a, TIME_LAST), t_out, *shape), {}, TIME_LAST, target=reshape_time_last,
                  op="call_function")

    def getitem(self, n: fx.Node) -> None:
        a, t, nd = self._time_input(n)
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if any(isinstance(i, fx.Node) or not (i is None or i is Ellipsis or isinstance(i, (int, slice)))
               or isinstance(i, bool) for i in index):
            raise _NoRule
        used = sum(i is not None and i is not Ellipsis for i in index)
        if sum(i is Ellipsis for i in index) > 1 or used > nd:
            raise _NoRule
        full = []
        for i in index:
            full += [slice(None)] * (nd - used) if i is Ellipsis else [i]
        full += [slice(None)] * (nd - sum(i is not None for i in full))
        at = [pos for pos, i in enumerate(full) if i is not None][t]
        before = sum(not isinstance(i, int) for i in full[:at])  # output dims before the time axis
        time_index = full.pop(at)
        if isinstance(time_index, int):
            form = ORIGINAL
            if self.tpos.get(n) is not None:
                raise _NoRule
        elif time_index == slice(None):
            form = TIME_LAST
            self._out_tpos(n, before)
        else:
            raise _NoRule
        index = map_arg(tuple(full + [time_index]), lambda i: self.get(i, ORIGINAL))  # (x[:, :y.shape[1] // 2])
        self.emit(n, (self.get(a, TIME_LAST), index), {}, form)


_RULES = {"elementwise": Rewriter.elementwise, "flatten": Rewriter.flatten, "unsqueeze": Rewriter.unsqueeze,
          "squeeze": Rewriter.squeeze, "permute": Rewriter.permutation, "size": Rewriter.size,
          "getattr": Rewriter.size, "reshape": Rewriter.reshape, "view": Rewriter.reshape,
          "getitem": Rewriter.getitem, "stack": Rewriter.concatenation,
          **dict.fromkeys(_REDUCTIONS, Rewriter.reduction), **dict.fromkeys(_SAME_SHAPE, Rewriter.same_shape),
          **dict.fromkeys(_TRANSPOSES, Rewriter.permutation), **dict.fromkeys(_CATS, Rewriter.concatenation)}


# ---------------------------------------------------------------------------- the forward it becomes
class GraphForward:
    """A network's rewritten forward: the code of an fx graph, run with the network as ``self``.

    Installed as the network's ``forward`` by :func:`~spikingjelly_mfpsn.to_time_last`; ``code`` is its
    Python source, ``time_first_calls`` the calls it runs on the original form, ``boundary`` whether it
    takes and returns time-first tensors. It deep-copies and pickles with the network. ``reads``: the
    plain attribute values the traced forward read (:func:`~spikingjelly_mfpsn.tracing.trace`), which
    the code holds as constants: a call after one of them changed raises ``RuntimeError``.
    """

    def __init__(self, graph: fx.Graph, net, boundary: bool, time_first_calls=(), traced: str = "symbolic",
                 reads=()):
        code = graph.python_code(root_module="self")
        self.code, self.net, self.boundary = code.src, net, boundary
        self.time_first_calls, self.traced, self.reads = list(time_first_calls), traced, list(reads)
        # (the tensor constants fx's trace set on the network, which the code reads)
        self.constants = sorted({n.target for n in graph.nodes if n.op == "get_attr"} & set(vars(net)))
        self._globals = dict(code.globals)
        self._compile()

    def _compile(self) -> None:
        namespace = dict(self._globals)
        exec(compile(self.code, "<time-last forward>", "exec"), namespace)  # noqa: S102  (fx's own code)
        self._fn = namespace["forward"]

    @property
    def __code__(self):
        """The rewritten code's, for tools that read a forward's (``torch.export``'s non-strict mode)."""
        return self._fn.__code__

    def __call__(self, *args, **kwargs):
        if self.reads and changed_reads(self.reads):
            raise RuntimeError(f"attributes the forward reads changed since to_time_last traced it "
                               f"({', '.join(changed_reads(self.reads))}), and its time-last version holds the "
                               f"values it read; convert again: to_time_first(net), then to_time_last(net, ...)")
        return self._fn(self.net, *args, **kwargs)

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "_fn"}
        state["_globals"] = {k: (_Module(v.__name__) if isinstance(v, types.ModuleType) else v)
                             for k, v in self._globals.items()}
        return state

    def __setstate__(self, state):
        self.__dict__.update({"reads": [], "constants": []}, **state)
        self._globals = {k: (importlib.import_module(v.name) if isinstance(v, _Module) else v)
                         for k, v in self._globals.items()}
        self._compile()


class _Module:
    """A module in a pickled GraphForward's globals (modules themselves do not pickle)."""

    def __init__(self, name: str):
        self.name = name
