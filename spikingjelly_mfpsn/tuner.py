"""Autoselect (paper Algorithm 1): time every implementation of every layer on the user's real shapes,
in each layout, and apply the fastest configuration.

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
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import filelock
import torch
import torch.nn as nn

from . import _compat, ops
from ._util import as_args, device_type, run_hooked, sync, tensors

CACHE_SCHEMA = 1
# A candidate whose timed runs all took more than this many times the best time so far is no longer
# timed (at least one timed run each: the first run may pay one-off costs).
ABANDON = 2.0
CACHE_ENV = "SPIKINGJELLY_MFPSN_CACHE"
# Samples of the example batch on which a cached plan is checked again before it is applied.
PROBE = 2
# Network states (digests) a stored plan keeps as checked.
CHECKED_STATES = 8
# Entries the cache file keeps, the most recently written (older ones are timed again when needed):
# every library upgrade or new shape adds keys, and the whole file is read by every call.
MAX_LAYER_ENTRIES = 1024
MAX_PLANS = 128
# Seconds a save waits for the cache's lock (held by another process, perhaps a stuck one) before it
# gives up, with a warning: the choice is applied, only not cached. $SPIKINGJELLY_MFPSN_LOCK_TIMEOUT sets it.
LOCK_TIMEOUT = 10.0
LOCK_TIMEOUT_ENV = "SPIKINGJELLY_MFPSN_LOCK_TIMEOUT"


# ------------------------------------------------------------------------------------------ layers
def is_tunable(m: nn.Module) -> bool:
    """A layer with a choice of implementations: a settable ``method`` and ``supported_methods``."""
    return hasattr(m, "supported_methods") and hasattr(m, "method")


def layers(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers autoselect times: tunable modules and stateful modules (neurons), not descended
    into, and every other leaf module."""
    out, skip = [], []
    for name, m in net.named_modules():
        if m is net or any(name.startswith(p + ".") for p in skip):
            continue
        if is_tunable(m) or isinstance(m, _compat.MemoryModule):
            out.append((name, m))
            skip.append(name)
        elif not m._modules:
            out.append((name, m))
    return out


def candidates(m: nn.Module) -> list[str]:
    if not is_tunable(m):
        return ["-"]
    return list(getattr(m, "candidate_methods", None) or m.supported_methods)


def _ordered(m: nn.Module, args: tuple) -> list[str]:
    """Candidates, the likely fastest first: a good first time lets slow ones be abandoned early.

    First the fused kernels of a non-torch backend (on the CPU 'cpp', fastest in nearly every
    configuration of the speed suite), then the layer's own default, then the rest."""
    cands = candidates(m)
    resolve = getattr(m, "resolve_method", None)
    if resolve is not None and args and isinstance(args[0], torch.Tensor):
        with contextlib.suppress(Exception):
            with _method(m, "auto"):
                first = resolve(args[0])
            if first in cands:
                cands.remove(first)
                cands.insert(0, first)
    if is_tunable(m) and getattr(m, "candidate_methods", None):
        fused = [c for c in cands if c in ops.names() and ops.get(c).backend != "torch"]
        cands = fused + [c for c in cands if c not in fused]
    return cands


@contextlib.contextmanager
def _method(m: nn.Module, method: str, backend: Optional[str] = None):
    """Run with ``m.method = method`` (after ``m.backend = backend`` if given), then restore both.
    A method of another backend switches a neuron's backend, so the backend is always restored."""
    if method == "-":
        yield
        return
    old, old_backend = m.method, getattr(m, "backend", None)
    if backend is not None and old_backend is not None:
        m.backend = backend
    m.method = method
    try:
        yield
    finally:
        if old_backend is not None and m.backend != old_backend:
            m.backend = old_backend
        m.method = old


def _clone_args(args, grad: bool = True):
    return tuple(a.detach().clone().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor)
                 else a for a in args)


def _capture_inputs(net: nn.Module, x, mods: list[tuple[str, nn.Module]]) -> dict[str, tuple]:
    seen: dict[str, tuple] = {}
    hooks = []
    for name, m in mods:
        def hook(mod, args, name=name):
            if name not in seen:
                seen[name] = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        hooks.append(m.register_forward_pre_hook(hook, prepend=True))  # before a fallback island's own
    run_hooked(net, x, hooks)
    return seen


class _SeedGradient(torch.autograd.Function):
    """``_SeedGradient.apply(out, grad).backward()`` runs the backward of ``out.backward(grad)``.

    A scalar backward skips torch's check of an explicit gradient, whose first call in a process
    imports sympy (about half a second that a training loop, backward from a scalar loss, never pays)."""

    @staticmethod
    def forward(ctx, out, grad):
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.grad, None


def measure(module: nn.Module, args: tuple, m: int, timer: Callable[[], float] = time.perf_counter,
            abandon_above: float = math.inf, input_grad: bool = True) -> float:
    """Mean forward + backward time (seconds) of ``module(*args)`` over the last ``m`` of ``2m`` timed runs,
    after a warm-up run (which may pay one-off costs, and is never timed).

    The backward gets a gradient of ones of the output's shape (of each tensor of a structured output:
    tuples, lists, dicts; made once, outside the timed region; no
    kernel's work depends on the gradient's values, and drawing random ones took 0.9 ms per call for a
    digits-sized layer, 7 % of a cold autoselect).
    Once every timed run so far was slower than ``abandon_above``, the measurement ends early and returns
    the fastest of them: the candidate is already known to lose. A single slow run (noise only ever slows
    a run down) does not end it, except the first. A run whose forward alone settles that skips its
    backward, and counts with its forward time (so an abandoned candidate's time is a lower bound). A
    warm-up whose forward alone is slower than ``abandon_above`` skips its backward too: the next forward,
    free of one-off costs, either loses as well (the candidate is abandoned after two forwards) or warms
    up the backward.
    ``input_grad``: the inputs require grad (a layer inside a network); ``False`` for a whole
    network fed data. With gradients disabled (``torch.no_grad()``, ``torch.inference_mode()``), the
    forward alone is timed: what an inference loop runs.
    """
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    backward = torch.is_grad_enabled()
    times, z, warm, slow_warmups = [], None, False, 0
    while len(times) < 2 * m:
        inputs = _clone_args(args, input_grad and backward)
        _compat.functional.reset_net(module)
        t0 = timer()
        out = module(*inputs)
        sync(device)
        t1 = timer()
        elapsed = t1 - t0
        if warm:
            lost = min(times + [elapsed]) > abandon_above  # lost, whatever its backward takes
        else:
            lost = elapsed > abandon_above
            slow_warmups += lost
            if slow_warmups == 2:  # a second forward, without one-off costs, lost as well
                break
        outs = [t for t in tensors(out) if t.requires_grad]
        if not lost and backward and outs:
            if z is None or [t.shape for t in z] != [t.shape for t in outs]:
                z = [torch.ones_like(t) for t in outs]
            seed = sum(_SeedGradient.apply(t, g) for t, g in zip(outs, z))
            t2 = timer()
            seed.backward()
            sync(device)
            elapsed += timer() - t2
        if not warm:
            warm = not lost or not backward  # (without gradients, a forward is the whole run)
            continue
        times.append(elapsed)
        if min(times) > abandon_above:
            break
    _compat.functional.reset_net(module)
    if len(times) < 2 * m:  # abandoned
        return min(times) if times else elapsed
    return sum(times[-m:]) / m


# ------------------------------------------------------------------------------------------ cache
def _versions() -> dict[str, str]:
    from . import __version__
    v = {"torch": torch.__version__, "spikingjelly_mfpsn": __version__, "spikingjelly": str(_compat.SJ_VERSION)}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001  (triton absent or broken: not part of the key)
        v["triton"] = "none"
    return v


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}threads"


def _run_mode(tensors) -> dict:
    """What a key adds for a call that runs differently from plain training: with gradients disabled
    (forward-only timings and plans, for inference) or under autocast (its dtype); nothing otherwise,
    so earlier training keys stay valid."""
    mode = {} if torch.is_grad_enabled() else {"forward_only": True}
    kind = device_type(tensors)
    if torch.is_autocast_enabled(kind):
        mode["autocast"] = str(torch.get_autocast_dtype(kind))
    return mode


def layer_key(module: nn.Module, layout: str, args: tuple) -> str:
    """Cache key of one layer's timings."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    sig = {
        "type": f"{type(module).__module__}.{type(module).__qualname__}",
        "repr": module.extra_repr() if not is_tunable(module) else _repr_without_method(module),
        "params": [list(p.shape) for p in module.parameters()],
        "training": module.training,
        "layout": layout,
        "inputs": [[list(t.shape), str(t.dtype)] for t in tensors],
        "device": _device_name(tensors[0].device) if tensors else "none",
        "candidates": candidates(module),
        "versions": _versions(),
        **_run_mode(tensors),
    }
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()


def net_key(net: nn.Module, x, layouts, fallback: Optional[str] = None) -> str:
    """Cache key of a whole network's choice: every module's signature, the input, the device, the
    layouts considered (and the time-last conversion's fallback), the registered implementations and
    the library versions."""
    ts = tensors(x)
    mods = [[name, f"{type(m).__module__}.{type(m).__qualname__}",
             _repr_without_method(m) if is_tunable(m) else m.extra_repr(),
             [list(p.shape) for p in m.parameters(recurse=False)], m.training]
            for name, m in net.named_modules()]
    sig = {"modules": mods, "inputs": [[list(t.shape), str(t.dtype)] for t in ts],
           "device": _device_name(ts[0].device) if ts else "none", "layouts": list(layouts),
           "implementations": sorted(ops.names()), "versions": _versions(), **_run_mode(ts),
           **({"fallback": fallback} if fallback else {})}
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()


def state_digest(net: nn.Module) -> Optional[str]:
    """SHA-256 of every parameter and buffer of ``net``: names, shapes, dtypes and bytes; None when one
    is not on the CPU (hashing would copy it there)."""
    named = list(itertools.chain(net.named_parameters(), net.named_buffers()))
    if any(t.device.type != "cpu" for _, t in named):
        return None
    h = hashlib.sha256("".join(f"{name}:{tuple(t.shape)}:{t.dtype};" for name, t in named).encode())
    try:  # every tensor's bytes in order, read in place (no copy of the model)
        for _, t in named:
            h.update(t.detach().reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError):  # e.g. a tensor with a lazy conjugate: no digest, the checked path
        return None
    return h.hexdigest()


def _check_id(digest: Optional[str], plan: dict) -> Optional[str]:
    """What a plan records once it reproduced the outputs of a network in state ``digest``: the state
    and the plan's own choice together (an edited plan matches no record)."""
    if digest is None:
        return None
    return hashlib.sha256(json.dumps({"state": digest, "layout": plan["layout"], "methods": plan["methods"]},
                                     sort_keys=True).encode()).hexdigest()


def _checked_on(plan, digest: Optional[str], layouts) -> bool:
    """Whether ``plan`` was checked on a network in state ``digest`` (so it needs no check again)."""
    try:
        return (digest is not None and plan["layout"] in layouts and isinstance(plan.get("checked"), list)
                and _check_id(digest, plan) in plan["checked"])
    except (KeyError, TypeError, AttributeError, ValueError):  # a damaged plan: the checked path handles it
        return False


def _with_check(plan: dict, digest: Optional[str]) -> dict:
    """``plan`` recording that it reproduced the outputs of a network in state ``digest`` (the last
    ``CHECKED_STATES`` such states are kept; a None digest records nothing)."""
    check = _check_id(digest, plan)
    if check is None:
        return plan
    old = plan.get("checked")
    kept = [c for c in old if isinstance(c, str) and c != check] if isinstance(old, list) else []
    return {**plan, "checked": (kept + [check])[-CHECKED_STATES:]}


_CHOICE = re.compile(r"""(, )?\b(method|backend)=('[^']*'|"[^"]*")""")


def _repr_without_method(module: nn.Module) -> str:
    """The layer's description without its current choice (method, and backend where it has one:
    autoselect's candidates span every backend, so a key must not change once one is chosen). Cut
    from the description, not set: a network saved where another backend ran may hold a method that
    cannot be set here."""
    return _CHOICE.sub("", module.extra_repr())


def default_cache_path() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "spikingjelly_mfpsn", "autoselect.json")


class TimingCache:
    """A JSON file of per-layer timings. A corrupted or foreign file is rebuilt, and every entry is
    checked against the schema of what this code writes (see :func:`_valid_layer`, :func:`_valid_plan`):
    anything else is dropped with a warning and measured again, never trusted. A path that is not a
    regular file (a directory, a FIFO, a device) is never opened: a warning, and no cache. Writes go to a
    temporary file renamed over the old one (never torn) under a lock (no lost updates between
    concurrent writers), waited for at most ``LOCK_TIMEOUT`` seconds. It keeps the
    ``MAX_LAYER_ENTRIES`` layer timings and the ``MAX_PLANS`` plans written last."""

    def __init__(self, path: Optional[str]):
        self.path = path
        what = _not_a_regular_file(path) if path else ""
        if what:
            warnings.warn(f"autoselect cache {path} is {what}, not a file: running without the cache "
                          f"(cache='path' picks another file)")
            self.path = None
        self.entries, self.plans = self._read() if self.path else ({}, {})
        self.put_keys: set[str] = set()  # what this object put: saved over the file's, as its newest
        self.put_plan_keys: set[str] = set()

    def _read(self) -> tuple[dict, dict]:
        try:  # (non-blocking: should the path have become a FIFO since it was checked)
            with os.fdopen(os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return {}, {}
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError, JSONDecodeError; nested too deep)
            warnings.warn(f"autoselect cache {self.path} is unreadable ({type(e).__name__}); it will be rebuilt")
            return {}, {}
        except OSError as e:  # e.g. no permission, or a file where its directory should be
            warnings.warn(f"autoselect cache {self.path} cannot be read ({e}); starting from an empty cache")
            return {}, {}
        if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA or not isinstance(data.get("layers"), dict):
            warnings.warn(f"autoselect cache {self.path} has an unknown format; it will be rebuilt")
            return {}, {}
        raw_plans = data.get("plans", {})
        layers_ = {k: v for k, v in data["layers"].items() if _valid_layer(v)}
        plans = {k: v for k, v in raw_plans.items() if _valid_plan(v)} if isinstance(raw_plans, dict) else {}
        dropped = (len(data["layers"]) - len(layers_)
                   + (len(raw_plans) - len(plans) if isinstance(raw_plans, (dict, list)) else 1))
        if dropped:
            warnings.warn(f"autoselect cache {self.path} holds {dropped} entries that are not what autoselect "
                          f"writes; they are dropped and measured again")
        return layers_, plans

    def get(self, key: str) -> Optional[dict[str, float]]:
        return self.entries.get(key)

    def put(self, key: str, times: dict[str, float]) -> None:
        self.entries.pop(key, None)  # (re)written: the newest
        self.entries[key] = dict(times)
        self.put_keys.add(key)

    def get_plan(self, key: str) -> Optional[dict]:
        return self.plans.get(key)

    def put_plan(self, key: str, plan: dict) -> None:
        self.plans.pop(key, None)
        self.plans[key] = plan
        self.put_plan_keys.add(key)

    def save(self) -> None:
        """Write the entries (merged with what the file holds now); where the file cannot be written
        (e.g. a read-only directory), warn and go on: the choice is applied, only not kept."""
        if not self.path:
            return
        try:
            self._save()
        except OSError as e:
            warnings.warn(f"autoselect cache {self.path} cannot be written ({e}); the choice is applied but "
                          f"not cached (cache=False stops this warning, cache='path' picks another file)")

    def _save(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        timeout = lock_timeout()
        lock = filelock.FileLock(self.path + ".lock", timeout=timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            warnings.warn(f"autoselect cache {self.path}: its lock ({self.path}.lock) was held by another process "
                          f"for {timeout:g} s; the choice is applied but not cached (${LOCK_TIMEOUT_ENV} sets "
                          f"the wait)")
            return
        try:
            self._write_merged(directory)
        finally:
            lock.release()

    def _write_merged(self, directory: str) -> None:
        """Write what the file holds now with this object's entries over it (under the lock)."""
        merged, plans = self._read_quietly()
        merged = _newest(merged, self.entries, self.put_keys, MAX_LAYER_ENTRIES)
        plans = _newest(plans, self.plans, self.put_plan_keys, MAX_PLANS)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autoselect-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:  # dumps: one C-encoded string (dump encodes in Python)
                f.write(json.dumps({"schema": CACHE_SCHEMA, "layers": merged, "plans": plans}))
            # Not fsynced (0.2-0.4 ms a save here): the rename keeps readers from a torn file, and a file
            # a system crash leaves empty only makes the next call rebuild the cache, as it does any
            # unreadable one (it holds timings and choices, nothing that cannot be measured again).
            os.replace(tmp, self.path)
            self.put_keys, self.put_plan_keys = set(), set()  # on the file now, as its newest
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read_quietly(self) -> tuple[dict, dict]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._read()


def _newest(on_file: dict, mine: dict, written: set, cap: int) -> dict:
    """What the file keeps: its entries, then those this object wrote (moved last, as the newest), cut to
    the ``cap`` last."""
    kept = {k: v for k, v in on_file.items() if k not in written}
    kept.update((k, mine[k]) for k in mine if k in written)
    return dict(itertools.islice(kept.items(), max(0, len(kept) - cap), None))


def lock_timeout() -> float:
    """Seconds a save waits for the cache's lock: ``$SPIKINGJELLY_MFPSN_LOCK_TIMEOUT`` or ``LOCK_TIMEOUT``."""
    value = os.environ.get(LOCK_TIMEOUT_ENV)
    try:
        return max(0.0, float(value)) if value else LOCK_TIMEOUT
    except ValueError:
        raise ValueError(f"${LOCK_TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None


def _not_a_regular_file(path: str) -> str:
    """What ``path`` is when it exists and is not a regular file (opening a FIFO would block), else ''."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing (created on save), or unreachable (reported when read)
        return ""
    if stat.S_ISREG(mode):
        return ""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def _is_time(v) -> bool:
    """A timing as autoselect writes it: seconds, a number >= 0 (inf: the candidate could not run)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0  # (False for NaN)


def _valid_layer(times) -> bool:
    """A layer entry: ``{method: seconds}``, at least one candidate that ran."""
    return (isinstance(times, dict) and bool(times) and all(isinstance(k, str) and _is_time(v) for k, v in times.items())
            and any(math.isfinite(v) for v in times.values()))


def _valid_plan(plan) -> bool:
    """A whole network's plan: its layout, ``{layer: method}``, ``{layout: seconds}``, whether it runs
    compiled and the states it was checked on, and nothing else."""
    def str_dict(d, value_ok):
        return isinstance(d, dict) and all(isinstance(k, str) and value_ok(v) for k, v in d.items())

    return (isinstance(plan, dict) and set(plan) <= {"layout", "methods", "totals", "compiled", "checked"}
            and plan.get("layout") in ops.LAYOUTS and str_dict(plan.get("methods"), lambda v: isinstance(v, str))
            and str_dict(plan.get("totals"), lambda v: _is_time(v) and math.isfinite(v))
            and isinstance(plan.get("compiled", False), bool)
            and isinstance(plan.get("checked", []), list) and all(isinstance(c, str) for c in plan.get("checked", [])))


# ------------------------------------------------------------------------------------------ report
@dataclass
class LayerResult:
    name: str
    kind: str
    times: dict[str, float]
    choice: str
    cached: bool = False


@dataclass
class AutoselectReport:
    """What autoselect measured and chose. ``print(report)`` shows a table."""

    layouts: dict[str, list[LayerResult]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    layout: Optional[str] = None
    methods: dict[str, str] = field(default_factory=dict)
    timed: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    compiled: bool = False
    compile_times: dict[str, float] = field(default_factory=dict)
    compile_backend: Optional[str] = None
    forward_only: bool = False

    def __str__(self) -> str:
        lines = [f"autoselect: layout {self.layout!r} "
                 f"({', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in self.totals.items())}); "
                 f"{self.timed} timed, {self.cache_hits} cached, {self.seconds:.2f} s"
                 + ("; forward passes only (gradients disabled)" if self.forward_only else "")]
        for layout, rows in self.layouts.items():
            lines.append(f"[{layout}]{' (chosen)' if layout == self.layout else ''}")
            lines.append(f"  {'layer':<28} {'type':<26} {'choice':<12} candidates (ms)")
            for r in rows:
                cands = ", ".join(f"{k}={v * 1e3:.3f}" for k, v in sorted(r.times.items(), key=lambda kv: kv[1]))
                lines.append(f"  {r.name:<28} {r.kind:<26} {r.choice:<12} {cands}{' [cache]' if r.cached else ''}")
        if self.compile_times:
            lines.append("whole network, " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.compile_times.items())
                         + f": {'compiled' if self.compiled else 'eager'} ({self.compile_backend})")
        for s in self.skipped:
            lines.append(f"skipped: {s}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def _convert(net: nn.Module, layout: str, fallback: Optional[str] = None) -> nn.Module:
    from .convert import current_layout, to_time_first, to_time_last
    if current_layout(net) == layout:
        return net
    out = to_time_last(net, fallback=fallback) if layout == "time_last" else to_time_first(net)
    if out is not net:
        raise RuntimeError("layout conversion must work in place")
    return net


def _state_snapshot(net: nn.Module):
    buffers = {k: v.detach().clone() for k, v in net.state_dict(keep_vars=True).items()
               if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}
    grads = {id(p): (p.grad.clone() if p.grad is not None else None) for p in net.parameters()}
    return buffers, grads


def _restore(net: nn.Module, snap) -> None:
    buffers, grads = snap
    with torch.no_grad():
        state = net.state_dict(keep_vars=True)
        for k, v in buffers.items():
            state[k].copy_(v)
    for p in net.parameters():
        p.grad = grads.get(id(p))
    _compat.functional.reset_net(net)


def _outputs(net: nn.Module, x) -> torch.Tensor:
    """Eval-mode outputs (deterministic: running statistics, no dropout), in full precision even
    under autocast: the check compares configurations, and reduced precision rounds each one its
    own way."""
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type(tensors(x)), enabled=False):
            return net(*as_args(x))
    finally:
        net.train(was_training)
        _compat.functional.reset_net(net)


def _agree(a, b, mismatch: float = 1e-3) -> bool:
    """Outputs agree up to float reordering: near-threshold spikes may flip in a tiny fraction. Outputs
    may be tensors or tuples, lists and dicts of them (other values must be equal)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return False
        close = torch.isclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)
        return bool((~close).float().mean() <= mismatch)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_agree(x, y, mismatch) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_agree(a[k], b[k], mismatch) for k in a)
    try:
        return not isinstance(b, torch.Tensor) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. arrays, whose == is element-wise
        return False


def _dist_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(obj):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def _select(net, x_example, m, layouts, cache: TimingCache, measure_fn, progress,
            compile_backend: Optional[str] = None, fallback: Optional[str] = None) -> AutoselectReport:
    report = AutoselectReport()
    start_layout = _layout_of(net)
    start_methods = {name: m.method for name, m in net.named_modules() if is_tunable(m)}
    snap = None
    try:
        # Key and reference outputs come from the time-first form, so that a network an earlier call
        # already converted finds its plan as well. The first forward materialises lazy parameters.
        _convert(net, "time_first")
        suffix = f"+compile:{compile_backend}" if compile_backend else ""
        whole_key = digest = None
        if not _has_lazy(net):
            whole_key = net_key(net, x_example, layouts, fallback) + suffix
            plan = cache.get_plan(whole_key)
            if _is_applied(plan, start_layout, start_methods, layouts):
                # This network already runs the stored plan (checked when it was applied): no forward.
                _apply(net, plan["layout"], plan["methods"], fallback)
                _report_plan(report, plan)
                _compile_as_planned(net, report, compile_backend)
                return report
            digest = state_digest(net)
            if _checked_on(plan, digest, layouts) and _apply_cached_plan(net, x_example, plan, layouts, None, None,
                                                                         report, compile_backend, fallback):
                return report  # checked on this very state before: no forward
        probe = _probe(x_example)
        try:
            probe_reference = _outputs(net, probe)
        except Exception:  # noqa: BLE001  (the network needs its whole batch: check on that)
            probe = x_example
            probe_reference = _outputs(net, probe)
        if whole_key is None:  # lazy parameters, materialised by the forward above
            whole_key = net_key(net, x_example, layouts, fallback) + suffix
            digest = state_digest(net)
        plan = cache.get_plan(whole_key)
        if _apply_cached_plan(net, x_example, plan, layouts, probe, probe_reference, report, compile_backend,
                              fallback):
            if digest is not None:  # checked on this state now: the next copy in it needs no check
                cache.put_plan(whole_key, _with_check(plan, digest))
                cache.save()
            return report
        reference = probe_reference if probe is x_example else _outputs(net, x_example)
        snap = _state_snapshot(net)
        plans = {}
        for layout in layouts:
            try:
                _convert(net, layout, fallback)
            except (TypeError, ValueError, NotImplementedError) as e:
                warnings.warn(f"autoselect: the network cannot run in layout {layout!r} ({e}); skipped")
                report.skipped.append(f"layout {layout}: {e}")
                continue
            mods = layers(net)
            try:
                inputs = _capture_inputs(net, x_example, mods)
            except Exception as e:  # noqa: BLE001  (e.g. a second input the boundary leaves time-first)
                warnings.warn(f"autoselect: the network does not run in layout {layout!r} "
                              f"({type(e).__name__}: {e}); skipped")
                report.skipped.append(f"layout {layout}: {type(e).__name__}: {e}")
                continue
            finally:
                _restore(net, snap)
            rows, total, plan = [], 0.0, {}
            bar = _progress(mods, layout, progress)
            for name, mod in bar:
                if name not in inputs:  # never ran on this input
                    continue
                key = layer_key(mod, layout, inputs[name])
                times = cache.get(key)
                hit = times is not None and set(times) == set(candidates(mod))
                if not hit:
                    times = {}
                    for c in _ordered(mod, inputs[name]):
                        best = min(times.values(), default=math.inf)
                        with _method(mod, c):
                            try:
                                if measure_fn is measure:  # stop timing a candidate once it clearly loses
                                    times[c] = measure(mod, inputs[name], m, abandon_above=ABANDON * best)
                                else:
                                    times[c] = float(measure_fn(mod, inputs[name], m))
                            except Exception as e:  # noqa: BLE001  (a candidate that cannot run is skipped)
                                times[c] = math.inf
                                report.skipped.append(f"{layout}/{name}/{c}: {type(e).__name__}: {e}")
                    cache.put(key, times)
                    report.timed += 1
                else:
                    report.cache_hits += 1
                choice = min(times, key=times.get)
                if math.isinf(times[choice]):
                    raise RuntimeError(f"no candidate of layer {name!r} could run in layout {layout!r}: "
                                       f"{report.skipped[-len(times):]}")
                total += times[choice]
                plan[name] = choice
                rows.append(LayerResult(name, type(mod).__name__, times, choice, hit))
                if not hit:
                    _restore(net, snap)  # timing ran forward/backward in training mode
            report.layouts[layout] = rows
            report.totals[layout] = total
            plans[layout] = plan
        cache.save()
        # Fastest layout first; a configuration that does not reproduce the outputs is skipped.
        for layout in sorted(plans, key=report.totals.get):
            _apply(net, layout, plans[layout], fallback)
            out = _outputs(net, x_example)
            _restore(net, snap)
            if _agree(out, reference):
                report.layout, report.methods = layout, plans[layout]
                if compile_backend:
                    _time_compiled(net, x_example, m, measure_fn, compile_backend, reference, snap, report)
                cache.put_plan(whole_key, _with_check({"layout": layout, "methods": plans[layout],
                                                       "totals": report.totals, "compiled": report.compiled}, digest))
                cache.save()
                return report
            msg = f"{layout} configuration {plans[layout]} does not reproduce the network's outputs"
            warnings.warn(f"autoselect: {msg}; skipped")
            report.skipped.append(msg)
        _convert(net, start_layout, fallback)
        return report
    except BaseException:
        _convert(net, start_layout, fallback)
        if snap is not None:
            _restore(net, snap)
        raise


def _has_lazy(net: nn.Module) -> bool:
    return any(isinstance(p, nn.parameter.UninitializedParameter) for p in net.parameters())


def _is_applied(plan, layout: str, methods: dict[str, str], layouts) -> bool:
    """Whether a network in ``layout`` with these tunable layers' ``methods`` runs ``plan`` already."""
    try:
        return (plan is not None and plan["layout"] == layout and plan["layout"] in layouts
                and all(methods.get(name) == method for name, method in plan["methods"].items() if method != "-"))
    except (KeyError, TypeError, AttributeError):  # a damaged plan: the checked path handles it
        return False


def _report_plan(report: AutoselectReport, plan: dict) -> None:
    report.layout, report.methods = plan["layout"], dict(plan["methods"])
    report.totals = {k: float(v) for k, v in plan["totals"].items()}
    report.compiled = bool(plan.get("compiled", False))
    report.cache_hits = len(plan["methods"])


def _compile_as_planned(net: nn.Module, report: AutoselectReport, compile_backend: Optional[str]) -> None:
    """Compile a network a stored plan was just applied to, if that plan ran compiled."""
    if compile_backend and report.compiled:
        _compile(net, compile_backend)
        report.compile_backend = compile_backend


def _apply_cached_plan(net, x_example, plan, layouts, probe, probe_reference, report,
                       compile_backend: Optional[str] = None, fallback: Optional[str] = None) -> bool:
    """Apply a whole-network choice from the cache if it still reproduces the outputs.

    A plan is stored only after it reproduced the outputs on the whole example batch, under a key of
    the network, the input shapes, the device and the library versions. Here it is checked again on a
    few samples (``probe``), and on the whole batch only if those disagree (a spike near its threshold
    may flip); a plan that fails both, or no longer applies, is dropped and the network measured again.
    ``probe`` None: the plan was checked on this network's state already (see :func:`_checked_on`);
    it is applied if it still applies, without running the network.
    """
    if plan is None or plan["layout"] not in layouts:
        return False
    before = {name: m.method for name, m in net.named_modules() if is_tunable(m)}
    checks = [(None, None)] if probe is None else \
        [(probe, probe_reference)] + ([] if probe is x_example else [(x_example, None)])
    for x, reference in checks:
        try:
            if x is not None and reference is None:
                reference = _outputs(net, x)
            _apply(net, plan["layout"], plan["methods"], fallback)
            ok = x is None or _agree(_outputs(net, x), reference)
            if ok:
                _report_plan(report, plan)
        except Exception:  # noqa: BLE001  (a stale or damaged plan: measure again)
            ok = None
        if ok:
            _compile_as_planned(net, report, compile_backend)
            return True
        _apply(net, "time_first", before)  # back to the configuration the references come from
        if ok is None:
            return False
    return False


def _compile(net: nn.Module, backend: str) -> None:
    """``torch.compile`` the whole network's call in place, as one frame dynamo traces.

    Not ``net.compile()``: ``nn.Module.compile`` compiles ``net._call_impl``, and when ``net``'s
    forward lives in ``torch.nn`` (``nn.Sequential``, the usual container) dynamo skips that frame
    (pytorch/pytorch#150915). It then compiles each SpikingJelly layer's forward as a frame of its
    own, so every neuron shares the code of ``MemoryModule.forward`` and its cache of 8 compiled
    versions: neurons past the 8th distinct (dilation, shape, training, grad mode) run eager.
    A wrapper outside ``torch.nn`` is traced instead, with the whole network inlined; it gets a
    code object of its own so that each network has its own compile cache.
    """
    call_impl = net._call_impl

    def call(*args, **kwargs):
        return call_impl(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a new code object: dynamo caches per code object
    net._compiled_call_impl = torch.compile(call, backend=backend)


def _uncompile(net: nn.Module) -> None:
    net._compiled_call_impl = None


def _time_compiled(net, x_example, m, measure_fn, backend, reference, snap, report) -> None:
    """Time a whole training step eager and compiled; keep ``torch.compile`` if faster and correct.

    The compiled step is timed after its first run (the compilation itself is not counted)."""
    def step_time():  # fed data, no input gradient: the very graph training will run
        if measure_fn is measure:
            return measure(net, as_args(x_example), m, input_grad=False)
        return float(measure_fn(net, as_args(x_example), m))

    eager = step_time()
    _restore(net, snap)
    _compile(net, backend)
    try:
        compiled = step_time()
        _restore(net, snap)
        ok = _agree(_outputs(net, x_example), reference)
    except Exception as e:  # noqa: BLE001  (a backend that cannot compile this net: stay eager)
        compiled, ok = math.inf, False
        report.skipped.append(f"torch.compile({backend}): {type(e).__name__}: {e}")
    _restore(net, snap)
    report.compile_times = {"eager": eager, "compiled": compiled}
    report.compile_backend = backend
    report.compiled = ok and compiled < eager
    if not report.compiled:
        _uncompile(net)


def _progress(mods, layout, progress):
    if not progress:
        return mods
    from tqdm import tqdm
    return tqdm(mods, desc=f"autoselect {layout}", leave=False)


def _check_time_first_input(net: nn.Module) -> None:
    """autoselect feeds ``net`` time-first inputs: a network converted with ``to_time_last(net,
    boundary=False)`` takes ``(N, ..., T)`` instead, which the layout conversions cannot tell."""
    from .convert import TIME_LAST_TYPES, has_time_last_boundary
    if has_time_last_boundary(net):
        return
    inner = next((name for name, m in net.named_modules() if isinstance(m, TIME_LAST_TYPES)
                  or getattr(m, "layout", None) == "time_last"), None)
    if inner is not None:
        raise ValueError(f"net runs time-last without the boundary that takes time-first inputs (module "
                         f"{inner or '(the network itself)'!r}; e.g. to_time_last(net, boundary=False)): "
                         f"autoselect takes a network fed (T, N, ...), so call to_time_first(net) first, "
                         f"or convert it with the boundary")


def _layout_of(net: nn.Module) -> str:
    from .convert import current_layout
    return current_layout(net)


def _apply(net: nn.Module, layout: str, plan: dict[str, str], fallback: Optional[str] = None) -> None:
    _convert(net, layout, fallback)
    named = dict(net.named_modules())
    for name, method in plan.items():
        if is_tunable(named[name]):
            named[name].method = method  # the setter rejects a method the layer does not have
        elif method != "-":
            raise ValueError(f"layer {name!r} has no choice of method, got {method!r}")


def autoselect(net: nn.Module, x_example, m: int = 2, layouts: Sequence[str] = ("time_first", "time_last"),
               cache=True, measure_fn: Optional[Callable] = None, progress: bool = True,
               verbose: bool = False, compile: Union[bool, str] = False,
               fallback: Optional[str] = None) -> AutoselectReport:
    """Benchmark every layer's implementations in each layout and apply the fastest, in place.

    :param net: a multi-step SpikingJelly network (time-first input ``(T, N, ...)``)
    :param x_example: an input of the real shape (and dtype/device) the network will train on; a
        tuple holds the positional inputs of a network of several (called as ``net(*x_example)``)
    :param m: each candidate runs a warm-up and ``2m`` timed runs; the mean of the last ``m`` counts
    :param layouts: layouts to consider
    :param cache: ``True`` (the default file, ``$SPIKINGJELLY_MFPSN_CACHE`` or
        ``~/.cache/spikingjelly_mfpsn/autoselect.json``), a path, or ``False``
    :param measure_fn: ``(module, args, m) -> seconds``; replaces the timer (for tests)
    :param progress: show a progress bar
    :param compile: also time one whole training step of the chosen configuration under
        ``torch.compile`` (``True``: inductor, or a backend name) and keep it, compiled in place as
        one graph, when it is faster and reproduces the outputs. The first compilation
        takes tens of seconds on a CPU (then it is cached on disk by PyTorch); it is not counted.
    :param fallback: passed to :func:`~spikingjelly_mfpsn.convert.to_time_last`: ``'time_first'`` lets
        the time-last layout run modules without a time-last version (e.g. a remaining LIF neuron)
        time-first inside it, so that layout is timed too; ``None`` (default): such a network is
        timed time-first only
    :return: an :class:`AutoselectReport`; ``print`` it for a table

    Called with gradients disabled (``torch.no_grad()`` or ``torch.inference_mode()``, usually on a
    network in eval mode), it times forward passes only and caches those timings and that plan apart
    from training's: the choice for an inference loop.

    Under ``torch.distributed``, rank 0 measures and decides, and every rank applies the same choice.
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    for layout in layouts:
        ops.check_layout(layout)
    if not layouts:
        raise ValueError("layouts must name at least one layout")
    from .convert import FALLBACKS
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    _check_time_first_input(net)
    for t in tensors(x_example):
        if not t.numel():
            raise ValueError(f"x_example has an empty tensor (shape {tuple(t.shape)}): autoselect times the "
                             f"shapes training runs, so give it a batch of real samples and steps")
    backend = ("inductor" if compile is True else compile) or None
    t0 = time.perf_counter()
    path = default_cache_path() if cache is True else (cache or None)
    report = None
    _uncompile(net)  # a previous pass may have compiled it; every configuration is timed eager first
    selects = _dist_rank() == 0
    if selects:
        report = _select(net, x_example, m, tuple(layouts), TimingCache(path), measure_fn or measure,
                         progress, backend, fallback)
    report = _broadcast(report)
    report.forward_only = not torch.is_grad_enabled()
    if report.layout is not None:
        if not selects:  # (_select applied its choice on this rank already)
            _apply(net, report.layout, report.methods, fallback)
        if report.compiled and getattr(net, "_compiled_call_impl", None) is None:
            _compile(net, report.compile_backend)
    _compat.invalidate_reset_cache(net)
    report.seconds = time.perf_counter() - t0
    if verbose:
        print(report)
    return report
