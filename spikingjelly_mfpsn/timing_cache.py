"""Autoselect's cache: a JSON file of per-layer timings and whole-network plans, their keys (see
:mod:`~spikingjelly_mfpsn.tuner`), the digests of the network states a plan was checked on."""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import stat
import warnings
from typing import Optional

import filelock
import torch
import torch.nn as nn

from . import _compat, ops
from ._util import cache_home, device_type, tensors
from .timing import candidates, is_tunable

CACHE_SCHEMA = 1
CACHE_ENV = "SPIKINGJELLY_MFPSN_CACHE"
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
    return f"cpu:{_cpu_model()}:{torch.get_num_threads()}threads"


def _cpu_model() -> str:
    """The CPU's model name where the system tells it (Linux's /proc/cpuinfo; ``platform.processor()``
    is empty there), else the machine's architecture: a cache shared by machines keeps each one's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Hardware", "CPU part") and value.strip():
                    return value.strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _where(ts: list) -> dict:
    """What every key holds of a call: its input tensors, the device, the library versions, and what a
    call that runs differently from plain training adds: with gradients disabled (forward-only timings
    and plans, for inference) or under autocast (its dtype); nothing otherwise, so earlier training
    keys stay valid."""
    kind = device_type(ts)
    mode = {} if torch.is_grad_enabled() else {"forward_only": True}
    if torch.is_autocast_enabled(kind):
        mode["autocast"] = str(torch.get_autocast_dtype(kind))
    return {"inputs": [[list(t.shape), str(t.dtype)] for t in ts],
            "device": _device_name(ts[0].device) if ts else "none", "versions": _versions(), **mode}


_CHOICE = re.compile(r"""(, )?\b(method|backend)=('[^']*'|"[^"]*")""")


def _describe(m: nn.Module) -> list:
    """A module's type and description. A tunable layer's description is without its current choice
    (method, and backend where it has one: autoselect's candidates span every backend, so a key must
    not change once one is chosen). Cut from the description, not set: a network saved where another
    backend ran may hold a method that cannot be set here."""
    text = _CHOICE.sub("", m.extra_repr()) if is_tunable(m) else m.extra_repr()
    return [f"{type(m).__module__}.{type(m).__qualname__}", text]


def _hash(sig: dict) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()


def layer_key(module: nn.Module, layout: str, args: tuple) -> str:
    """Cache key of one layer's timings."""
    kind, text = _describe(module)
    return _hash({"type": kind, "repr": text, "params": [list(p.shape) for p in module.parameters()],
                  "training": module.training, "layout": layout, "candidates": candidates(module),
                  **_where([a for a in args if isinstance(a, torch.Tensor)])})


def net_key(net: nn.Module, x, layouts, fallback: Optional[str] = None) -> str:
    """Cache key of a whole network's choice.

    It covers every module's signature, the input, the device, the layouts considered (and the time-last
    conversion's fallback), the registered implementations and the library versions.
    """
    mods = [[name, *_describe(m), [list(p.shape) for p in m.parameters(recurse=False)], m.training]
            for name, m in net.named_modules()]
    return _hash({"modules": mods, "layouts": list(layouts), "implementations": sorted(ops.names()),
                  **_where(tensors(x)), **({"fallback": fallback} if fallback else {})})


def state_digest(net: nn.Module) -> Optional[str]:
    """SHA-256 of every parameter and buffer of ``net``: names, shapes, dtypes and bytes.

    None when one is not on the CPU (hashing would copy it there).
    """
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
    return None if digest is None else _hash({"state": digest, "layout": plan["layout"], "methods": plan["methods"]})


def checked_on(plan, digest: Optional[str], layouts) -> bool:
    """Whether ``plan`` was checked on a network in state ``digest`` (so it needs no check again)."""
    try:
        return (digest is not None and plan["layout"] in layouts and isinstance(plan.get("checked"), list)
                and _check_id(digest, plan) in plan["checked"])
    except (KeyError, TypeError, AttributeError, ValueError):  # a damaged plan: the checked path handles it
        return False


def with_check(plan: dict, digest: Optional[str]) -> dict:
    """``plan`` recording that it reproduced the outputs of a network in state ``digest`` (the last
    ``CHECKED_STATES`` such states are kept; a None digest records nothing)."""
    check = _check_id(digest, plan)
    if check is None:
        return plan
    old = plan.get("checked")
    kept = [c for c in old if isinstance(c, str) and c != check] if isinstance(old, list) else []
    return {**plan, "checked": (kept + [check])[-CHECKED_STATES:]}


def default_cache_path() -> str:
    """The autoselect cache file used when no path is given.

    Returns:
        The path in the ``SPIKINGJELLY_MFPSN_CACHE`` environment variable if set, else
        ``spikingjelly_mfpsn/autoselect.json`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``).
    """
    return os.path.expanduser(os.environ.get(CACHE_ENV) or cache_home("autoselect.json"))


class TimingCache:
    """A JSON file of per-layer timings.

    A corrupted or foreign file is rebuilt, and every entry is checked against the schema of what this code
    writes (see :func:`_valid_layer`, :func:`_valid_plan`): anything else is dropped with a warning and
    measured again, never trusted. A path that is not a regular file (a directory, a FIFO, a device) is
    never opened: a warning, and no cache. Writes go to a temporary file renamed over the old one (never
    torn) under a lock (no lost updates between concurrent writers), waited for at most ``LOCK_TIMEOUT``
    seconds. It keeps the ``MAX_LAYER_ENTRIES`` layer timings and the ``MAX_PLANS`` plans written last.
    """

    def __init__(self, path: Optional[str]):
        self.path = path = os.path.expanduser(os.fspath(path)) if path else None
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
            target = os.path.realpath(self.path)  # (through a symlink: its target gets the entries)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            timeout = lock_timeout()
            with filelock.FileLock(target + ".lock", timeout=timeout):
                self._write_merged(target)
        except filelock.Timeout:  # (an OSError too)
            warnings.warn(f"autoselect cache {self.path}: its lock ({target}.lock) was held by another "
                          f"process for {timeout:g} s; the choice is applied but not cached "
                          f"(${LOCK_TIMEOUT_ENV} sets the wait)")
        except OSError as e:
            warnings.warn(f"autoselect cache {self.path} cannot be written ({e}); the choice is applied but "
                          f"not cached (cache=False stops this warning, cache='path' picks another file)")

    def _write_merged(self, target: str) -> None:
        """Write what the file holds now with this object's entries over it (under the lock), in the
        file's own permissions (a new file: those the umask gives, not a temporary file's 0600)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layers_, plans = self._read()
        layers_ = _newest(layers_, self.entries, self.put_keys, MAX_LAYER_ENTRIES)
        plans = _newest(plans, self.plans, self.put_plan_keys, MAX_PLANS)
        if os.path.exists(target) and (not os.stat(target).st_mode & 0o222 or not os.access(target, os.W_OK)):
            # (a cache frozen with chmod a-w: also for root, whom the access check lets write)
            raise PermissionError(errno.EACCES, "the file is read-only", target)
        directory, base = os.path.split(target)
        for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(base)}.*.tmp")):
            with contextlib.suppress(OSError):  # (a save killed midway; under the lock, no other is writing)
                os.unlink(stale)
        tmp = os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(8)}.tmp")
        try:
            with open(tmp, "x") as f:  # dumps: one C-encoded string (dump encodes in Python)
                f.write(json.dumps({"schema": CACHE_SCHEMA, "layers": layers_, "plans": plans}))
            with contextlib.suppress(FileNotFoundError):
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            # Not fsynced (0.2-0.4 ms a save here): the rename keeps readers from a torn file, and a file
            # a system crash leaves empty only makes the next call rebuild the cache, as it does any
            # unreadable one (it holds timings and choices, nothing that cannot be measured again).
            os.replace(tmp, target)
            self.put_keys, self.put_plan_keys = set(), set()  # on the file now, as its newest
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


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
        seconds = float(value) if value else LOCK_TIMEOUT
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:  # (inf would wait for ever, nan and negatives for nothing)
        raise ValueError(f"${LOCK_TIMEOUT_ENV} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _not_a_regular_file(path: str) -> str:
    """What ``path`` is when it exists and is not a regular file (opening a FIFO would block), else ''."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing (created on save), or unreachable (reported when read)
        return ""
    return ("" if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def _is_time(v) -> bool:
    """A timing as autoselect writes it: seconds, a number >= 0 (inf: the candidate could not run)."""
    return (isinstance(v, float) or isinstance(v, int) and not isinstance(v, bool) and v < 2 ** 53) \
        and v >= 0  # (False for NaN; an int beyond a float's range is no timing this code writes)


def _str_dict(d, value_ok) -> bool:
    """``d`` is a dict of strings to values that pass ``value_ok``."""
    return isinstance(d, dict) and all(isinstance(k, str) and value_ok(v) for k, v in d.items())


def _valid_layer(times) -> bool:
    """A layer entry: ``{method: seconds}``, at least one candidate that ran."""
    return _str_dict(times, _is_time) and any(math.isfinite(v) for v in times.values())


def _valid_plan(plan) -> bool:
    """A whole network's plan: its layout, ``{layer: method}``, ``{layout: seconds}``, whether it runs
    compiled and the states it was checked on, and nothing else."""
    return (isinstance(plan, dict) and set(plan) <= {"layout", "methods", "totals", "compiled", "checked"}
            and plan.get("layout") in ops.LAYOUTS and bool(plan.get("methods"))
            and _str_dict(plan.get("methods"), lambda v: isinstance(v, str))
            and _str_dict(plan.get("totals"), lambda v: _is_time(v) and math.isfinite(v))
            and isinstance(plan.get("compiled", False), bool)
            and isinstance(plan.get("checked", []), list) and all(isinstance(c, str) for c in plan.get("checked", [])))
