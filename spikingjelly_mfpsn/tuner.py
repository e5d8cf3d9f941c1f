"""Autoselect (paper Algorithm 1): time every layer's implementations and apply the fastest.

Every implementation of every layer is timed on the user's real shapes, in each layout, and the fastest
configuration is applied.

For each layout: convert the net, capture every layer's input with forward hooks, and time each of the
layer's candidate methods (forward, then backward with a gradient of ones of the output's shape;
a warm-up and ``2m`` timed runs, the mean of the last ``m``, device synchronised). The fastest candidate per layer is
kept and summed per layout; the layout with the smaller sum wins. Before it is applied, the chosen
configuration is checked against the network's outputs on the example input.

Timings are cached per layer (keyed by the layer's signature, its input shape, dtype, device name and
the torch/triton/plugin versions), and the whole network's choice is cached too, so a second call on
the same model and shapes times nothing: it applies the stored choice after checking it again on a few
samples of the example batch. That check is skipped for a network whose parameters and buffers are
bit for bit those of a network the stored choice was checked on (a digest of them is kept with the
choice), e.g. the next run of a seeded script.

Measuring is in :mod:`.timing`, the cache in :mod:`.timing_cache`, the report in :mod:`.report`; their
public names (``measure``, ``TimingCache``, ``LOCK_TIMEOUT``...) are read and set here as well.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _compat, ops, timing, timing_cache
from ._util import agree, as_args, device_type, modes_kept, tensors
from .convert import FALLBACKS, TIME_LAST_TYPES, current_layout, has_time_last_boundary, to_time_first, to_time_last
from .report import AutoselectReport, LayerResult
from .timing import candidates, capture_inputs, is_tunable, layers, measure, time_candidates, timed
from .timing_cache import (TimingCache, checked_on, default_cache_path, layer_key, lock_timeout, net_key,
                           state_digest, with_check)

__all__ = ["AutoselectReport", "LayerResult", "PROBE", "TimingCache", "autoselect", "candidates", "default_cache_path",
           "is_tunable", "layer_key", "layers", "lock_timeout", "measure", "net_key", "state_digest"]

# Samples of the example batch on which a cached plan is checked again before it is applied.
PROBE = 2

# Settings that moved to the modules that read them at call time: this module's properties, read and
# set there (``tuner.LOCK_TIMEOUT = 30`` sets the wait the cache reads, as before they moved).
_MOVED = {"ABANDON": timing, **dict.fromkeys(("CACHE_SCHEMA", "CACHE_ENV", "CHECKED_STATES", "MAX_LAYER_ENTRIES",
                                                "MAX_PLANS", "LOCK_TIMEOUT", "LOCK_TIMEOUT_ENV"), timing_cache)}


def _moved(name: str, home: types.ModuleType) -> property:
    return property(lambda _: getattr(home, name), lambda _, value: setattr(home, name, value))


sys.modules[__name__].__class__ = type("_Tuner", (types.ModuleType,), {n: _moved(n, h) for n, h in _MOVED.items()})


def _convert(net: nn.Module, layout: str, fallback: Optional[str] = None, x=None) -> None:
    """Convert ``net`` to ``layout`` in place (a network that is itself one layer cannot be); ``x``: an
    example input, with which a forward that makes layout-dependent calls is rewritten."""
    if current_layout(net) != layout:
        out = (to_time_last(net, fallback=fallback, example_input=x, strict=x is not None) if layout == "time_last"
               else to_time_first(net))
        if out is not net:
            raise RuntimeError("layout conversion must work in place")


def _state_snapshot(net: nn.Module):
    """Every buffer (persistent or not) and gradient of ``net``, copied; outside inference mode, so that
    the gradients put back are tensors a later training step can accumulate into."""
    with torch.inference_mode(False), torch.no_grad():
        buffers = {k: v.clone() for k, v in net.named_buffers()}
        grads = {id(p): (p.grad.clone() if p.grad is not None else None) for p in net.parameters()}
    return buffers, grads


def _restore(net: nn.Module, snap) -> None:
    buffers, grads = snap
    with torch.inference_mode(False), torch.no_grad():
        for k, v in net.named_buffers():
            saved = buffers.get(k)
            if saved is not None and not torch.equal(v, saved):  # (an unchanged one may be an expanded view)
                v.copy_(saved)
        for p in net.parameters():  # (a copy: the next timed backward accumulates into .grad in place)
            g = grads.get(id(p))
            p.grad = None if g is None else g.clone()
    _compat.functional.reset_net(net)


def _rng_kept(net: nn.Module, x):
    """torch's random state (the CPU's, and that of the devices ``net`` and ``x`` are on) put back on
    leaving: the timed training runs draw from it (dropout), a cached call runs none, and a seeded
    script must draw the same numbers after either."""
    on = {t.device for t in [*tensors(x), *net.parameters(), *net.buffers()] if t.device.type not in ("cpu", "meta")}
    kind = min((d.type for d in on), default="cuda")
    backend = getattr(torch, kind, None)
    devices = sorted({d.index if d.index is not None else backend.current_device() for d in on if d.type == kind})
    return torch.random.fork_rng(devices=devices, device_type=kind)


def _outputs(net: nn.Module, x) -> torch.Tensor:
    """Eval-mode outputs (deterministic: running statistics, no dropout), in full precision even
    under autocast: the check compares configurations, and reduced precision rounds each one its
    own way."""
    with modes_kept(net):
        net.eval()
        try:
            with torch.no_grad(), torch.autocast(device_type(tensors(x)), enabled=False):
                return net(*as_args(x))
        finally:
            _compat.functional.reset_net(net)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _probe(x):
    """The first ``PROBE`` samples of a time-first batch ``(T, N, ...)``, or ``x`` itself. Of a tuple of
    inputs, the first a batch: that batch's samples of every tensor with N on dim 1 (others, e.g. a
    gain, as they are; a network that then fails is checked on the whole batch)."""
    if isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor) and _probe(x[0]) is not x[0]:
        n = x[0].shape[1]
        return tuple(_probe(a) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == n else a
                     for a in x)
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] > PROBE:
        return x[:, :PROBE]
    return x


def _is_applied(plan, layout: str, methods: dict[str, str], layouts) -> bool:
    """Whether a network in ``layout`` with these tunable layers' ``methods`` runs ``plan`` already."""
    try:
        return (plan is not None and plan["layout"] == layout and plan["layout"] in layouts
                and set(methods) <= set(plan["methods"])
                and all(methods.get(name) == method for name, method in plan["methods"].items() if method != "-"))
    except (KeyError, TypeError, AttributeError):  # a damaged plan: the checked path handles it
        return False


def _methods(net: nn.Module) -> dict[str, str]:
    return {name: m.method for name, m in net.named_modules() if is_tunable(m)}


def _report_plan(report: AutoselectReport, plan: dict) -> None:
    report.layout, report.methods = plan["layout"], dict(plan["methods"])
    report.totals = {k: float(v) for k, v in plan["totals"].items()}
    report.compiled = bool(plan.get("compiled", False))
    report.cache_hits = len(plan["methods"])


@dataclass
class _Selection:
    """One selection (on rank 0): the stored plan where it still reproduces the network's outputs, else
    every layer timed in each layout and the fastest configuration that reproduces them, applied."""

    net: nn.Module
    x: object
    m: int
    layouts: tuple
    cache: TimingCache
    measure_fn: Callable
    progress: Optional[bool]
    compile_backend: Optional[str] = None
    fallback: Optional[str] = None
    report: AutoselectReport = field(default_factory=AutoselectReport)
    key: Optional[str] = None  # of the whole network's plan
    digest: Optional[str] = None  # of the network's parameters and buffers
    reference: object = None  # the network's outputs on the example input
    snap: Optional[tuple] = None  # its buffers and gradients, restored after every timing

    def run(self) -> AutoselectReport:
        start_layout, start_methods = current_layout(self.net), _methods(self.net)
        try:
            # Key and reference outputs come from the time-first form, so that a network an earlier call
            # already converted finds its plan as well. The first forward materialises lazy parameters.
            _convert(self.net, "time_first")
            if not (self._plan_applied_unchecked(start_layout, start_methods) or self._plan_applied_checked()):
                self.snap = _state_snapshot(self.net)
                plans = {layout: plan for layout in self.layouts if (plan := self._time_layout(layout)) is not None}
                chosen = self._choose(plans)
                self.cache.save()  # (the timings, and the plan chosen)
                if not chosen:  # none reproduces the outputs: the network as it came
                    _apply(self.net, start_layout, start_methods, self.fallback, self.x)
            return self.report
        except BaseException:
            _apply(self.net, start_layout, start_methods, self.fallback, self.x)
            if self.snap is not None:
                _restore(self.net, self.snap)
            raise

    def _key(self) -> str:
        suffix = f"+compile:{self.compile_backend}" if self.compile_backend else ""
        return net_key(self.net, self.x, self.layouts, self.fallback) + suffix

    def _plan_applied_unchecked(self, start_layout: str, start_methods: dict[str, str]) -> bool:
        """Apply the stored plan without a forward pass: where the network runs it already (it was checked
        when applied), or where it was checked on this very state. Not for lazy parameters, materialised by
        the first forward."""
        if any(map(nn.parameter.is_lazy, self.net.parameters())):
            return False
        self.key = self._key()
        plan = self.cache.get_plan(self.key)
        if not _is_applied(plan, start_layout, start_methods, self.layouts):
            self.digest = state_digest(self.net)  # (not needed, and not computed, for a plan applied already)
            if not checked_on(plan, self.digest, self.layouts):
                return False
        return self._apply_stored(plan, [(None, None)])

    def _plan_applied_checked(self) -> bool:
        """Apply the stored plan if it reproduces the outputs (see :meth:`_apply_stored`), and record this
        state as checked; else keep the reference outputs, for the configurations timed next."""
        probe = _probe(self.x)
        try:
            probe_reference = _outputs(self.net, probe)
        except Exception:  # noqa: BLE001  (the network needs its whole batch: check on that)
            probe = self.x
            probe_reference = _outputs(self.net, probe)
        if self.key is None:  # lazy parameters, materialised by the forward above
            self.key, self.digest = self._key(), state_digest(self.net)
        plan = self.cache.get_plan(self.key)
        checks = [(probe, probe_reference)] + ([] if probe is self.x else [(self.x, None)])
        if self._apply_stored(plan, checks):
            if self.digest is not None:  # checked on this state now: the next copy in it needs no check
                self.cache.put_plan(self.key, with_check(plan, self.digest))
                self.cache.save()
            return True
        self.reference = probe_reference if probe is self.x else _outputs(self.net, self.x)
        return False

    def _apply_stored(self, plan, checks: list[tuple]) -> bool:
        """Apply a whole-network choice from the cache if it still reproduces the outputs.

        A plan is stored only after it reproduced the outputs on the whole example batch, under a key of
        the network, the input shapes, the device and the library versions. Here it is checked again, in
        order, on each ``(input, reference outputs)`` of ``checks`` until one agrees: a few samples (the
        probe), then the whole batch, whose reference None is computed only if the probe disagrees (a
        spike near its threshold may flip); a plan that fails every check, or no longer applies, is dropped
        and the network measured again. ``[(None, None)]``: the plan was checked on this network's state
        already (see :func:`~spikingjelly_mfpsn.timing_cache.checked_on`), or the network runs it already;
        it is applied if it still applies, without running the network.
        """
        if plan is None or plan["layout"] not in self.layouts:
            return False
        before = _methods(self.net)
        for x, reference in checks:
            try:
                if x is not None and reference is None:
                    reference = _outputs(self.net, x)
                _apply(self.net, plan["layout"], plan["methods"], self.fallback, self.x)
                ok = x is None or agree(_outputs(self.net, x), reference)
                if ok:
                    _report_plan(self.report, plan)
            except Exception:  # noqa: BLE001  (a stale or damaged plan: measure again)
                ok = None
            if ok:
                self._compile_as_planned()
                return True
            _apply(self.net, "time_first", before)  # back to the configuration the references come from
            if ok is None:
                return False
        return False

    def _compile_as_planned(self) -> None:
        """Compile a network a stored plan was just applied to, if that plan ran compiled."""
        if self.compile_backend and self.report.compiled:
            _compile(self.net, self.compile_backend)
            self.report.compile_backend = self.compile_backend

    def _skip(self, what: str, entry: str) -> None:
        """Warn that ``what`` is skipped, and list ``entry`` in the report's ``skipped``."""
        warnings.warn(f"autoselect: {what}; skipped")
        self.report.skipped.append(entry)

    def _time_layout(self, layout: str) -> Optional[dict[str, str]]:
        """Time every layer in ``layout``: each layer's fastest method; None where the network cannot run
        in that layout."""
        try:
            _convert(self.net, layout, self.fallback, self.x)
        except (TypeError, ValueError, NotImplementedError) as e:
            return self._skip(f"the network cannot run in layout {layout!r} ({e})", f"layout {layout}: {e}")
        mods = layers(self.net)
        try:
            inputs = capture_inputs(self.net, self.x, mods)
        except Exception as e:  # noqa: BLE001  (e.g. a second input the boundary leaves time-first)
            error = f"{type(e).__name__}: {e}"
            return self._skip(f"the network does not run in layout {layout!r} ({error})", f"layout {layout}: {error}")
        finally:
            _restore(self.net, self.snap)
        if self.progress is not False:
            from tqdm import tqdm  # (disable=None: no bar where stderr is not a terminal)
            mods = tqdm(mods, desc=f"autoselect {layout}", leave=False,
                        disable=None if self.progress is None else False)
        rows, plan = [], {}
        for name, mod in mods:
            if name not in inputs:  # never ran on this input
                continue
            times, hit = self._layer_times(layout, name, mod, inputs[name])
            plan[name] = choice = min(times, key=times.get)
            if math.isinf(times[choice]):
                if is_tunable(mod):
                    raise RuntimeError(f"no candidate of layer {name!r} could run in layout {layout!r}: "
                                       f"{self.report.skipped[-len(times):]}")
                warnings.warn(f"autoselect: layer {name!r} ({type(mod).__name__}) cannot be timed on its own in "
                              f"layout {layout!r} (see the report's skipped); its time is left out of the total")
            rows.append(LayerResult(name, type(mod).__name__, times, choice, hit))
        self.report.layouts[layout] = rows
        self.report.totals[layout] = sum(r.times[r.choice] for r in rows if not math.isinf(r.times[r.choice]))
        return plan

    def _layer_times(self, layout: str, name: str, mod: nn.Module,
                     inputs: tuple[tuple, dict]) -> tuple[dict[str, float], bool]:
        """Every candidate's seconds for one layer, and whether they came from the cache."""
        key = layer_key(mod, layout, inputs[0] + tuple(inputs[1].values()))
        times = self.cache.get(key)
        if times is not None and set(times) == set(candidates(mod)):
            self.report.cache_hits += 1
            return times, True
        times = time_candidates(mod, inputs, self.m, self.measure_fn, self.report.skipped, f"{layout}/{name}")
        if any(math.isfinite(t) for t in times.values()):  # (one that cannot be timed is tried again next time)
            self.cache.put(key, times)
        self.report.timed += 1
        _restore(self.net, self.snap)  # timing ran forward/backward in training mode
        return times, False

    def _choose(self, plans: dict[str, dict[str, str]]) -> bool:
        """Apply and store the fastest layout's plan that reproduces the outputs; False if none does."""
        for layout in sorted(plans, key=self.report.totals.get):  # fastest first
            _apply(self.net, layout, plans[layout], self.fallback, self.x)
            out = _outputs(self.net, self.x)
            _restore(self.net, self.snap)
            if agree(out, self.reference):
                self.report.layout, self.report.methods = layout, plans[layout]
                if self.compile_backend:
                    self._time_compiled()
                plan = {"layout": layout, "methods": plans[layout], "totals": self.report.totals,
                        "compiled": self.report.compiled}
                self.cache.put_plan(self.key, with_check(plan, self.digest))
                return True
            msg = f"{layout} configuration {plans[layout]} does not reproduce the network's outputs"
            self._skip(msg, msg)
        return False

    def _time_compiled(self) -> None:
        """Time a whole training step eager and compiled; keep ``torch.compile`` if faster and correct.

        The compiled step is timed after its first run (the compilation itself is not counted)."""
        net, backend, report = self.net, self.compile_backend, self.report

        def step_time():  # fed data, no input gradient: the very graph training will run
            return timed(self.measure_fn, net, as_args(self.x), self.m, input_grad=False)

        eager = step_time()
        _restore(net, self.snap)
        _compile(net, backend)
        try:
            compiled = step_time()
            _restore(net, self.snap)
            ok = agree(_outputs(net, self.x), self.reference)
        except Exception as e:  # noqa: BLE001  (a backend that cannot compile this net: stay eager)
            compiled, ok = math.inf, False
            report.skipped.append(f"torch.compile({backend}): {type(e).__name__}: {e}")
        _restore(net, self.snap)
        report.compile_times = {"eager": eager, "compiled": compiled}
        report.compile_backend = backend
        report.compiled = ok and compiled < eager
        if not report.compiled:
            _uncompile(net)


def _compile(net: nn.Module, backend: str) -> None:
    """``torch.compile`` the whole network's call in place, as one frame dynamo traces (a network
    compiled already is left as it is); :func:`_uncompile` undoes it.

    A workaround for pytorch/pytorch#150915: ``nn.Module.compile`` compiles ``net._call_impl``, and when
    ``net``'s forward lives in ``torch.nn`` (``nn.Sequential``, the usual container) dynamo skips that
    frame. It then compiles each SpikingJelly layer's forward as a frame of its own (and runs torch.nn's
    layers eager), so every neuron shares the code of ``MemoryModule.forward`` and its cache of 8
    compiled versions: neurons past the 8th distinct (dilation, shape, training, grad mode) run eager.
    A wrapper outside ``torch.nn`` is traced instead, with the whole network inlined; it gets a
    code object of its own so that each network has its own compile cache. tests/test_compile.py
    tells when upstream fixes the bug (then ``net.compile(backend=backend)`` would do).
    """
    if getattr(net, "_compiled_call_impl", None) is not None:
        return
    call_impl = net._call_impl

    def call(*args, **kwargs):
        return call_impl(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a new code object: dynamo caches per code object
    compiled = torch.compile(call, backend=backend)
    compiled.autoselect_compiled = True  # (told apart from the user's own net.compile())
    net._compiled_call_impl = compiled


def _uncompile(net: nn.Module) -> Optional[Callable]:
    """``net`` eager again; returns the compiled call the user gave it (``net.compile()``), to put back
    where autoselect does not compile it itself, or None."""
    call = getattr(net, "_compiled_call_impl", None)
    net._compiled_call_impl = None
    return None if getattr(call, "autoselect_compiled", False) else call


def _apply(net: nn.Module, layout: str, plan: dict[str, str], fallback: Optional[str] = None, x=None) -> None:
    _convert(net, layout, fallback, x)
    named = dict(net.named_modules())
    for name, method in plan.items():
        if is_tunable(named[name]):
            named[name].method = method  # the setter rejects a method the layer does not have
        elif method != "-":
            raise ValueError(f"layer {name!r} has no choice of method, got {method!r}")


@contextlib.contextmanager
def _eager_meanwhile(net: nn.Module):
    """``net`` eager inside (every configuration is timed eager first); a compiled call of the user's own
    (``net.compile()``) is put back on leaving, unless autoselect compiled the network itself."""
    own = _uncompile(net)  # (or one a previous pass compiled, which is not put back)
    try:
        yield
    finally:
        if own is not None and getattr(net, "_compiled_call_impl", None) is None:
            net._compiled_call_impl = own


def _on_every_rank(net: nn.Module, report: Optional[AutoselectReport], selects: bool, fallback, x_example):
    """Rank 0's report on every rank (under ``torch.distributed``), its choice applied there too."""
    if _distributed():
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    report.forward_only = not torch.is_grad_enabled()
    if not selects and any(map(nn.parameter.is_lazy, net.parameters())):
        with _rng_kept(net, x_example):  # (rank 0's first forward built its lazy neurons: build them here too)
            _outputs(net, _probe(x_example))
    if report.layout is not None:
        if not selects:  # (the selection applied its choice on this rank already)
            _apply(net, report.layout, report.methods, fallback, x_example)
        if report.compiled:  # (compiled already on rank 0)
            _compile(net, report.compile_backend)
    return report


def _check_options(m: int, layouts: Sequence[str], fallback: Optional[str], compile: Union[bool, str],
                   cache, progress=None, verbose=False) -> None:
    if not (progress is None or isinstance(progress, bool)) or not isinstance(verbose, bool):
        raise TypeError(f"progress must be None, True or False and verbose True or False, got {progress!r} and "
                        f"{verbose!r}")
    if not isinstance(cache, (bool, str, os.PathLike)):
        raise TypeError(f"cache must be True, False or a path, got {type(cache).__name__}")
    if not isinstance(cache, bool) and (not os.fspath(cache) or "\0" in os.fspath(cache)):
        raise ValueError(f"cache must be True, False or a path, got {cache!r}")
    if cache is not False:
        lock_timeout()  # (a bad $SPIKINGJELLY_MFPSN_LOCK_TIMEOUT: refused before the timing, not after it)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an int >= 1, got {m!r}")
    if not isinstance(layouts, (tuple, list)):
        raise ValueError(f"layouts must be a tuple or list of layouts, e.g. ('time_first',), got {layouts!r}")
    if not (isinstance(compile, bool) or callable(compile) or compile in torch.compiler.list_backends(exclude_tags=())):
        raise ValueError(f"compile must be True, False or a torch.compile backend (a callable, or one of "
                         f"{', '.join(torch.compiler.list_backends())}), got {compile!r}")
    for layout in layouts:
        ops.check_layout(layout)
    if not layouts:
        raise ValueError("layouts must name at least one layout")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")


def _check_args(net: nn.Module, x_example) -> None:
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if isinstance(net, (nn.parallel.DistributedDataParallel, nn.DataParallel)):  # (its forward and backward
        # run collectives, which rank 0's timing alone would leave the other ranks waiting for)
        raise ValueError(f"net is wrapped in {type(net).__name__}: call autoselect on every rank with the model "
                         f"before wrapping it (or with {type(net).__name__.lower()}.module)")
    # autoselect feeds net time-first inputs: a network converted with to_time_last(net, boundary=False)
    # takes (N, ..., T) instead, which the layout conversions cannot tell.
    inner = next((name for name, m in net.named_modules() if isinstance(m, TIME_LAST_TYPES)
                  or getattr(m, "layout", None) == "time_last"), None)
    if inner is not None and not has_time_last_boundary(net):
        raise ValueError(f"net runs time-last without the boundary that takes time-first inputs (module "
                         f"{inner or '(the network itself)'!r}; e.g. to_time_last(net, boundary=False)): "
                         f"autoselect takes a network fed (T, N, ...), so call to_time_first(net) first, "
                         f"or convert it with the boundary")
    for t in tensors(x_example):
        if t.device.type == "meta":
            raise ValueError("x_example is on the meta device: autoselect times real runs, so give it a batch "
                             "on the device the network will train on")
        if not t.numel():
            raise ValueError(f"x_example has an empty tensor (shape {tuple(t.shape)}): autoselect times the "
                             f"shapes training runs, so give it a batch of real samples and steps")


def _prebuild(x_example) -> None:
    """Build the C++ kernels for a CPU input (20-60 s, once) before autoselect's clock starts."""
    if "cpp" in ops.names() and device_type(tensors(x_example)) == "cpu":
        try:
            ops.cpp_ops.load()
        except ops.cpp_ops.BuildError:
            pass  # timing skips the 'cpp' candidates that cannot run


def autoselect(net: nn.Module, x_example, m: int = 2, layouts: Sequence[str] = ("time_first", "time_last"),
               cache=True, measure_fn: Optional[Callable] = None, progress: Optional[bool] = None,
               verbose: bool = False, compile: Union[bool, str] = False,
               fallback: Optional[str] = None) -> AutoselectReport:
    """Benchmark every layer's implementations in each layout and apply the fastest, in place.

    Args:
        net: a multi-step SpikingJelly network (time-first input ``(T, N, ...)``)
        x_example: an input of the real shape (and dtype/device) the network will train on; a
            tuple holds the positional inputs of a network of several (called as ``net(*x_example)``)
        m: each candidate runs a warm-up and ``2m`` timed runs; the mean of the last ``m`` counts
        layouts: layouts to consider
        cache: ``True`` (the default file, ``$SPIKINGJELLY_MFPSN_CACHE`` or
            ``~/.cache/spikingjelly_mfpsn/autoselect.json``), a path, or ``False``
        measure_fn: ``(module, args, m) -> seconds``; replaces the timer (for tests)
        progress: a progress bar on stderr: ``None`` (the default) where stderr is a terminal (so a
            log file gets none), ``True`` always, ``False`` never
        verbose: print the report when done
        compile: also time one whole training step of the chosen configuration under
            ``torch.compile`` (``True``: inductor, or a backend name) and keep it, compiled in place as
            one graph, when it is faster and reproduces the outputs. The first compilation
            takes tens of seconds on a CPU (then it is cached on disk by PyTorch); it is not counted.
        fallback: passed to :func:`~spikingjelly_mfpsn.convert.to_time_last`: ``'time_first'`` lets
            the time-last layout run modules without a time-last version (e.g. a remaining LIF neuron)
            time-first inside it, so that layout is timed too; ``None`` (default): such a network is
            timed time-first only
    Returns:
        an :class:`AutoselectReport`; ``print`` it for a table

    Called with gradients disabled (``torch.no_grad()`` or ``torch.inference_mode()``, usually on a
    network in eval mode), it times forward passes only and caches those timings and that plan apart
    from training's: the choice for an inference loop.

    Under ``torch.distributed``, rank 0 measures and decides, and every rank applies the same choice.
    """
    _check_options(m, layouts, fallback, compile, cache, progress, verbose)
    _check_args(net, x_example)
    backend = ("inductor" if compile is True else compile) or None
    _prebuild(x_example)
    t0 = time.perf_counter()
    path = default_cache_path() if cache is True else (cache or None)
    selects = not _distributed() or dist.get_rank() == 0
    with _eager_meanwhile(net):
        with _rng_kept(net, x_example):
            report = _Selection(net, x_example, m, tuple(layouts), TimingCache(path), measure_fn or measure,
                                progress, backend, fallback).run() if selects else None
        report = _on_every_rank(net, report, selects, fallback, x_example)
    _compat.invalidate_reset_cache(net)
    report.seconds = time.perf_counter() - t0
    if verbose:
        print(report)
    return report
