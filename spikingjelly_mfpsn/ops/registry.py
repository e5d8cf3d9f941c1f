"""One registry of interchangeable implementations of the MF-PSN charge.

The charge is a causal, dilated, channel-wise (depthwise) convolution along time::

    H[t, c] = sum_{i=0..k-1} W[c, i] * X[t - (k-1-i)*d, c]  (+ b[c]),   X[t < 0] = 0

Every implementation obeys one contract, ``charge(x, weight, bias, dilation, layout) -> h``:

* ``x``: time-first ``(T, N, C, ...)`` or time-last ``(N, C, ..., T)`` (``layout``), any strides;
* ``weight``: ``(C, k)``, already quantised if quantisation is on; ``bias``: ``(C,)`` or ``None``;
* returns ``H``, a new contiguous tensor of ``x``'s shape, differentiable w.r.t. ``x``, ``weight`` and
  ``bias``.

and declares what it supports and which fused steps it has (:class:`Implementation`); the dispatcher
of ``method='auto'`` (:func:`choose`) reads those declarations, and :mod:`.core` runs the call.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch



LAYOUTS = ("time_first", "time_last")


def check_layout(layout: str) -> str:
    """Check that ``layout`` is one of :data:`LAYOUTS`.

    Args:
        layout: ``'time_first'`` or ``'time_last'``.

    Returns:
        ``layout`` itself.

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def time_dim(layout: str) -> int:
    """Index of the time axis of a multi-step tensor in ``layout``."""
    return 0 if check_layout(layout) == "time_first" else -1


def channel_dim(layout: str) -> int:
    """Index of the channel axis of a multi-step tensor in ``layout``."""
    return 2 if check_layout(layout) == "time_first" else 1


def channel_view_shape(ndim: int, layout: str) -> list[int]:
    """Shape that broadcasts a ``(C,)`` vector along the channel axis of an ``ndim`` tensor."""
    shape = [1] * ndim
    shape[channel_dim(layout)] = -1
    return shape


def tap_schedule(t_len: int, k: int, dilation: int, start: int = 0):
    """The taps of the charge that matter for output steps ``[start, t_len)``.

    Yields ``(i, lag, first)`` for every tap ``i`` (it reads ``X[t - lag]``, ``lag = (k-1-i)*d``) that
    falls inside the sequence for at least one of those steps; it contributes to output steps
    ``[first, t_len)``, ``first = max(start, lag)``.
    """
    for i in range(k):
        lag = (k - 1 - i) * dilation
        first = max(start, lag)
        if first < t_len:
            yield i, lag, first


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a call on these tensors (None entries ignored): else an implementation
    may skip its autograd Function, whose call alone is a cost at small shapes."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # (a loop: a generator costs about as much as the rest)
        if t is not None and t.requires_grad:
            return True
    return False


def _no_priority(device_type: str, k: int, t: int) -> float:
    return 0


@dataclass(frozen=True)
class Implementation:
    """One way of computing the charge, and what it supports, as data.

    ``charge(x, weight, bias, dilation, layout) -> h`` does the work. What it takes: ``layouts``,
    ``devices`` (device types; None: any), ``dtypes`` (of x and weight; None: any floating dtype) and
    ``reads_lower_precision`` (an x of lower precision than the weight, else x is promoted first);
    ``requirements`` optionally adds reasons it cannot run a call (a size limit). ``priority(device_type,
    k, T)``: ``method='auto'`` runs the supported implementation of the highest priority, those below 0
    only when their backend is chosen. Optional fused entries, each taking plain tensors and numbers
    (the surrogate as its code and alpha from :mod:`.surrogate`, only for a surrogate of the table) and
    returning None where it does not run a call (the general path then does):

    * ``fire(x, weight, bias, dilation, layout, code, alpha)``: the spikes of the charge;
    * ``stats(x, weight, dilation, layout)``: ``(mean, biased var)`` of the bias-free charge, not written;
    * ``bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running, given)``: a
      BN-threshold step, see :func:`.core.mf_psn`; with ``fuses_input_bn``, also given
      ``input_bn=(gamma0, beta0, eps0, running0, given0)``, a batch norm of X in front of the neuron;
      ``checks_inputs``: it checks every tensor itself,
      so it is tried before any check in Python (a small layer's step spends as long in those as in
      its kernels);
    * ``param_fire(x, weight, v_threshold, ste, dilation, layout, code, alpha)``: a parameter-threshold step;
    * ``step_fire(taps, weight, bias, bn, quantize)``: one single step without gradients.
    """

    name: str
    backend: str
    layouts: tuple[str, ...]
    charge: Callable[..., torch.Tensor]
    description: str = ""
    requirements: Optional[Callable[..., list[str]]] = field(default=None, compare=False)
    fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)
    stats: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = field(default=None, compare=False)
    bn_fire: Optional[Callable[..., Optional[tuple]]] = field(default=None, compare=False)
    step_fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)
    param_fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)
    devices: Optional[tuple[str, ...]] = None
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    reads_lower_precision: bool = True
    priority: Callable[[str, int, int], float] = field(default=_no_priority, compare=False)
    checks_inputs: bool = False
    fuses_input_bn: bool = False
    autoselect: bool = True  # False: never a candidate of an autoselect pass (e.g. an emulated backend)
    compiles: bool = True  # False: under torch.compile, method='auto' takes the implementations the compiler
    # traces and fuses first (CuPy's launches run eagerly between graphs; Triton's steps run as opaque
    # operators, which made the Table 10 network's compiled step slower than inductor's fusion of the torch path)

    def not_supported_reasons(self, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                              layout: str) -> list[str]:
        reasons = []
        if layout not in self.layouts:
            reasons.append(f"{self.name} supports layouts {self.layouts}, not {layout!r}")
        if self.devices is not None and x.device.type not in self.devices:
            reasons.append(f"{self.name} runs on {' or '.join(d.upper() for d in self.devices)} device tensors only "
                           f"(x is on {x.device})")
        if self.backend != "torch" and weight.device != x.device:  # (a torch op says so itself)
            reasons.append(f"{self.name} needs the weight on x's device {x.device}, got {weight.device}")
        for name, t in (("x", x), ("weight", weight)):
            if self.dtypes is not None and t.dtype not in self.dtypes:
                reasons.append(f"{self.name} supports {name} dtypes {[str(d) for d in self.dtypes]}, got {t.dtype}")
        if not self.reads_lower_precision and x.dtype != weight.dtype:
            reasons.append(f"{self.name} needs x in the weight's dtype {weight.dtype}, got {x.dtype}")
        if self.requirements is not None:
            reasons.extend(self.requirements(x, weight, dilation, layout))
        return reasons

    def supports(self, x, weight, dilation, layout) -> bool:
        return not self.not_supported_reasons(x, weight, dilation, layout)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              dilation: int, layout: str) -> torch.Tensor:
        return self.charge(x, weight, bias, dilation, layout)

    @property
    def capabilities(self) -> dict:
        """What it supports, for a table: layouts, devices, dtypes and its fused entries."""
        fused = [e for e in ("fire", "stats", "bn_fire", "param_fire", "step_fire") if getattr(self, e) is not None]
        return {"layouts": self.layouts, "devices": self.devices or "any",
                "dtypes": [str(d).replace("torch.", "") for d in self.dtypes] if self.dtypes else "any float",
                "fused": fused}


_REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` to the registry (re-registering the same name replaces it); its backend is available."""
    _REGISTRY[impl.name] = impl
    _UNAVAILABLE_REASONS.pop(impl.backend, None)
    return impl


def unregister(name: str) -> Optional[Implementation]:
    """Remove the implementation registered as ``name`` (e.g. one a test registered); returns it, or None."""
    return _REGISTRY.pop(name, None)


@functools.lru_cache(maxsize=256)
def _ranked(registered: tuple, backend: str, device_type: str, k: int, t: int) -> tuple[Implementation, ...]:
    """What ``method='auto'`` tries, in order: the backend's implementations (for 'torch', every one of
    priority >= 0), highest priority first (registration order among equals). ``registered``: the ids
    of the registered implementations, so that a change of the registry is a new key."""
    pool = [impl for impl in _REGISTRY.values() if impl.backend == backend
            or (backend == "torch" and impl.priority(device_type, k, t) >= 0)]
    return tuple(sorted(pool, key=lambda impl: -impl.priority(device_type, k, t)))


def choose(x: torch.Tensor, weight: torch.Tensor, dilation: int, layout: str, backend: str = "torch") -> str:
    """The implementation ``method='auto'`` runs for this call (before any autoselect pass).

    That is the supported one of the highest priority (see :class:`Implementation`) among ``backend``'s,
    where backend 'torch' (the default) also takes the kernel backends of priority >= 0 (Triton and CuPy on
    CUDA). Under torch.compile the implementations it can trace come first.
    """
    rank = _ranked.__wrapped__ if torch.compiler.is_compiling() else _ranked  # (dynamo traces no cache)
    ranked = rank(tuple(map(id, _REGISTRY.values())), backend, x.device.type, weight.shape[-1],
                  x.shape[time_dim(layout)] if x.dim() else 0)
    if torch.compiler.is_compiling():  # what the compiler can trace (and fuse) first
        ranked = [impl for impl in ranked if impl.compiles] + [impl for impl in ranked if not impl.compiles]
    for impl in ranked:
        if impl.supports(x, weight, dilation, layout):
            return impl.name
    if ranked:  # none runs this call as it is (e.g. an input to promote): the first says why, if it must
        return ranked[0].name
    if not backend_available(backend):
        raise not_here(backend)
    raise ValueError(f"backend {backend!r} has no implementation for layout {layout!r}")


def get(name: str) -> Implementation:
    """The implementation registered as ``name``.

    Args:
        name: an implementation name (not ``'auto'``).

    Returns:
        The registered :class:`Implementation`.

    Raises:
        ValueError: no implementation is registered as ``name``; for a kernel backend's that does not run
            here, the error of :func:`not_here`.
    """
    impl = _REGISTRY.get(name)
    if impl is not None:
        return impl
    if name in BACKEND_LIBRARIES:  # a kernel backend's implementation (named as its backend), not here
        raise not_here(name)
    if name == "auto":
        raise ValueError("'auto' is not an implementation: ops.choose(x, weight, dilation, layout) resolves it")
    raise ValueError(f"method must be one of {sorted(_REGISTRY)} (or 'auto'), got {name!r}")


class BackendUnavailableError(ImportError, ValueError):
    """A backend (or a method of one) asked for where it does not run.

    Its package is missing, or it has nothing to run on. Both an ``ImportError`` and a ``ValueError``,
    whichever way it was asked for."""


def not_here(backend: str) -> BackendUnavailableError:
    """The error for a neuron set to a kernel backend that does not run here.

    This happens e.g. in a network saved on a machine where the backend ran. The error says why, and the
    way back to the methods that do run.
    """
    why = _UNAVAILABLE_REASONS.get(backend) or "its backend is not available"
    hint = _INSTALL_HINTS.get(backend)
    why += f" ({hint})" if hint and "not installed" in why else ""
    return BackendUnavailableError(
        f"method {backend!r} cannot run here: {why}. Here the methods are {sorted(_REGISTRY)}; a network saved "
        f"where it ran switches with functional.set_backend(net, 'torch') (its method 'auto' picks among the "
        f"methods of backend {backend!r})")


def find(name: str) -> Optional[Implementation]:
    """The implementation registered as ``name`` here, or None.

    None e.g. for a kernel backend's, in a network saved on a machine where that backend ran.
    """
    return _REGISTRY.get(name)


def names(layout: Optional[str] = None, backend: Optional[str] = None) -> list[str]:
    """Registered implementation names, optionally only those for ``layout`` and ``backend``."""
    return [n for n, impl in _REGISTRY.items()
            if (layout is None or layout in impl.layouts) and (backend is None or impl.backend == backend)]


def candidate_names(layout: str) -> list[str]:
    """Implementations an autoselect pass may time for ``layout``.

    Every available backend's, except those that run emulated here (e.g. Triton's interpreter).
    """
    return [n for n in names(layout=layout)
            if _REGISTRY[n].autoselect and backend_available(_REGISTRY[n].backend)]


def implementations() -> list[Implementation]:
    """Every registered implementation, in registration order.

    Returns:
        A new list of the registered :class:`Implementation` objects.
    """
    return list(_REGISTRY.values())


def supported(x: torch.Tensor, weight: torch.Tensor, dilation: int, layout: str,
              backend: Optional[str] = None, candidates: Optional[Sequence[str]] = None) -> list[str]:
    """Names of the implementations that can run this call."""
    pool = candidates if candidates is not None else names(backend=backend)
    return [n for n in pool if get(n).supports(x, weight, dilation, layout)]


def input_dtype_error(x_dtype: torch.dtype, param_dtype: torch.dtype, what: str = "the weight") -> Optional[TypeError]:
    """The error for an input of ``x_dtype`` against parameters of ``param_dtype``, or None where it runs.

    An input must be floating point; one of lower precision than the parameters (e.g. float16 under
    autocast) is computed in the parameters' dtype, one of higher precision is refused, as torch.nn
    layers refuse mixed dtypes: promoting the call would silently change the precision (and the
    output's dtype) of the network."""
    if not x_dtype.is_floating_point:
        hint = ("an unsigned integer type (e.g. image bytes: x.float() / 255)" if x_dtype == torch.uint8
                or str(x_dtype).startswith("torch.uint") else "spikes as input? x.float()" if x_dtype == torch.bool
                else "x.float()")
        return TypeError(f"x must be a floating-point tensor ({what} has dtype {param_dtype}), got {x_dtype}: "
                         f"{hint}")
    if torch.promote_types(x_dtype, param_dtype) != param_dtype:
        return TypeError(f"x has dtype {x_dtype} but {what} has dtype {param_dtype}: convert the input (x.to({param_dtype})) "
                         f"or the parameters (e.g. net.to({x_dtype})); mixed dtypes are not promoted, as in "
                         f"torch.nn layers")
    return None


def check_charge_args(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      dilation: int, layout: str) -> None:
    """Validate a charge call.

    Raises:
        ValueError: names the offending argument.
        TypeError: for a dtype (see :func:`input_dtype_error`; the weight and bias share one floating
            dtype).
    """
    check_layout(layout)
    check_dense(x)
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight on {weight.device}: move them to one device")
    if not weight.is_floating_point() or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"weight and bias must share one floating-point dtype, got weight {weight.dtype}"
                        f"{'' if bias is None else f' and bias {bias.dtype}'}")
    bad_dtype = input_dtype_error(x.dtype, weight.dtype)
    if bad_dtype is not None:
        raise bad_dtype
    if x.dim() < 3:
        raise ValueError(f"x must have at least 3 dims ({'(T, N, C, ...)' if layout == 'time_first' else '(N, C, ..., T)'}), "
                         f"got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape (C, k) with k >= 1, got {tuple(weight.shape)}")
    c = x.shape[channel_dim(layout)]
    if weight.shape[0] != c:
        raise ValueError(f"weight has {weight.shape[0]} channels but x has {c} on its channel dim "
                         f"({channel_dim(layout)}) for layout {layout!r}")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"bias must have shape ({c},), got {tuple(bias.shape)}")
    check_dilation(dilation)


def check_dense(x: torch.Tensor, name: str = "x") -> None:
    """TypeError unless ``x`` is a dense (strided) tensor: no method takes a sparse one."""
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {x.layout}: {name}.to_dense()")


def check_dilation(dilation) -> int:
    """``dilation`` itself, or ValueError unless it is an int >= 1."""
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")
    return dilation


# Backends and the library each needs; an implementation's ``backend`` is one of these names.
BACKEND_LIBRARIES = {"torch": None, "triton": "triton", "cupy": "cupy", "cpp": None}
_INSTALL_HINTS = {"triton": "pip install triton (its kernels need a CUDA device, or TRITON_INTERPRET=1 on the CPU)",
                  "cupy": "pip install cupy-cuda12x (needs a CUDA device)"}


# Why a backend registered no implementation although its library imports (e.g. no CUDA device).
_UNAVAILABLE_REASONS: dict[str, str] = {}


def first_order_only(backend: str) -> None:
    """Called first in a kernel backend's backward: with ``create_graph=True`` (a gradient penalty, a
    Hessian-vector product, meta-learning) the kernels' gradients would enter the graph as constants,
    and second-order gradients would silently miss this layer's part; so that raises instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"backend {backend!r} computes first-order gradients only, and this backward runs "
                           f"with create_graph=True (a double backward); use a torch method for it, e.g. "
                           f"method='shift_add' (the same results and first-order gradients)")


def note_unavailable(backend: str, reason: str) -> None:
    """Record why ``backend`` registered nothing; :func:`check_backend` puts it in its error."""
    _UNAVAILABLE_REASONS[backend] = reason


def _backends() -> tuple:
    """The known backends: those of :data:`BACKEND_LIBRARIES`, then those only registered implementations name."""
    extra = {impl.backend: None for impl in _REGISTRY.values() if impl.backend not in BACKEND_LIBRARIES}
    return tuple(BACKEND_LIBRARIES) + tuple(extra)


def known_backend(backend: str) -> str:
    """``backend``, or ValueError unless it is built in or named by a registered implementation (whether it
    runs here is not checked: :func:`check_backend`)."""
    if not isinstance(backend, str) or backend not in BACKEND_LIBRARIES and backend not in _backends():
        raise ValueError(f"backend must be one of {_backends()}, got {backend!r}")
    return backend


def check_backend(backend: str) -> str:
    """Raise a clear error unless ``backend`` is known and its library imports.

    Known: built in, or named by a registered implementation."""
    known_backend(backend)
    if backend not in BACKEND_LIBRARIES:
        return backend
    if not backend_available(backend):
        import importlib.util
        lib = BACKEND_LIBRARIES[backend]
        if lib is not None and importlib.util.find_spec(lib) is None:
            raise BackendUnavailableError(f"backend={backend!r} needs the {lib} package, which "
                                          f"does not import here: {_INSTALL_HINTS.get(backend, '')}")
        raise BackendUnavailableError(f"backend={backend!r} cannot run here: "
                                      f"{_UNAVAILABLE_REASONS.get(backend, 'it registered no implementation')}")
    return backend


def backend_available(backend: str) -> bool:
    """Whether ``backend`` runs here.

    Args:
        backend: a backend name (the known ones are the keys of :data:`BACKEND_LIBRARIES`).

    Returns:
        True for ``'torch'``; for another known backend, True when its library (if it needs one) imports
        and it registered at least one implementation; for another name, whether a registered implementation
        names it as its backend.
    """
    if backend not in BACKEND_LIBRARIES:
        return any(impl.backend == backend for impl in _REGISTRY.values())
    if backend == "torch":
        return True
    lib = BACKEND_LIBRARIES[backend]
    return (lib is None or _importable(lib)) and any(impl.backend == backend for impl in _REGISTRY.values())


@torch.compiler.assume_constant_result
def _importable(lib: str) -> bool:
    """Whether ``lib`` can be imported: a constant to torch.compile, whose dynamo (torch 2.11) does not trace
    ``importlib.util.find_spec`` and broke the graph at every neuron with a kernel backend. An imported module
    first (find_spec's own first step, without its lookups: a kernel backend's step asks at every call)."""
    if sys.modules.get(lib) is not None:
        return True
    import importlib.util
    return importlib.util.find_spec(lib) is not None


def available_backends() -> tuple[str, ...]:
    """The backends installed here, each with an implementation registered (see :func:`backend_available`).

    Whether one runs a given tensor (e.g. Triton's kernels need a CUDA tensor, or ``TRITON_INTERPRET=1``)
    is decided per call, with an error naming the reason.

    Returns:
        Their names, in the order of :data:`BACKEND_LIBRARIES`, then those of registered implementations.
    """
    return tuple(b for b in _backends() if backend_available(b))
