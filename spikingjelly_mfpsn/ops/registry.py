"""One registry of interchangeable implementations of the MF-PSN charge.

The charge is a causal, dilated, channel-wise (depthwise) convolution along time::

    H[t, c] = sum_{i=0..k-1} W[c, i] * X[t - (k-1-i)*d, c]  (+ b[c]),   X[t < 0] = 0

Every implementation obeys one contract, :meth:`Implementation.apply`:

* ``x``: time-first ``(T, N, C, ...)`` or time-last ``(N, C, ..., T)`` (``layout``), any strides;
* ``weight``: ``(C, k)``, already quantised if quantisation is on; ``bias``: ``(C,)`` or ``None``;
* returns ``H``, a new contiguous tensor of ``x``'s shape, differentiable w.r.t. ``x``, ``weight`` and
  ``bias``.

An implementation may also fuse the spike: ``fire(x, weight, bias, dilation, layout, surrogate_function)``
returns ``surrogate_function(H)`` (same values and gradients) or ``None`` when it cannot fuse that call;
:func:`fire` then falls back to the surrogate module applied to the charge.

An implementation may also fuse the batch statistics of the bias-free charge: ``stats(x, weight,
dilation, layout)`` returns the per-channel ``(mean, biased variance)`` of ``H`` without writing ``H``
(same values and gradients as :func:`~spikingjelly_mfpsn.ops.reduce.batch_stats` of the charge).
And it may run a BN-threshold neuron's whole forward in one step, ``bn_fire`` (see
:func:`bn_fire`), or a parameter-threshold one's, ``param_fire`` (see :func:`param_fire`), or return
``None`` to leave it to the general path; ``bn_fire_direct`` is the same
step for callers that check nothing (see :func:`bn_fire_direct`): it must check every tensor itself.

An implementation says what it cannot do through :meth:`Implementation.not_supported_reasons`, which
returns human-readable reasons (empty when it supports the call).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from . import reduce

LAYOUTS = ("time_first", "time_last")


def check_layout(layout: str) -> str:
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


# Surrogates that fused kernels reproduce exactly (kernel code per SpikingJelly class name).
SURROGATE_KINDS = {"ATan": 1, "Sigmoid": 2}
_SURROGATE_TYPES: dict = {}  # SpikingJelly's class -> kernel code, filled at the first call


def surrogate_kind(surrogate_function) -> int:
    """Kernel code of a surrogate a fused charge + spike reproduces exactly, else 0.

    Only SpikingJelly's own ``ATan``/``Sigmoid`` (exact type, spiking mode, float alpha, no hooks):
    a subclass or a hooked module may behave differently, so it takes the unfused path.
    """
    if not _SURROGATE_TYPES:
        from .._compat import surrogate
        _SURROGATE_TYPES.update({getattr(surrogate, name): kind for name, kind in SURROGATE_KINDS.items()})
    kind = _SURROGATE_TYPES.get(type(surrogate_function), 0)
    if not kind or not getattr(surrogate_function, "spiking", False) \
            or not isinstance(surrogate_function.alpha, (int, float)):
        return 0
    if surrogate_function._forward_hooks or surrogate_function._forward_pre_hooks:
        return 0
    return kind


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a call on these tensors (None entries ignored): else an implementation
    may skip its autograd Function, whose call alone costs about 10 us."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # (a loop: a generator costs about as much as the rest)
        if t is not None and t.requires_grad:
            return True
    return False


@dataclass(frozen=True)
class Implementation:
    """One way of computing the charge.

    ``fn(x, weight, bias, dilation, layout) -> h`` does the work; ``layouts`` lists the layouts it
    accepts; ``requirements`` is an optional function returning extra reasons it cannot run a call
    (device, dtype, size, missing library); ``fire`` is an optional fused charge + spike, ``stats`` an
    optional fused charge + batch statistics, ``bn_fire`` an optional whole forward of a
    BN-threshold neuron (see :func:`bn_fire`) and ``step_fire`` an optional single step without
    gradients (see :func:`step_fire`).
    """

    name: str
    backend: str
    layouts: tuple[str, ...]
    fn: Callable[..., torch.Tensor]
    description: str = ""
    requirements: Optional[Callable[..., list[str]]] = field(default=None, compare=False)
    fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)
    stats: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = field(default=None, compare=False)
    bn_fire: Optional[Callable[..., Optional[tuple]]] = field(default=None, compare=False)
    step_fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)
    autoselect: bool = True  # False: never a candidate of an autoselect pass (e.g. an emulated backend)
    # Optional: bn_fire for callers that skip every check (see :func:`bn_fire_direct`).
    bn_fire_direct: Optional[Callable[..., Optional[tuple]]] = field(default=None, compare=False)
    # Optional: a parameter-threshold neuron's whole forward (see :func:`param_fire`).
    param_fire: Optional[Callable[..., Optional[torch.Tensor]]] = field(default=None, compare=False)

    def not_supported_reasons(self, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                              layout: str) -> list[str]:
        reasons = []
        if layout not in self.layouts:
            reasons.append(f"{self.name} supports layouts {self.layouts}, not {layout!r}")
        if self.requirements is not None:
            reasons.extend(self.requirements(x, weight, dilation, layout))
        return reasons

    def supports(self, x, weight, dilation, layout) -> bool:
        return not self.not_supported_reasons(x, weight, dilation, layout)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              dilation: int, layout: str) -> torch.Tensor:
        return self.fn(x, weight, bias, dilation, layout)


_REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` to the registry (re-registering the same name replaces it)."""
    _REGISTRY[impl.name] = impl
    return impl


def get(name: str) -> Implementation:
    impl = _REGISTRY.get(name)
    if impl is not None:
        return impl
    if name in BACKEND_LIBRARIES:  # a kernel backend's implementation (named as its backend), not here
        raise not_here(name)
    raise ValueError(f"method must be one of {sorted(_REGISTRY)} (or 'auto'), got {name!r}")


def not_here(backend: str) -> ValueError:
    """The error for a neuron set to a kernel backend that does not run here (e.g. in a network saved
    on a machine where it ran): why, and the way back to the methods that do."""
    why = _UNAVAILABLE_REASONS.get(backend) or _INSTALL_HINTS.get(backend, "its backend is not available")
    return ValueError(f"method {backend!r} cannot run here: {why}. Here the methods are {sorted(_REGISTRY)}; a "
                      f"network saved where it ran switches with functional.set_backend(net, 'torch') or "
                      f"set_method(net, 'auto')")


def find(name: str) -> Optional[Implementation]:
    """The implementation registered as ``name`` here, or None (e.g. a kernel backend's, in a network
    saved on a machine where that backend ran)."""
    return _REGISTRY.get(name)


def names(layout: Optional[str] = None, backend: Optional[str] = None) -> list[str]:
    """Registered implementation names, optionally only those for ``layout`` and ``backend``."""
    return [n for n, impl in _REGISTRY.items()
            if (layout is None or layout in impl.layouts) and (backend is None or impl.backend == backend)]


def candidate_names(layout: str) -> list[str]:
    """Implementations an autoselect pass may time for ``layout``: every available backend's, except
    those that run emulated here (e.g. Triton's interpreter)."""
    return [n for n in names(layout=layout)
            if _REGISTRY[n].autoselect and backend_available(_REGISTRY[n].backend)]


def implementations() -> list[Implementation]:
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
    """Validate a charge call; raises ``ValueError`` naming the offending argument (``TypeError`` for a
    dtype: see :func:`input_dtype_error`; the weight and bias share one floating dtype)."""
    check_layout(layout)
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
    if not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")


# Runs an empty input (no samples, features or steps) for every method: each of its ops takes empty
# tensors, while reshapes to (N, C, -1, T) or convolutions over zero steps do not.
EMPTY_INPUT_METHOD = "shift_add"


def _checked(x, weight, bias, dilation, layout, method) -> tuple[Implementation, torch.Tensor]:
    """The implementation that runs a validated call, and ``x`` as it reads it: an input of lower precision
    than the weight in the weight's dtype unless the implementation reads it as it is (e.g. Triton)."""
    check_charge_args(x, weight, bias, dilation, layout)
    impl = get(method)
    if x.dtype != weight.dtype and not impl.supports(x, weight, dilation, layout):
        x = x.to(weight.dtype)
    reasons = impl.not_supported_reasons(x, weight, dilation, layout)
    if reasons:
        others = supported(x, weight, dilation, layout)
        raise ValueError(f"method {method!r} cannot run this input: {'; '.join(reasons)}. "
                         f"Methods that can: {others}")
    return (impl if x.numel() else get(EMPTY_INPUT_METHOD)), x


def _in_weight_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` in the weight's dtype (a checked call's ``x`` has it or a lower precision)."""
    return x if x.dtype == weight.dtype else x.to(weight.dtype)


def charge(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dilation: int,
           layout: str, method: str) -> torch.Tensor:
    """Run the named implementation after validating the call (an input of lower precision than the
    weight is computed in the weight's dtype)."""
    impl, x = _checked(x, weight, bias, dilation, layout, method)
    return impl.apply(_in_weight_dtype(x, weight), weight, bias, dilation, layout)


def fire(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dilation: int,
         layout: str, method: str, surrogate_function) -> torch.Tensor:
    """``surrogate_function(charge(...))``, through the implementation's fused kernel when it has one."""
    impl, x = _checked(x, weight, bias, dilation, layout, method)
    if impl.fire is not None:
        s = impl.fire(x, weight, bias, dilation, layout, surrogate_function)
        if s is not None:
            return s
    x = _in_weight_dtype(x, weight)
    h = exact_where_overflowed(impl.apply(x, weight, bias, dilation, layout), lambda: impl.apply(
        x.double(), weight.double(), None if bias is None else bias.double(), dilation, layout))
    if not h.requires_grad and surrogate_kind(surrogate_function) and not torch.compiler.is_compiling() \
            and h.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        # No backward to come: SpikingJelly's spiking forward, Theta(H), without its Function, in place in
        # H (never in the input, should a registered implementation hand back a view of it). Eager only:
        # a compiled graph fuses the surrogate's forward anyway, and dynamo cannot trace storage pointers.
        return h.ge_(0)
    return surrogate_function(h)


def exact_where_overflowed(h: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``h`` where it is finite; where a charge narrower than float64 is not (a sum that overflowed on the
    way or in the end, or a NaN or inf input), the float64 charge ``exact()`` of the same inputs, cast
    back (beyond the dtype's range: the infinity of its sign). So a spike is the sign of the exact sum
    whatever order an implementation adds in, as the fused kernels do too. Eager only (a data-dependent
    branch); the check is one read of ``h`` (a float64 sum: no sum of finite float32 values overflows it)."""
    if h.dtype == torch.float64 or torch.compiler.is_compiling() or bool(h.sum(dtype=torch.float64).isfinite()):
        return h
    return torch.where(torch.isfinite(h), h, exact().to(h.dtype))


def batch_stats(x: torch.Tensor, weight: torch.Tensor, dilation: int, layout: str,
                method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased var)`` of the bias-free charge, through the fused kernel when there is one."""
    impl, x = _checked(x, weight, None, dilation, layout, method)
    if impl.stats is not None:
        return impl.stats(x, weight, dilation, layout)
    x = _in_weight_dtype(x, weight)
    return reduce.batch_stats(impl.apply(x, weight, None, dilation, layout), channel_dim(layout))


def bn_fire(x: torch.Tensor, weight: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
            ste: Optional[str], dilation: int, layout: str, method: str, surrogate_function,
            running: Optional[tuple] = None, given: Optional[tuple] = None) -> Optional[tuple]:
    """The forward of a BN-threshold neuron as one fused step, or None where the implementation has none
    (or not for this surrogate), and for weights with NaN or inf, which the caller's general path
    reports: ``(spikes, mean, var)`` with ``spikes`` differentiable w.r.t. x, weight, gamma and beta and
    the batch statistics ``mean, var`` (biased) of the bias-free charge. The same math as
    ``batch_stats``, then ``reduce.fold_bn``, ``Q`` with ``ste`` (None: no quantisation), then ``fire``.
    ``running``: ``(running_mean, running_var, factor)``; when the step runs (not when it returns None),
    the batch mean and unbiased variance are blended into them in place, as ``r.lerp_(stat, factor)``.
    ``given``: ``(mean, var)`` folded instead of the batch statistics (eval mode: the running ones), as
    constants (no gradient through them), and returned as they are."""
    if get(method).bn_fire is None or not x.numel():  # nothing to check: the caller takes the general path
        return None
    impl, x = _checked(x, weight, None, dilation, layout, method)
    return impl.bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, surrogate_function, running, given)


def param_fire(x: torch.Tensor, weight: torch.Tensor, v_threshold: torch.Tensor, ste: Optional[str], dilation: int,
               layout: str, method: str, surrogate_function) -> Optional[torch.Tensor]:
    """The forward of a parameter-threshold neuron as one fused step, or None where the implementation has
    none (or not for this call, e.g. NaN or inf in the weight or threshold, which the caller's general
    path reports): the spikes ``Theta(charge(x, Q(weight)) - v_threshold)``, differentiable w.r.t. x,
    weight and v_threshold, ``Q`` with ``ste`` (None: no quantisation). The same math as
    ``quantize.quantize``, then ``fire``."""
    if get(method).param_fire is None or not x.numel():
        return None
    impl, x = _checked(x, weight, None, dilation, layout, method)
    return impl.param_fire(x, weight, v_threshold, ste, dilation, layout, surrogate_function)


def has_bn_fire_direct(method: str) -> bool:
    """Whether ``method`` names an implementation with a ``bn_fire_direct`` (see :func:`bn_fire_direct`)."""
    impl = _REGISTRY.get(method)
    return impl is not None and impl.bn_fire_direct is not None


def bn_fire_direct(x: torch.Tensor, weight: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
                   ste: Optional[str], dilation: int, layout: str, method: str, surrogate_function,
                   running: Optional[tuple] = None, given: Optional[tuple] = None) -> Optional[tuple]:
    """:func:`bn_fire` without the checks of this module or of the caller: through an implementation whose
    ``bn_fire_direct`` checks every tensor itself and runs nothing it cannot take (returning None), so any
    tensors are safe; None as well for a method without one, which the caller's checked path then runs.
    A neuron's hot path: a training step of a small layer spends about as long in Python checks as in
    its kernels."""
    impl = _REGISTRY.get(method)
    run = impl.bn_fire_direct if impl is not None else None
    return None if run is None else run(x, weight, gamma, beta, eps, ste, dilation, layout, surrogate_function,
                                        running, given)


def step_fire(taps: list, weight: torch.Tensor, bias: Optional[torch.Tensor], bn: Optional[tuple], quantize: bool,
              method: str, surrogate_function) -> Optional[torch.Tensor]:
    """One step of a neuron with no gradient to compute (inference), fused: the spikes
    ``Theta(sum_i Wq[:, i] * taps[i] + b)`` of single-step inputs ``(N, C, ...)``, ``taps[i]`` the
    input tap i reads ((k-1-i)*d steps back) or None before the first step. ``bn``:
    ``(gamma, beta, mean, var, eps)``, folded as ``reduce.fold_bn`` does (then ``bias`` is None), or
    None: ``Wq`` from ``weight`` and ``bias`` as given. ``Wq`` quantised as ``quantize.quantize_pow2_``
    when ``quantize``. None where the implementation has no such kernel, or not for this call (a
    gradient to compute, another surrogate, dtype or device, NaN or inf weights): the caller's general
    path runs (and reports bad weights)."""
    impl = get(method)
    if impl.step_fire is None:
        return None
    _check_step_args(taps, weight, bias, bn)
    return impl.step_fire(taps, weight, bias, bn, quantize, surrogate_function)


def _check_step_args(taps: list, weight: torch.Tensor, bias: Optional[torch.Tensor], bn: Optional[tuple]) -> None:
    """Validate a :func:`step_fire` call; raises ``ValueError`` naming the offending argument."""
    inputs = [t for t in taps if t is not None]
    if weight.dim() != 2 or weight.shape[1] < 1 or len(taps) != weight.shape[1]:
        raise ValueError(f"weight must have shape (C, k) with one entry of taps per tap, got weight "
                         f"{tuple(weight.shape)} and {len(taps)} taps")
    if not inputs or taps[-1] is None:
        raise ValueError("taps[-1] (the current input, lag 0) must be a tensor")
    x = taps[-1]
    if x.dim() < 2 or x.shape[1] != weight.shape[0] or any(t.shape != x.shape for t in inputs):
        raise ValueError(f"every tap must be an (N, C, ...) input like taps[-1] with C = {weight.shape[0]} "
                         f"channels, got shapes {[tuple(t.shape) for t in inputs]}")
    per_channel = ([bias] if bias is not None else []) + (list(bn[:4]) if bn is not None else [])
    if (bias is None) == (bn is None) or any(tuple(t.shape) != (weight.shape[0],) for t in per_channel):
        raise ValueError(f"give either bias or bn = (gamma, beta, mean, var, eps), each of shape "
                         f"({weight.shape[0]},)")


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


def check_backend(backend: str) -> str:
    """Raise a clear error unless ``backend`` is known and its library imports."""
    if backend not in BACKEND_LIBRARIES:
        raise ValueError(f"backend must be one of {tuple(BACKEND_LIBRARIES)}, got {backend!r}")
    if not backend_available(backend):
        import importlib.util
        lib = BACKEND_LIBRARIES[backend]
        if lib is not None and importlib.util.find_spec(lib) is None:
            raise ImportError(f"backend={backend!r} needs the {lib} package, which "
                              f"does not import here: {_INSTALL_HINTS.get(backend, '')}")
        raise ImportError(f"backend={backend!r} cannot run here: "
                          f"{_UNAVAILABLE_REASONS.get(backend, 'it registered no implementation')}")
    return backend


def backend_available(backend: str) -> bool:
    if backend not in BACKEND_LIBRARIES:
        return False
    if backend == "torch":
        return True
    import importlib.util
    lib = BACKEND_LIBRARIES[backend]
    return (lib is None or importlib.util.find_spec(lib) is not None) and any(
        impl.backend == backend for impl in _REGISTRY.values())


def available_backends() -> tuple[str, ...]:
    return tuple(b for b in BACKEND_LIBRARIES if backend_available(b))
