"""C++ backend of the charge for CPU tensors: torch operators over the fused kernels of ``cpu/``.

Registered as implementation ``'cpp'`` (backend ``'cpp'``, both layouts) when a C++ compiler is on the
machine (``$CXX``, ``g++``, ``clang++`` or ``c++``). The operators (``torch.ops.spikingjelly_mfpsn.cpp_*``,
see ``cpu/mfpsn_ops.cpp``) are built by :func:`torch.utils.cpp_extension.load` (ninja; its build cache)
at the first call, once per CPU, compiler, torch version and flags, into ``$SPIKINGJELLY_MFPSN_BUILD`` or
``~/.cache/spikingjelly_mfpsn/build`` (about a minute on a 2-core x86-64 machine, announced once through the
package's logger before it starts; a file lock keeps two processes from building at once);
``python -m spikingjelly_mfpsn build`` builds them ahead of time. ``$SPIKINGJELLY_MFPSN_CXXFLAGS`` adds
compiler flags (e.g. ``-march=x86-64-v3`` instead of this CPU's ``-march=native`` for a cache shared by
different machines).
Threads: the kernels use ``torch.get_num_threads()`` OpenMP threads.

What it fuses, so that the X-sized tensors of a BN-threshold training step are read few times:

* ``cpp_stats``: the batch statistics of the bias-free charge without writing the charge (forward: one
  read of X); backward recomputes the charge tile by tile (one read of X, one write of dL/dX);
* ``cpp_charge`` with a surrogate's code: charge + bias + spike for SpikingJelly's ATan/Sigmoid
  surrogates (one read of X, one write of S; nothing else saved); backward recomputes H and forms
  ``dL/dH`` on the fly; with code 0, H = charge + bias, for everything else (e.g. a custom surrogate);
* ``cpp_bn_fire``: a BN-threshold neuron's whole step, one autograd node and one kernel call each way
  (statistics, or the running ones in eval mode, folding, quantiser and spikes; their gradients, the
  per-channel ones in closed form);
* ``cpp_step_fire``: one single-step call without gradients (streaming inference): folding, quantiser,
  the k taps and the spikes in one call.

Their autograd nodes are C++ and give first-order gradients only. torch.compile traces ``cpp_charge``
and ``cpp_stats`` (fake kernels below); the fused ``cpp_bn_fire`` and ``cpp_step_fire``, which refuse
non-finite weights at run time, stay eager (the neuron composes the traced ones under compile).
Float32 and float64; per-channel sums are accumulated in float64.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import filelock
import torch

from .._compat import logger
from .._util import cache_home
from . import surrogate
from .registry import LAYOUTS, Implementation, note_unavailable, register

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = [SOURCE_DIR / name for name in ("mfpsn_ops.cpp", "mfpsn_cpu_f32.cpp", "mfpsn_cpu_f64.cpp")]
HEADERS = [SOURCE_DIR / name for name in ("mfpsn_cpu.h", "mfpsn_cpu.cpp")]
BUILD_ENV, FLAGS_ENV = "SPIKINGJELLY_MFPSN_BUILD", "SPIKINGJELLY_MFPSN_CXXFLAGS"
BUILD_WAIT_S = 1800  # the longest wait for another process's build (a first build takes about a minute)
DTYPES = (torch.float32, torch.float64)
_STE_CODES = {None: 0, "whole": 1, "round": 2}


class BuildError(RuntimeError):
    """The C++ operators could not be compiled or loaded here."""


def compiler() -> Optional[str]:
    """The C++ compiler the backend uses (``$CXX``: one executable, its path made absolute where relative,
    since the build runs in its own directory), or None."""
    env = os.environ.get("CXX")
    if env:
        found = shutil.which(env)
        return None if found is None else os.path.abspath(found) if os.sep in env else env
    return next(filter(None, map(shutil.which, ("g++", "clang++", "c++"))), None)


def build_dir() -> Path:
    return Path(os.environ.get(BUILD_ENV) or cache_home("build")).expanduser()


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _installation() -> list[str]:
    """What the build reads besides the sources: torch's version and headers and Python's (two environments
    with one torch version and their own copies of it get a build each, rather than rebuilding one in turn)."""
    return [torch.__version__, os.path.dirname(os.path.realpath(torch.__file__)), sysconfig.get_paths()["include"]]


def _flags() -> list[str]:
    try:
        extra = shlex.split(os.environ.get(FLAGS_ENV, ""))
    except ValueError as e:
        raise BuildError(f"${FLAGS_ENV}={os.environ[FLAGS_ENV]!r} cannot be split into compiler flags ({e})") from None
    return ["-O3", "-march=native", *surrogate.cpp_defines(), *extra]


def _sources_digest() -> str:
    """The kernels' source text: a build is keyed by it, not by file times (a copy that keeps an older
    time, e.g. ``cp -a`` or a reinstall of another version, would load the other sources' build)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def unwritable(path: Path) -> Optional[str]:
    """Why ``path`` (a directory, created where missing) cannot hold a build, or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return None
    except OSError as e:
        return str(e)


def _writable(path: Path) -> Path:
    """``path``, or a new temporary directory (removed at exit) where ``path`` cannot be written, e.g. a
    read-only home: the operators still build, for this process only, with a warning."""
    reason = unwritable(path)
    if reason is None:
        return path
    fallback = tempfile.TemporaryDirectory(prefix="spikingjelly_mfpsn-build-")
    _KEEP.append(fallback)
    warnings.warn(f"backend 'cpp': the operators cannot be built in {path} ({reason}); building them in "
                  f"{fallback.name} for this process only. Set ${BUILD_ENV} to a writable directory to "
                  f"build them once.")
    return Path(fallback.name)


@contextlib.contextmanager
def _toolchain(cxx: str):
    """$CXX and a ninja on $PATH (the pip package's, where installed) while cpp_extension builds."""
    saved = {name: os.environ.get(name) for name in ("CXX", "PATH")}
    os.environ["CXX"] = cxx
    with contextlib.suppress(ImportError):
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def _build(cxx: str, flags: list[str], openmp: bool) -> Path:
    """Build (where not cached) and load the library; returns its directory."""
    flags = flags + (["-fopenmp"] if openmp else [])
    key = "\0".join([cxx, *flags, *_installation(), _cpu_id(), _sources_digest()])
    name = "mfpsn_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if _loaded_read_only(build_dir() / name, name):
        return build_dir() / name
    directory = _writable(build_dir() / name)
    try:
        _load_from(directory, name, flags, openmp)
    except OSError:
        # Built, but the library does not load (overwritten, a foreign file): build it afresh, in this process
        # under another name (cpp_extension builds a name once per process), at the next start in place.
        shutil.rmtree(directory, ignore_errors=True)
        directory = _writable(build_dir() / f"{name}_again")
        _load_from(directory, f"{name}_again", flags, openmp)
    return directory


def _loaded_read_only(directory: Path, name: str) -> bool:
    """Whether this build, found whole in a directory that cannot be written (a shared, read-only install),
    was loaded from there; False where it must be built (elsewhere, by :func:`_writable`)."""
    library = directory / f"{name}.so"
    if unwritable(directory) is None or not library.is_file() or _cut_short(library) or not _up_to_date(library):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _up_to_date(library: Path) -> bool:
    """Whether ``library`` is built from the current sources, so that ninja only loads it."""
    try:
        return library.stat().st_mtime >= max(p.stat().st_mtime for p in SOURCES + HEADERS)
    except OSError:
        return False


def _cut_short(library: Path) -> bool:
    """Whether ``library`` is an ELF file cut short (a copy or write interrupted): its section headers,
    at the end, lie beyond its size. Loading one faults (SIGBUS) rather than raise an error."""
    try:
        with open(library, "rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if head[:4] != b"\x7fELF":
        return False  # (not ELF: the loader refuses it with an error)
    if len(head) < 64:
        return True
    order = "<" if head[5] == 1 else ">"
    wide = head[4] == 2  # 64-bit: e_shoff at 0x28, e_shentsize and e_shnum at 0x3A; 32-bit: 0x20 and 0x2E
    (offset,) = struct.unpack_from(order + ("Q" if wide else "I"), head, 0x28 if wide else 0x20)
    entry, count = struct.unpack_from(order + "HH", head, 0x3A if wide else 0x2E)
    return offset + entry * count > size


def _announce_build(directory: Path) -> None:
    """Say once per process, before the compiler starts, that a build is under way (a cached load is quiet)."""
    if not _ANNOUNCED:
        _ANNOUNCED.append(True)
        logger.warning("spikingjelly_mfpsn: building the C++ kernels of backend 'cpp' once (about 20-60 s), "
                       "cached in %s", directory)


def _load_from(directory: Path, name: str, flags: list[str], openmp: bool) -> None:
    from torch.utils import cpp_extension
    with _build_lock(directory):
        with contextlib.suppress(FileNotFoundError):  # a build killed midway leaves cpp_extension's own lock
            (directory / "lock").unlink()
        library = directory / f"{name}.so"
        if _cut_short(library):  # (ninja takes it for up to date, and loading it would fault, not raise)
            library.unlink()
        if not _up_to_date(library):
            _announce_build(directory)
        cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"] if openmp else [], build_directory=str(directory),
                           is_python_module=False, verbose=False)


@contextlib.contextmanager
def _build_lock(directory: Path):
    """The directory's build lock; waiting for another process's build is said once, and bounded."""
    lock = filelock.FileLock(str(directory / "build.lock"))
    try:
        lock.acquire(timeout=5)
    except filelock.Timeout:
        logger.warning("spikingjelly_mfpsn: waiting for another process building the C++ kernels in %s", directory)
        try:
            lock.acquire(timeout=BUILD_WAIT_S)
        except filelock.Timeout:
            raise BuildError(f"another process has held {lock.lock_file} for {BUILD_WAIT_S // 60} minutes without "
                             f"finishing its build (stopped or hung?): end it, then build again") from None
    try:
        yield
    finally:
        lock.release()


_LOCK = threading.Lock()
_KEEP: list = []  # temporary build directories of this process
_LOADED: list[Path] = []  # the directory of the loaded library
_ANNOUNCED: list = []


@torch.compiler.disable
def load() -> Path:
    """Build (once: cached) and load the operators; then register their fake kernels. Returns the directory
    of the library; at once where this process loaded it already."""
    with _LOCK:
        if _LOADED:
            return _LOADED[0]
        cxx = compiler()
        if cxx is None:
            raise BuildError("backend 'cpp' needs a C++ compiler (g++, clang++ or $CXX)")
        errors, flags = [], _flags()
        with _toolchain(cxx):
            from torch.utils import cpp_extension
            if not cpp_extension.is_ninja_available():
                raise BuildError("backend 'cpp' needs ninja to build its C++ operators (pip install ninja)")
            for openmp in (True, False):  # without OpenMP the kernels run on one thread
                try:
                    directory = _build(cxx, flags, openmp)
                    if errors:
                        _warn_single_threaded(errors[0])
                    break
                except BuildError:
                    raise
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    errors.append(f"{e}\n{getattr(e, 'output', None) or ''}"[-3000:])
            else:
                extra = f" (with ${FLAGS_ENV}={os.environ[FLAGS_ENV]!r})" if os.environ.get(FLAGS_ENV) else ""
                raise BuildError(f"the C++ operators of backend 'cpp' did not build{extra}:\n" + "\n".join(errors))
        _register_fakes()
        _LOADED.append(directory)
        return directory


def _warn_single_threaded(error: str) -> None:
    """Say that the build with OpenMP failed (e.g. Apple clang without libomp) and the kernels run on one
    thread, with the compiler's last words."""
    last = [line for line in error.splitlines() if line.strip()][-3:]
    warnings.warn("backend 'cpp': the C++ operators did not build with OpenMP (-fopenmp), so they were built "
                  "without it and run on one thread whatever torch.get_num_threads() says; the compiler said:\n"
                  + "\n".join(last))


@torch.compiler.assume_constant_result
def _loaded() -> bool:
    """True, once :func:`load` has run. A constant to torch.compile, which calls it while tracing: a first
    call under compile builds and loads the library then, where it broke the graph at every neuron."""
    if not _LOADED:
        load()
    return True


def _ops():
    _loaded()
    return torch.ops.spikingjelly_mfpsn


def _register_fakes() -> None:
    """What torch.compile sees of the differentiable operators: shapes and dtypes only."""
    fake = torch.library.register_fake
    per_channel = lambda weight: weight.new_empty(weight.shape[0])  # noqa: E731
    fake("spikingjelly_mfpsn::cpp_charge")(lambda x, weight, *_: torch.empty_like(x))
    fake("spikingjelly_mfpsn::cpp_charge_backward")(
        lambda x, weight, bias, grad, dilation, time_last, kind, alpha, need_gx:
        (torch.empty_like(x) if need_gx else x.new_empty(0), torch.empty_like(weight), per_channel(weight)))
    fake("spikingjelly_mfpsn::cpp_stats")(lambda x, weight, *_: (per_channel(weight), per_channel(weight)))
    fake("spikingjelly_mfpsn::cpp_stats_backward")(
        lambda x, weight, mean, g_mean, g_var, dilation, time_last, need_gx:
        (torch.empty_like(x) if need_gx else x.new_empty(0), torch.empty_like(weight)))


# ---------------------------------------------------------------- registry entries
def charge(x, weight, bias, dilation, layout):
    """Registry contract: H, dense, differentiable w.r.t. x, weight and bias."""
    return _ops().cpp_charge(x, weight, bias, dilation, layout == "time_last", 0, 0.0)


def fire(x, weight, bias, dilation, layout, code, alpha) -> torch.Tensor:
    """Registry contract: fused charge + Heaviside + the gradient of surrogate ``code``."""
    return _ops().cpp_charge(x, weight, bias, dilation, layout == "time_last", code, alpha)


def stats(x, weight, dilation, layout):
    return _ops().cpp_stats(x, weight, dilation, layout == "time_last")


def bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running=None, given=None):
    """Registry contract: ``(spikes, mean, var)`` in one autograd node, on any tensors (the operator checks
    them itself: ``checks_inputs``), or None where it cannot run them, for a folding with NaN or inf (the
    caller's general path reports it) and under torch.compile (which traces the separate operators)."""
    if torch.compiler.is_compiling():
        return None
    rm, rv, factor = running if running is not None else (None, None, 0.0)
    gm, gv = given if given is not None else (None, None)
    outs = _ops().cpp_bn_fire(x, weight, gamma, beta, rm, rv, gm, gv, float(eps), _STE_CODES[ste], dilation,
                              layout == "time_last", code, alpha, factor)
    if not outs:
        return None
    return tuple(outs) if given is None else (outs[0], gm, gv)


def step_fire(taps, weight, bias, bn, quantize) -> Optional[torch.Tensor]:
    """Registry contract: one single-step call's spikes in one kernel call, or None for a gradient to
    compute, tensors it cannot read raw (another device or dtype, not contiguous), weights with NaN or
    inf, or under torch.compile."""
    if torch.compiler.is_compiling():
        return None
    gamma, beta, mean, var, eps = bn if bn is not None else (None, None, None, None, 0.0)
    outs = _ops().cpp_step_fire(list(taps), weight, bias, gamma, beta, mean, var, float(eps), bool(quantize))
    return outs[0] if outs else None


IMPLEMENTATION = Implementation(
    "cpp", "cpp", LAYOUTS, charge, "fused C++/OpenMP CPU kernels: charge, spike and batch statistics",
    devices=("cpu",), dtypes=DTYPES, reads_lower_precision=False, priority=lambda device, k, t: -1,
    fire=fire, stats=stats, bn_fire=bn_fire, step_fire=step_fire, checks_inputs=True)


def unavailable_reason() -> Optional[str]:
    """Why ``'cpp'`` cannot be built here (its sources missing, no compiler), or None."""
    missing = [p.name for p in SOURCES + HEADERS if not p.is_file()]
    if missing:
        return (f"its kernels' source {', '.join(missing)} is missing from this installation of "
                f"spikingjelly_mfpsn (reinstall the package)")
    if compiler() is None:
        if os.environ.get("CXX"):
            return (f"$CXX={os.environ['CXX']!r} names no compiler found here (one executable: flags go in "
                    f"${FLAGS_ENV})")
        return "no C++ compiler found (set $CXX or install g++ or clang++)"
    return None


def register_if_available() -> Optional[str]:
    """Register ``'cpp'`` when a compiler exists; otherwise record why not. Returns that reason."""
    reason = unavailable_reason()
    if reason is not None:
        note_unavailable("cpp", reason)
        return reason
    register(IMPLEMENTATION)
    return None


register_if_available()
