"""C++ backend of the charge for CPU tensors: the fused kernels of ``cpu/mfpsn_cpu.cpp``.

Registered as implementation ``'cpp'`` (backend ``'cpp'``, both layouts) when a C++ compiler is on
the machine (``$CXX``, ``g++``, ``clang++`` or ``c++``). The source is compiled at the first call
on a dtype (8-10 s on a 2-core x86-64 machine) into ``$SPIKINGJELLY_MFPSN_BUILD`` or
``~/.cache/spikingjelly_mfpsn/build``, one library per source, compiler, CPU and dtype, written
atomically, and loaded with :mod:`ctypes`. Threads: the kernels use ``torch.get_num_threads()``
OpenMP threads.

What it fuses, so that the X-sized tensors of a BN-threshold training step are read few times:

* ``stats``: the batch statistics of the bias-free charge without writing the charge (forward: one
  read of X); backward recomputes the charge tile by tile (one read of X, one write of dL/dX);
* ``fire``: charge + bias + spike for SpikingJelly's ATan/Sigmoid surrogates (one read of X, one
  write of S; nothing else saved); backward recomputes H and forms ``dL/dH`` on the fly;
* ``charge``: H = charge + bias, for everything else (e.g. a custom surrogate);
* ``bn_fire``: a BN-threshold neuron's whole step, one kernel call each way (statistics, or the
  running ones in eval mode, folding, quantiser and spikes; their gradients, the per-channel ones in
  closed form);
* ``step_fire``: one single-step call without gradients (streaming inference), folding, quantiser,
  the k taps and the spikes in one call.

In training, ``bn_fire``'s autograd node is C++ (``cpu/mfpsn_node.cpp``, built against the installed
torch at the first training call on a dtype: :func:`node`); where that does not build, the Python
autograd Function ``_CppBNFire`` calls the same kernels through ctypes. With no graph to record, every
entry (``charge``, ``fire``, ``stats``, ``bn_fire``) runs its kernel alone, without an autograd node.

Float32 and float64; per-channel sums are accumulated in float64.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.autograd.graph import increment_version

from . import surrogate
from .registry import LAYOUTS, Implementation, check_charge_args, first_order_only, needs_grad, note_unavailable, register

SOURCE_FILE = Path(__file__).with_name("cpu") / "mfpsn_cpu.cpp"
BUILD_ENV = "SPIKINGJELLY_MFPSN_BUILD"
DTYPES = {torch.float32: "f32", torch.float64: "f64"}
_MODE_CHARGE, _MODE_STATS = 0, -1  # (the kernels' backward modes besides the surrogates' codes)
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", *surrogate.cpp_defines()]


class BuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded here."""


def compiler() -> Optional[str]:
    """The C++ compiler the backend uses, or None."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env) or (env if os.path.isfile(env) else None)
    for name in ("g++", "clang++", "c++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def build_dir() -> Path:
    return Path(os.environ.get(BUILD_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "spikingjelly_mfpsn", "build"))


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compile(cxx: str, out: Path, flags: list[str], source: Path = SOURCE_FILE, libs: Sequence[str] = ()) -> None:
    """Compile ``source`` to ``out`` (atomically: a temporary file renamed into place), linked with ``libs``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (["-fopenmp"], []):  # without OpenMP the kernels run on one thread
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cxx, *flags, *extra, str(source), "-o", tmp, *libs]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode == 0:
            os.replace(tmp, out)
            return
        os.unlink(tmp)
        errors.append(f"$ {' '.join(cmd)}\n{run.stderr.strip()[-2000:]}")
    raise BuildError("the C++ kernels of backend 'cpp' did not compile:\n" + "\n".join(errors))


def _writable(path: Path) -> Path:
    """``path``, or its name in a new temporary directory when ``path``'s directory cannot be written
    (e.g. a read-only home): the kernels still build, for this process only, with a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
        return path
    except OSError as e:
        fallback = _process_build_dir() / path.name
        warnings.warn(f"backend 'cpp': the kernels cannot be written to {path.parent} ({e}); building them in "
                      f"{fallback.parent} for this process only. Set ${BUILD_ENV} to a writable directory "
                      f"to build them once.")
        return fallback


_PROCESS_DIR: list = []  # the temporary build directory of this process, made at most once


def _process_build_dir() -> Path:
    """A temporary directory for builds that cannot go to the build directory: one per process, removed
    with everything in it when the process exits (a library loaded from it stays mapped until then)."""
    if not _PROCESS_DIR:
        _PROCESS_DIR.append(tempfile.TemporaryDirectory(prefix="spikingjelly_mfpsn-build-"))
    return Path(_PROCESS_DIR[0].name)


_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def _built(name: str, flags: list[str], load, source: Path = SOURCE_FILE, libs: Sequence[str] = (),
           key_parts: Sequence[str] = ()):
    """``load(path)`` of ``source`` compiled with ``flags``: built once per source, compiler, flags, CPU (and
    ``key_parts``) into the build directory as ``{name}_{key}.so``; a file that does not load (truncated,
    foreign) is built again once. Call under ``_LOCK``."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("backend 'cpp' needs a C++ compiler (g++, clang++ or $CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    texts = [SOURCE_FILE.read_text()] + ([source.read_text()] if source != SOURCE_FILE else [])
    key = hashlib.sha256("\0".join([*texts, cxx, version, " ".join([*flags, *libs]), _cpu_id(), *key_parts])
                         .encode()).hexdigest()[:16]
    path = build_dir() / f"{name}_{key}.so"
    if not path.exists():
        path = _writable(path)
        _compile(cxx, path, flags, source, libs)
    try:
        return load(path)
    except OSError as e:  # a truncated or foreign file: build it again once
        with contextlib.suppress(OSError):
            path.unlink()
        path = _writable(path)
        _compile(cxx, path, flags, source, libs)
        try:
            return load(path)
        except OSError:
            raise BuildError(f"the compiled library at {path} does not load: {e}") from e


def library(dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """The compiled kernels for ``dtype`` (float32 or float64), built on first use: one library per
    dtype (each about half of the build), so a float32 network never waits for float64's kernels."""
    suffix = DTYPES[dtype]
    lib = _LIBS.get(suffix)
    if lib is not None:  # the hot path: no lock once built
        return lib
    with _LOCK:
        if suffix not in _LIBS:
            lib = _built(f"mfpsn_cpu_{suffix}", [*_FLAGS, f"-DMFPSN_ONLY_{suffix.upper()}"],
                         lambda path: ctypes.CDLL(str(path)))
            _declare(lib, suffix)
            _LIBS[suffix] = lib
        return _LIBS[suffix]


NODE_SOURCE = SOURCE_FILE.with_name("mfpsn_node.cpp")
_NODES: dict[str, Optional[object]] = {}  # dtype suffix -> the node's operator, or None where it did not build
NODE_UNAVAILABLE: dict[str, str] = {}  # dtype suffix -> why the node did not build


def node(dtype: torch.dtype):
    """The C++ autograd node of the BN-threshold step for ``dtype`` (``cpu/mfpsn_node.cpp``: the kernels of
    :func:`library` behind a torch operator, compiled against this torch's headers, once per torch version;
    about 20 s), or None where it does not build here (the reason in ``NODE_UNAVAILABLE``, and a warning
    once): then training runs the same kernels through the Python autograd Function ``_CppBNFire``."""
    suffix = DTYPES[dtype]
    if suffix in _NODES:  # the hot path
        return _NODES[suffix]
    with _LOCK:
        if suffix not in _NODES:
            try:
                _NODES[suffix] = _built(f"mfpsn_node_{suffix}", _node_flags(suffix), _load_node(suffix), NODE_SOURCE,
                                        _node_libs(), [torch.__version__, str(_torch_dir())])
            except (BuildError, OSError, RuntimeError) as e:
                _NODES[suffix] = None
                NODE_UNAVAILABLE[suffix] = str(e)
                lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith("$ ")]
                reason = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else type(e).__name__)
                warnings.warn(f"backend 'cpp': its autograd node does not build against this torch ({reason.strip()}; "
                              f"all of it in spikingjelly_mfpsn.ops.cpp_ops.NODE_UNAVAILABLE): training runs the "
                              f"same kernels through a Python autograd Function instead (about 30 us more per "
                              f"neuron call)")
        return _NODES[suffix]


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _node_flags(suffix: str) -> list[str]:
    include = _torch_dir() / "include"
    return [*_FLAGS, f"-DMFPSN_ONLY_{suffix.upper()}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]


def _node_libs() -> list[str]:
    lib = _torch_dir() / "lib"
    return [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]


def _load_node(suffix: str):
    def load(path: Path):
        torch.ops.load_library(str(path))
        return getattr(torch.ops.spikingjelly_mfpsn_cpu, f"bn_fire_{suffix}")
    return load


def _declare(lib: ctypes.CDLL, suffix: str) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    geometry = [i64, i64, i64, i64, i32, i32, i32, i32]
    fwd = getattr(lib, f"mfpsn_forward_{suffix}")
    fwd.argtypes = [p, p, p, p, i32, p, p] + geometry
    fwd.restype = None
    bwd = getattr(lib, f"mfpsn_backward_{suffix}")
    bwd.argtypes = [p, p, p, p, i32, f64, p, p, p, p, i32, p, p] + geometry
    bwd.restype = None
    bn_fwd = getattr(lib, f"mfpsn_bn_forward_{suffix}")
    bn_fwd.argtypes = [p, p, p, p, f64, i32, i32, p, p, p, p, p, p, p, f64] + geometry
    bn_fwd.restype = i32
    bn_bwd = getattr(lib, f"mfpsn_bn_backward_{suffix}")
    bn_bwd.argtypes = [p, p, p, p, p, p, p, p, i32, f64, f64, i32, i32, p, p, p, p] + geometry
    bn_bwd.restype = None
    step = getattr(lib, f"mfpsn_step_{suffix}")
    step.argtypes = [p, p, p, p, p, p, f64, i32, p, p, i64, i64, i64, i32, i32]
    step.restype = i32


# ---------------------------------------------------------------- calling the kernels
def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _geometry(x: torch.Tensor, k: int, dilation: int, layout: str) -> tuple:
    """(T, N, C, F, k, d, time_last, threads) of a contiguous ``x`` in a checked ``layout``; F is the
    product of the feature dims."""
    shape = x.shape
    if layout == "time_last":
        return (shape[-1], shape[0], shape[1], math.prod(shape[2:-1]), k, dilation, 1, torch.get_num_threads())
    return (shape[0], shape[1], shape[2], math.prod(shape[3:]), k, dilation, 0, torch.get_num_threads())


def forward(x, weight, bias, dilation, layout, spike=False, stats=False):
    """Run the forward kernel on contiguous tensors: H (or S with ``spike``), or with ``stats`` the
    per-channel ``(mean, biased var)`` of the bias-free charge (from float64 sums)."""
    lib = library(x.dtype)
    c = weight.shape[0]
    out = None if stats else torch.empty_like(x, memory_format=torch.contiguous_format)
    new = weight.new_empty if x.numel() else weight.new_zeros  # the kernel writes every entry
    mean, var = (new(c), new(c)) if stats else (None, None)
    if x.numel():
        getattr(lib, f"mfpsn_forward_{DTYPES[x.dtype]}")(
            _ptr(x), _ptr(weight), _ptr(bias), _ptr(out), int(spike), _ptr(mean), _ptr(var),
            *_geometry(x, weight.shape[1], dilation, layout))
    return (mean, var) if stats else out


def backward(x, weight, bias, grad, mode, alpha, stats_grad, dilation, layout, need_gx, need_sums, add_to=None):
    """Run the backward kernel on contiguous tensors: ``(dL/dX, dL/dW, dL/db)``, each None unless
    asked for. ``stats_grad`` is ``(mean, dL/dmean, dL/dvar)`` for the statistics' backward (mode 3).
    ``add_to``: a contiguous tensor like ``x`` that dL/dX is added to (and returned as dL/dX)."""
    lib = library(x.dtype)
    c, k = weight.shape
    gx = add_to if add_to is not None else torch.empty_like(x) if need_gx else None
    new = weight.new_empty if x.numel() else weight.new_zeros  # the kernel writes every entry
    gw = new(c, k) if need_sums else None
    gb = new(c) if need_sums else None
    mean, g_mean, g_var = stats_grad if stats_grad is not None else (None, None, None)
    if x.numel():
        getattr(lib, f"mfpsn_backward_{DTYPES[x.dtype]}")(
            _ptr(x), _ptr(weight), _ptr(bias), _ptr(grad), mode, float(alpha), _ptr(mean), _ptr(g_mean),
            _ptr(g_var), _ptr(gx), int(add_to is not None), _ptr(gw), _ptr(gb), *_geometry(x, k, dilation, layout))
    return gx, gw, gb


# ---------------------------------------------------------------- differentiable forms
# The math of each direction, shared by the eager autograd Functions and the custom ops that
# torch.compile sees (an opaque op instead of a graph break at the ctypes call).
def _charge_fwd(x, weight, bias, dilation, layout, kind):
    return forward(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
                   dilation, layout, spike=bool(kind))


def _charge_bwd(x, weight, bias, grad, dilation, layout, kind, alpha, needs):
    """(dL/dX, dL/dW, dL/db), each None unless asked for in ``needs``; H recomputed from X."""
    need_sums = needs[1] or (bias is not None and needs[2])
    gx, gw, gb = backward(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
                          grad.to(x.dtype).contiguous(), kind or _MODE_CHARGE, alpha, None, dilation, layout,
                          needs[0], need_sums)
    gw = gw if needs[1] else None
    gb = gb.to(bias.dtype) if gb is not None and bias is not None and needs[2] else None
    return gx, gw, gb


def _stats_fwd(x, weight, dilation, layout):
    """(mean, biased var) in the weight's dtype, from float64 sums."""
    return forward(x.contiguous(), weight.contiguous(), None, dilation, layout, stats=True)


def _stats_grads(mean, g_mean, g_var):
    """dL/dmean and dL/dvar as dense tensors like ``mean`` (autograd passes None for an unused output)."""
    return tuple(torch.zeros_like(mean) if g is None else g.to(mean.dtype).contiguous() for g in (g_mean, g_var))


def _stats_bwd(x, weight, mean, g_mean, g_var, dilation, layout, needs):
    """(dL/dX, dL/dW): ``dL/dY = a[c] * Y + b[c]`` pushed through the charge, Y recomputed."""
    gx, gw, _ = backward(x.contiguous(), weight.contiguous(), None, None, _MODE_STATS, 0.0,
                         (mean, g_mean, g_var), dilation, layout, needs[0], needs[1])
    return gx, gw


class _CppCharge(torch.autograd.Function):
    """H = charge(X, W) + b, or S = Heaviside(H) with the surrogate gradient ``kind`` (a code of the surrogate table);
    H is recomputed in the backward, so only X, W and b are saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, dilation, layout, kind, alpha):
        ctx.save_for_backward(x, weight, bias)
        ctx.args = (dilation, layout, kind, alpha)
        return _charge_fwd(x, weight, bias, dilation, layout, kind)

    @staticmethod
    def backward(ctx, grad):
        first_order_only("cpp")
        x, weight, bias = ctx.saved_tensors
        return (*_charge_bwd(x, weight, bias, grad, *ctx.args, ctx.needs_input_grad[:3]), None, None, None, None)


class _CppStats(torch.autograd.Function):
    """Per-channel (mean, biased var) of charge(X, W) without writing it; the backward
    ``dL/dY = a[c] * Y + b[c]`` is formed tile by tile from a recomputed Y."""

    @staticmethod
    def forward(ctx, x, weight, dilation, layout):
        mean, var = _stats_fwd(x, weight, dilation, layout)
        ctx.save_for_backward(x, weight, mean)
        ctx.args = (dilation, layout)
        return mean, var

    @staticmethod
    def backward(ctx, g_mean, g_var):
        first_order_only("cpp")
        x, weight, mean = ctx.saved_tensors
        gx, gw = _stats_bwd(x, weight, mean, *_stats_grads(mean, g_mean, g_var), *ctx.args,
                            ctx.needs_input_grad[:2])
        return gx, gw, None, None


def bn_forward(x, weight, gamma, beta, eps, quantize, dilation, layout, running=None, geometry=None, given=None):
    """Run the BN-threshold forward on contiguous tensors (see :class:`_CppBNFire`):
    ``(spikes, mean, var, Wq, b)``, or None when the weight has NaN or inf (nothing computed, nothing
    updated). ``running``: ``(running_mean, running_var, factor)``, contiguous tensors like ``x``'s, to
    blend the batch mean and unbiased variance into, in place (as ``lerp_`` by ``factor``).
    ``given``: ``(mean, var)`` to fold instead of the batch statistics (eval mode: the running ones),
    returned as they are. ``geometry``: ``_geometry(x, k, dilation, layout)``, if the caller has it already."""
    c = weight.shape[0]
    out = torch.empty_like(x)  # (x is contiguous)
    mean, var = given if given is not None else (weight.new_empty(c), weight.new_empty(c))
    b, wq = weight.new_empty(c), torch.empty_like(weight)
    rm, rv, factor = running if running is not None else (None, None, 0.0)
    refused = getattr(library(x.dtype), f"mfpsn_bn_forward_{DTYPES[x.dtype]}")(  # data_ptr(): never None here
        x.data_ptr(), weight.data_ptr(), gamma.data_ptr(), beta.data_ptr(), float(eps), int(quantize),
        int(given is not None), out.data_ptr(), mean.data_ptr(), var.data_ptr(), wq.data_ptr(), b.data_ptr(),
        _ptr(rm), _ptr(rv), float(factor), *(geometry or _geometry(x, weight.shape[1], dilation, layout)))
    if refused:
        return None
    if running is not None:  # written through raw pointers: let autograd know, as an in-place op would
        increment_version(rm)  # (one tensor per call: older torch takes no list)
        increment_version(rv)
    return out, mean, var, wq, b


def bn_backward(x, weight, gamma, mean, var, wq, b, grad, kind, alpha, eps, ste, given, dilation, layout, need_gx,
                geometry=None):
    """Its backward on contiguous tensors: ``(dL/dX or None, dL/dweight, dL/dgamma, dL/dbeta)``; ``ste``
    0 (no quantiser), 1 (whole) or 2 (round); ``given``: the statistics were given (constants: no
    gradient through them)."""
    gx = torch.empty_like(x) if need_gx else None
    g_weight, g_gamma, g_beta = torch.empty_like(weight), torch.empty_like(gamma), torch.empty_like(gamma)
    getattr(library(x.dtype), f"mfpsn_bn_backward_{DTYPES[x.dtype]}")(
        x.data_ptr(), weight.data_ptr(), gamma.data_ptr(), mean.data_ptr(), var.data_ptr(), wq.data_ptr(),
        b.data_ptr(), grad.data_ptr(), kind, float(alpha), float(eps), ste, int(given), _ptr(gx),
        g_weight.data_ptr(), g_gamma.data_ptr(), g_beta.data_ptr(),
        *(geometry or _geometry(x, weight.shape[1], dilation, layout)))
    return gx, g_weight, g_gamma, g_beta


class _NonFiniteWeight(Exception):
    """The fused kernel refused weights with NaN or inf (the general path reports them)."""


_STE_CODES = {None: 0, "whole": 1, "round": 2}


def _bn_fire_forward(x, weight, gamma, beta, cfg, geometry=None):
    """:func:`bn_forward` of contiguous tensors with ``_CppBNFire``'s ``cfg``, no graph; raises
    ``_NonFiniteWeight`` where the kernel refused the weights."""
    eps, ste, dilation, layout, _, _, running, given = cfg
    result = bn_forward(x, weight, gamma, beta, eps, ste is not None, dilation, layout, running, geometry, given)
    if result is None:
        raise _NonFiniteWeight()
    return result


class _CppBNFire(torch.autograd.Function):
    """The forward of a BN-threshold neuron as one autograd node and one kernel call each way: the
    batch statistics of charge(X, W) (training) or the given ones (eval: the running statistics,
    constants), W and b folded from them (as ``reduce.fold_bn``) and quantised (as
    ``quantize.quantize_pow2_``), then the spikes.

    The backward call runs the spike kernel (dL/dX, dL/dWq, dL/db), the quantiser's and the folding's
    gradients in closed form, then the statistics' kernel, which adds its dL/dX to the spike kernel's in
    place: no second X-sized gradient, no per-channel autograd nodes. Only X and per-channel tensors are
    kept: X, W, gamma and the returned batch statistics saved (autograd checks them for in-place
    changes), Wq and b, which never leave the node, as ``ctx.folded``. ``cfg``:
    ``(eps, ste, dilation, layout, kind, alpha, running, given)``, one argument (``apply`` goes through
    every argument on each call). Returns ``(spikes, mean, var)``, or the spikes alone with ``given``
    statistics (saved too: changing them in place before the backward raises)."""

    @staticmethod
    def forward(ctx, x, weight, gamma, beta, cfg):
        eps, ste, dilation, layout, kind, alpha, running, given = cfg
        x, weight = x.contiguous(), weight.contiguous()  # (bn_fire lets only contiguous gamma, beta in)
        geometry = _geometry(x, weight.shape[1], dilation, layout)
        out, mean, var, wq, b = _bn_fire_forward(x, weight, gamma, beta, cfg, geometry)
        ctx.save_for_backward(x, weight, gamma, mean, var)
        ctx.folded = (wq, b)
        ctx.args = (kind, alpha, eps, _STE_CODES[ste], given is not None, dilation, layout)
        ctx.geometry = geometry
        if given is not None:
            return out
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)  # no zero tensors for mean and var (only the spikes carry a gradient)
        return out, mean, var

    @staticmethod
    def backward(ctx, grad, *_stats_grads):
        first_order_only("cpp")
        x, weight, gamma, mean, var = ctx.saved_tensors
        gx, g_weight, g_gamma, g_beta = bn_backward(x, weight, gamma, mean, var, *ctx.folded,
                                                    grad.to(x.dtype).contiguous(), *ctx.args,
                                                    ctx.needs_input_grad[0], ctx.geometry)
        return gx, g_weight, g_gamma, g_beta, None


# Custom ops: what torch.compile traces instead of the autograd Functions above.
@torch.library.custom_op("spikingjelly_mfpsn::cpp_charge", mutates_args=())
def _charge_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dilation: int, layout: str,
               kind: int, alpha: float) -> torch.Tensor:
    return _charge_fwd(x, weight, bias, dilation, layout, kind)


@_charge_op.register_fake
def _(x, weight, bias, dilation, layout, kind, alpha):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("spikingjelly_mfpsn::cpp_charge_backward", mutates_args=())
def _charge_backward_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], grad: torch.Tensor,
                        dilation: int, layout: str, kind: int, alpha: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gx, gw, gb = _charge_bwd(x, weight, bias, grad, dilation, layout, kind, alpha, (True, True, bias is not None))
    return gx, gw, gb if gb is not None else weight.new_zeros(weight.shape[0])


@_charge_backward_op.register_fake
def _(x, weight, bias, grad, dilation, layout, kind, alpha):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[0])


def _charge_op_setup(ctx, inputs, output):
    x, weight, bias, *args = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.args = args


def _charge_op_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb = _charge_backward_op(x, weight, bias, grad, *ctx.args)
    return gx, gw, gb if bias is not None else None, None, None, None, None


_charge_op.register_autograd(_charge_op_backward, setup_context=_charge_op_setup)


@torch.library.custom_op("spikingjelly_mfpsn::cpp_stats", mutates_args=())
def _stats_op(x: torch.Tensor, weight: torch.Tensor, dilation: int, layout: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _stats_fwd(x, weight, dilation, layout)


@_stats_op.register_fake
def _(x, weight, dilation, layout):
    return weight.new_empty(weight.shape[0]), weight.new_empty(weight.shape[0])


@torch.library.custom_op("spikingjelly_mfpsn::cpp_stats_backward", mutates_args=())
def _stats_backward_op(x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, g_mean: torch.Tensor,
                       g_var: torch.Tensor, dilation: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _stats_bwd(x, weight, mean, g_mean, g_var, dilation, layout, (True, True))


@_stats_backward_op.register_fake
def _(x, weight, mean, g_mean, g_var, dilation, layout):
    return torch.empty_like(x), torch.empty_like(weight)


def _stats_op_setup(ctx, inputs, output):
    x, weight, dilation, layout = inputs
    ctx.save_for_backward(x, weight, output[0])
    ctx.args = (dilation, layout)


def _stats_op_backward(ctx, g_mean, g_var):
    x, weight, mean = ctx.saved_tensors
    gx, gw = _stats_backward_op(x, weight, mean, *_stats_grads(mean, g_mean, g_var), *ctx.args)
    return gx, gw, None, None


_stats_op.register_autograd(_stats_op_backward, setup_context=_stats_op_setup)


# ---------------------------------------------------------------- registry entries
def _charge(x, weight, bias, dilation, layout, kind, alpha):
    if torch.compiler.is_compiling():
        return _charge_op(x, weight, bias, dilation, layout, kind, alpha)
    if not needs_grad(x, weight, bias):  # no graph to record: the kernel alone
        return _charge_fwd(x, weight, bias, dilation, layout, kind)
    return _CppCharge.apply(x, weight, bias, dilation, layout, kind, alpha)


def charge(x, weight, bias, dilation, layout):
    """Registry contract: H, dense, differentiable w.r.t. x, weight and bias."""
    return _charge(x, weight, bias, dilation, layout, 0, 0.0)


def fire(x, weight, bias, dilation, layout, code, alpha) -> torch.Tensor:
    """Registry contract: fused charge + Heaviside + the gradient of surrogate ``code``."""
    return _charge(x, weight, bias, dilation, layout, code, alpha)


def stats(x, weight, dilation, layout):
    if torch.compiler.is_compiling():
        return _stats_op(x, weight, dilation, layout)
    if not needs_grad(x, weight):
        return _stats_fwd(x, weight, dilation, layout)
    return _CppStats.apply(x, weight, dilation, layout)


def bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running=None, given=None):
    """Registry contract: ``(spikes, mean, var)`` in one autograd node, on any tensors (it checks them
    itself: ``checks_inputs``), or None where it cannot run them: through the C++ node, which checks every
    tensor (device, dtype, shapes, contiguity; see ``runnable`` in ``cpu/mfpsn_node.cpp``), or where no
    node builds, the Python autograd Function ``_CppBNFire`` after the same checks here; None as well
    for a folding with NaN or inf (the caller's general path reports it) and under torch.compile (which
    traces the separate custom ops). With no gradient to record the kernels run without a graph."""
    if torch.compiler.is_compiling() or x.dtype not in DTYPES:
        return None
    op = node(x.dtype)
    if op is None:
        return _bn_fire_python(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running, given)
    rm, rv, factor = running if running is not None else (None, None, 0.0)
    gm, gv = given if given is not None else (None, None)
    outs = op(x, weight, gamma, beta, rm, rv, gm, gv, float(eps), _STE_CODES[ste], dilation, layout == "time_last",
              code, alpha, factor)
    if not outs:
        return None
    return tuple(outs) if given is None else (outs[0], gm, gv)


def _bn_fire_python(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running, given):
    """:func:`bn_fire` where the node does not build: the same checks, then ``_CppBNFire``."""
    raw = (gamma, beta) + (() if running is None else running[:2]) + (() if given is None else tuple(given))
    try:
        check_charge_args(x, weight, None, dilation, layout)
    except (TypeError, ValueError):
        return None
    if not x.numel() or x.device.type != "cpu" or weight.dtype != x.dtype or any(  # read through raw pointers
            t.dtype != x.dtype or t.device != x.device or not t.is_contiguous() or tuple(t.shape) != (weight.shape[0],)
            for t in raw):
        return None
    cfg = (float(eps), ste, dilation, layout, code, alpha, running, given)
    try:
        if needs_grad(x, weight, gamma, beta):
            out = _CppBNFire.apply(x, weight, gamma, beta, cfg)
        else:  # no graph to record: the kernel alone
            out, mean, var, _, _ = _bn_fire_forward(x.contiguous(), weight.contiguous(), gamma, beta, cfg)
            out = out if given is not None else (out, mean, var)  # (as _CppBNFire returns)
    except _NonFiniteWeight:
        return None
    return out if given is None else (out, *given)


def step_fire(taps, weight, bias, bn, quantize) -> Optional[torch.Tensor]:
    """Registry contract: one single-step call's spikes in one kernel call, or None for a gradient to
    compute, tensors it cannot read raw (another device or dtype, not contiguous), weights with NaN or
    inf, or under torch.compile."""
    x = taps[-1]  # (the registry checked the shapes)
    gamma, beta, mean, var, eps = bn if bn is not None else (None, None, None, None, 0.0)
    tensors = [t for t in (weight, bias, gamma, beta, mean, var) if t is not None]
    inputs = [t for t in taps if t is not None]
    if torch.compiler.is_compiling() or needs_grad(*tensors, *inputs):
        return None
    if x.dtype not in DTYPES or x.device.type != "cpu" \
            or any(t.dtype != x.dtype or t.device != x.device or not t.is_contiguous() for t in tensors + inputs):
        return None
    n, c = x.shape[0], x.shape[1]
    out = torch.empty_like(x)
    refused = getattr(library(x.dtype), f"mfpsn_step_{DTYPES[x.dtype]}")(
        (ctypes.c_void_p * len(taps))(*[_ptr(t) for t in taps]), weight.data_ptr(), _ptr(gamma), _ptr(beta),
        _ptr(mean), _ptr(var), float(eps), int(quantize), _ptr(bias), out.data_ptr(), n, c, math.prod(x.shape[2:]),
        weight.shape[1], torch.get_num_threads())
    return None if refused else out


IMPLEMENTATION = Implementation(
    "cpp", "cpp", LAYOUTS, charge, "fused C++/OpenMP CPU kernels: charge, spike and batch statistics",
    devices=("cpu",), dtypes=tuple(DTYPES), reads_lower_precision=False, priority=lambda device, k, t: -1,
    fire=fire, stats=stats, bn_fire=bn_fire, step_fire=step_fire, checks_inputs=True)


def register_if_available() -> Optional[str]:
    """Register ``'cpp'`` when a compiler exists; otherwise record why not. Returns that reason."""
    reason = None
    if not SOURCE_FILE.is_file():
        reason = (f"its kernels' source {SOURCE_FILE.name} is missing from this installation of "
                  f"spikingjelly_mfpsn (reinstall the package)")
    elif compiler() is None:
        reason = "no C++ compiler found (set $CXX or install g++ or clang++)"
    if reason is not None:
        note_unavailable("cpp", reason)
        return reason
    register(IMPLEMENTATION)
    return None


register_if_available()
