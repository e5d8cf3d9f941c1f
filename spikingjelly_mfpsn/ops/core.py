"""The functional core: an MF-PSN layer's spikes as one stateless call.

As ``torch.nn.functional.batch_norm`` is to ``torch.nn.BatchNorm1d``: :func:`mf_psn` holds the math (the
charge, the batch-norm-fused or parameter threshold, the power-of-two quantiser, the spike) and the
policies (validation, dtypes, finiteness), and every module calls it; the modules hold parameters,
running statistics and single-step memories. :func:`mf_psn_step` is its single-step sibling.

A call flows: ``method`` resolved (``'auto'``: :func:`.registry.choose`), the arguments checked once,
then the implementation's fused step where it has one for this call (``bn_fire``, ``param_fire``,
``step_fire``, ``fire``), else the general path here: the charge (or fused statistics), the folding
(:func:`.reduce.fold_bn`), the quantiser (:func:`~spikingjelly_mfpsn.quantize.quantize`) and the
surrogate module.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, NamedTuple, Optional

import torch

from .. import _compat
from .._util import autocasting
from . import reduce, surrogate
from .registry import (LAYOUTS, Implementation, channel_dim, check_charge_args, check_dense, check_dilation,
                       backend_available, choose, find, get, input_dtype_error, known_backend, not_here, supported,
                       tap_schedule, time_dim)

QUANTIZERS = (None, "whole", "round")  # quantize=: no quantiser, or the straight-through estimator's kind


class BatchNorm(NamedTuple):
    """The batch normalisation folded into the threshold (paper Appendix C).

    Its fields are the arguments of ``torch.nn.functional.batch_norm``: ``gamma``, ``beta`` (C,); the
    running statistics (C,), or None (training only; nothing to update); ``momentum`` (None: a cumulative
    average over ``num_batches_tracked``, a one-element integer tensor, counted up in place in training).
    """
    gamma: torch.Tensor
    beta: torch.Tensor
    running_mean: Optional[torch.Tensor] = None
    running_var: Optional[torch.Tensor] = None
    eps: float = 1e-5
    momentum: Optional[float] = 0.1
    num_batches_tracked: Optional[torch.Tensor] = None


_BN_NAMES = tuple(f"bn.{name}" for name in BatchNorm._fields[:4])  # (its tensors, in the errors)


def mf_psn(x: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
           v_threshold: Optional[torch.Tensor] = None, bn: Optional[BatchNorm] = None, dilation: int = 1,
           layout: str = "time_first", method: str = "auto", backend: str = "torch", surrogate_function=None,
           quantize: Optional[str] = "whole", training: bool = False,
           input_bn: Optional[BatchNorm] = None) -> torch.Tensor:
    """Spikes ``S = Theta(conv(X, Wq) + b)`` of a multi-step MF-PSN layer.

    Args:
        x: time-first ``(T, N, C, ...)`` or time-last ``(N, C, ..., T)`` (``layout``), floating point of
            at most the weight's precision (lower precision is computed in the weight's dtype)
        weight: ``(C, k)``; tap ``i`` reads ``X[t - (k-1-i)*dilation]``
        bias: ``(C,)`` added to the charge (the threshold is 0), or
        v_threshold: ``(C,)``: the parameter threshold, ``b = -v_threshold``, or
        bn: a :class:`BatchNorm` folded into the weight and bias: ``Wf = gamma / sqrt(var + eps) * W``,
            ``b = beta - gamma * mean / sqrt(var + eps)``, with the batch statistics of ``conv(X, W)`` in
            ``training`` (blended into the running ones in place) and the running ones otherwise
        dilation: spacing of the taps in steps (>= 1); layout: ``'time_first'`` or ``'time_last'``
        method: an implementation name (``ops.names()``) or ``'auto'`` (the dispatcher's choice among
            ``backend``'s)
        backend: the backend whose methods ``'auto'`` chooses among (``'torch'`` by default)
        surrogate_function: a SpikingJelly surrogate (default ``surrogate.ATan()``); those of the
            surrogate table are fused into the kernels, any other is applied to the charge
        quantize: ``'whole'`` (``Wq = Q(Wf)`` with the whole straight-through gradient), ``'round'``
            or None (no quantiser)
        training: with ``bn`` (and ``input_bn``), batch statistics and their running ones updated (True)
            or the running ones (False, the default, as for ``torch.nn.functional.batch_norm``)
        input_bn: a :class:`BatchNorm` of ``x`` itself, applied first, as a SpikingJelly
            ``layer.BatchNorm`` in front of the neuron would (statistics over every axis but the
            channels; ``gamma``, ``beta`` may be None: no affine); its tensors in the weight's dtype.
            Implementations that fuse it (``'triton'``) read X once more instead of writing and reading
            the normalised input
    Returns:
        0/1 spikes in ``x``'s dtype and shape, differentiable w.r.t. every tensor

    Refuses (``ValueError``) NaN or inf in what it folds (weight, threshold, statistics) and
    ``var + eps <= 0``; a NaN or inf input changes only the spikes of its window. Under autocast it
    computes in the weight's dtype.
    """
    sg, (code, alpha) = _surrogate(surrogate_function)
    _check_backend(backend)
    _check_threshold_args(weight, bias, v_threshold, bn, quantize, training)
    dilation = _within_steps(x, dilation, layout)
    _check_input_bn(input_bn, weight, training)
    if bn is not None and code and (method != "auto" or backend != "torch"):
        s = _self_checked_bn_step(x, weight, bn, quantize, dilation, layout, method, backend, code, alpha, training,
                                  input_bn)
        if s is not None:
            return s
    impl, xp = _checked(x, weight, bias, dilation, layout, method, backend)
    with _weight_precision(x):
        if bn is not None:
            s = _bn_spikes(impl, xp, weight, bn, quantize, dilation, layout, code, alpha, training, sg, input_bn)
        else:
            if input_bn is not None:
                xp = normalize_input(_in_weight_dtype(xp, weight), input_bn, layout, training)
            s = _param_spikes(impl, xp, weight, bias, v_threshold, quantize, dilation, layout, code, alpha, sg)
    return s if s.dtype == x.dtype else s.to(x.dtype)


def _self_checked_bn_step(x, weight, bn, quantize, dilation, layout, method, backend, code, alpha, training,
                          input_bn) -> Optional[torch.Tensor]:
    """The spikes of the implementation's BN step where it checks every tensor itself (``checks_inputs``),
    tried before the general checks on a call whose tensor layout, layout and dilation those would pass
    (the C++ step ran an unknown layout as time-last); None where it has none or hands the call back."""
    if not _self_checkable(x, dilation, layout):
        return None
    impl = find(method) if method != "auto" else _resolved(x, weight, dilation, layout, method, backend)
    if impl is None or not impl.checks_inputs or (input_bn is not None and not impl.fuses_input_bn):
        return None
    return _bn_fused(impl, x, weight, bn, quantize, dilation, layout, code, alpha, training, input_bn)


def _self_checkable(x, dilation, layout) -> bool:
    """Whether a self-checking step may take the call: a dense tensor, a known layout and an int dilation >= 1
    (what the general checks look at first, and the steps do not), outside autocast."""
    return isinstance(x, torch.Tensor) and x.layout == torch.strided and layout in LAYOUTS \
        and type(dilation) is int and dilation >= 1 and not autocasting(x)


def _resolved(x, weight, dilation, layout, method, backend) -> Optional[Implementation]:
    """The implementation ``method`` names (None where it is not registered or cannot be resolved yet)."""
    try:
        return get(method if method != "auto" else choose(x, weight, dilation, layout, backend))
    except (ValueError, IndexError, AttributeError, RuntimeError):
        return None  # (the checks then say what is wrong)


def _check_backend(backend: str) -> None:
    """``backend`` known, and where it is not torch, available (cheap: its library is imported by then): else
    the error of a network saved where it ran, with the way back."""
    if backend != "torch" and not backend_available(known_backend(backend)):
        raise not_here(backend)


def _surrogate(surrogate_function) -> tuple:
    """The surrogate (SpikingJelly's default, ATan, for None) and its fused kernel's ``(code, alpha)``."""
    if surrogate_function is None:
        from .._compat import default_surrogate
        surrogate_function = default_surrogate()
    return surrogate_function, surrogate.fused(surrogate_function)


def _weight_precision(x: torch.Tensor):
    """Autocast off: the charge and the statistics run in the parameters' dtype (low-precision inputs are
    promoted once, and the 0/1 spikes go back in the input's dtype)."""
    return torch.autocast(x.device.type, enabled=False) if autocasting(x) else contextlib.nullcontext()


def _check_threshold_args(weight, bias, v_threshold, bn, quantize, training) -> None:
    if quantize not in QUANTIZERS:
        raise ValueError(f"quantize must be one of {QUANTIZERS}, got {quantize!r}")
    if (bias is not None) + (v_threshold is not None) + (bn is not None) > 1:
        raise ValueError("give at most one of bias, v_threshold and bn")
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):  # (before the thresholds, whose shapes follow it)
        raise ValueError(f"weight must have shape (C, k) with k >= 1, got {_described(weight)}")
    c, device = weight.shape[0], weight.device
    named = zip(("bias", "v_threshold"), (bias, v_threshold)) if bn is None else zip(_BN_NAMES, bn[:4])
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the weight on {device}: move them to one device")
    if bn is not None:
        _check_bn(bn, "bn", c, training)
    elif v_threshold is not None and not _per_channel(v_threshold, c):
        raise ValueError(f"v_threshold must be a tensor of shape ({c},) (one per channel), "
                         f"got {_described(v_threshold)}")


def _check_input_bn(bn: Optional[BatchNorm], weight: torch.Tensor, training: bool) -> None:
    if bn is not None:
        _check_bn(bn, "input_bn", weight.shape[0], training, weight.dtype)


def _check_bn(bn: BatchNorm, what: str, c: Optional[int], training: bool, dtype=None) -> None:
    """``bn`` (named ``what`` in the errors): running statistics where not training, a counter for a
    cumulative average, eps > 0, and a tensor of one value per channel (in ``dtype`` where given) in each
    of its first four fields: gamma and beta may be None (no affine) in an input batch norm only, and
    running statistics a training step writes in place must not overlap in memory."""
    if not training and (bn.running_mean is None or bn.running_var is None):
        raise ValueError(f"{what} needs running_mean and running_var when training=False")
    if training and bn.momentum is None and bn.running_mean is not None and bn.num_batches_tracked is None:
        raise ValueError(f"{what}.momentum=None (a cumulative average) needs {what}.num_batches_tracked")
    if not (_is_number(bn.eps) and 0 < bn.eps < math.inf):
        raise ValueError(f"{what}.eps must be a finite number > 0, got {bn.eps!r}")
    if not (bn.momentum is None or _is_number(bn.momentum) and 0 <= bn.momentum <= 1):
        raise ValueError(f"{what}.momentum must be a number in [0, 1] or None, got {bn.momentum!r}")
    for name, t in zip(BatchNorm._fields, bn[:4]):
        if t is None:
            if what == "bn" and name in ("gamma", "beta"):
                raise ValueError(f"bn.{name} must be a tensor of shape ({c},) (one per channel), got None")
            continue
        per_channel = _per_channel(t, c)
        if per_channel and training and c > 1 and name.startswith("running") and t.stride(0) == 0:
            raise ValueError(f"{what}.{name} must not be an expanded tensor (stride 0): a training step "
                             f"updates it in place")
        if not (per_channel and (t.dtype == dtype if dtype else t.is_floating_point())):
            in_dtype = " of a floating-point dtype" if dtype is None else f" in the weight's dtype {dtype}"
            got = _described(t) + (f" {t.dtype}" if isinstance(t, torch.Tensor) else "")
            raise ValueError(f"{what}.{name} must be a tensor of shape ({c},) (one per channel){in_dtype}, got {got}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_channel(t, c: Optional[int]) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == c


def _described(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def normalize_input(x: torch.Tensor, bn: BatchNorm, layout: str, training: bool) -> torch.Tensor:
    """``x`` through the batch norm ``bn`` over every axis but the channels, its running statistics (and
    ``num_batches_tracked``) updated in ``training``, as ``torch.nn.BatchNorm`` does."""
    track = training and bn.running_mean is not None
    if track and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    factor = _running_factor(bn, 0) if track else 0.0
    y = _compat.batch_norm(x.flatten(0, 1) if layout == "time_first" else x, bn.running_mean, bn.running_var,
                           bn.gamma, bn.beta, training, factor, bn.eps)
    return y.reshape(x.shape)


# Runs an empty input (no samples, features or steps) for every method: each of its ops takes empty
# tensors, while reshapes to (N, C, -1, T) or convolutions over zero steps do not.
EMPTY_INPUT_METHOD = "shift_add"


def _checked(x, weight, bias, dilation, layout, method, backend="torch") -> tuple[Implementation, torch.Tensor]:
    """The implementation that runs a validated call (``'auto'`` resolved among ``backend``'s), and ``x``
    as it reads it: an input of lower precision than the weight in the weight's dtype unless the
    implementation reads it as it is (e.g. Triton)."""
    check_charge_args(x, weight, bias, dilation, layout)
    if method == "auto":
        method = choose(x, weight, dilation, layout, backend)
    impl = get(method)
    x = _as_read_by(impl, x, weight, dilation, layout)
    return (impl if x.numel() else get(EMPTY_INPUT_METHOD)), x


def _as_read_by(impl: Implementation, x, weight, dilation, layout) -> torch.Tensor:
    """``x`` as ``impl`` reads it (in the weight's dtype unless it reads lower precisions itself), or
    ValueError where ``impl`` cannot run it."""
    if x.dtype != weight.dtype and not impl.supports(x, weight, dilation, layout):
        x = x.to(weight.dtype)
    reasons = impl.not_supported_reasons(x, weight, dilation, layout)
    if reasons:
        others = supported(x, weight, dilation, layout)
        raise ValueError(f"method {impl.name!r} cannot run this input: {'; '.join(reasons)}. "
                         f"Methods that can: {others}")
    return x


def _in_weight_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` in the weight's dtype (a checked call's ``x`` has it or a lower precision)."""
    return x if x.dtype == weight.dtype else x.to(weight.dtype)


def _quantized(w: torch.Tensor, quantize: Optional[str]) -> torch.Tensor:
    from ..quantize import quantize as q
    return w if quantize is None else q(w, quantize)


# ---------------------------------------------------------------------------- the BN threshold
def _running_factor(bn: BatchNorm, uncounted: int) -> float:
    """How much of a batch's statistics the running ones take in: the momentum, or 1 / batches for a
    cumulative average (``uncounted``: 1 while num_batches_tracked does not count this batch yet)."""
    if bn.momentum is not None:
        return bn.momentum
    tracked = 0 if bn.num_batches_tracked is None else int(bn.num_batches_tracked)
    return 1.0 / (tracked + uncounted)


def _bn_fused(impl, x, weight, bn, quantize, dilation, layout, code, alpha, training,
              input_bn: Optional[BatchNorm] = None) -> Optional[torch.Tensor]:
    """The implementation's fused BN step (``bn_fire``), or None where it has none for this call."""
    if impl.bn_fire is None or not code or (input_bn is not None and not impl.fuses_input_bn):
        return None
    extra = {} if input_bn is None else {"input_bn": _fused_input_bn(input_bn, weight, training)}
    running = _running(bn, training)
    # Counted before the kernel blends the batch in: a non-reentrant checkpoint's recomputation stops inside
    # the call (after the blend), and counts the batch again as torch's BatchNorm does.
    counters = [b.num_batches_tracked for b in (bn, input_bn) if b is not None and training
                and b.num_batches_tracked is not None and b.running_mean is not None]
    for counter in counters:
        counter.add_(1)
    out = impl.bn_fire(x, weight, bn.gamma, bn.beta, bn.eps, quantize, dilation, layout, code, alpha,
                       running, None if training else (bn.running_mean, bn.running_var), **extra)
    if out is None:  # nothing updated; includes NaN/inf weights, which the general path reports
        for counter in counters:
            counter.sub_(1)
        return None
    return out[0]


def _running(bn: BatchNorm, training: bool) -> Optional[tuple]:
    """``(running_mean, running_var, factor)`` a training step blends its statistics into, or None."""
    return (bn.running_mean, bn.running_var, _running_factor(bn, 1)) if training and bn.running_mean is not None \
        else None


def _fused_input_bn(bn: BatchNorm, weight: torch.Tensor, training: bool) -> tuple:
    """``input_bn`` of a ``bn_fire`` call: ``(gamma0, beta0, eps0, running0, given0)``, no affine as ones and
    zeros."""
    gamma = bn.gamma if bn.gamma is not None else torch.ones_like(weight[:, 0])
    beta = bn.beta if bn.beta is not None else torch.zeros_like(weight[:, 0])
    return gamma, beta, bn.eps, _running(bn, training), None if training else (bn.running_mean, bn.running_var)


def _bn_spikes(impl, x, weight, bn, quantize, dilation, layout, code, alpha, training, sg,
               input_bn: Optional[BatchNorm] = None) -> torch.Tensor:
    if x.numel():
        s = _bn_fused(impl, x, weight, bn, quantize, dilation, layout, code, alpha, training, input_bn)
        if s is not None:
            return s
    if input_bn is not None:  # not fused: normalise X first
        x = normalize_input(_in_weight_dtype(x, weight), input_bn, layout, training)
        return _bn_spikes(impl, x, weight, bn, quantize, dilation, layout, code, alpha, training, sg)
    if training:
        # One cast of a lower-precision x for both of its uses: a cast in each would round the gradient of
        # each to x's dtype before autograd adds them (they cancel much, as in a batch norm's backward)
        x = _in_weight_dtype(x, weight)
        stats = _stats(impl, x, weight, dilation, layout)
        (mean, var), (w, b) = fold_batch(weight, bn, stats, lambda: _exact_stats(impl, x, weight, dilation, layout))
        update_running_stats(bn, mean, var, x.numel() // max(weight.shape[0], 1))
    else:
        w, b = fold_checked(weight, bn, bn.running_mean, bn.running_var)
    return _fire(impl, x, _quantized(w, quantize), b, dilation, layout, code, alpha, sg)


def _stats(impl, x, weight, dilation, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased var)`` of the bias-free charge, through the fused kernel where there is one."""
    if impl.stats is not None:
        return impl.stats(x, weight, dilation, layout)
    x = _in_weight_dtype(x, weight)
    return reduce.batch_stats(impl.apply(x, weight, None, dilation, layout), channel_dim(layout))


def _exact_stats(impl, x, weight, dilation, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 ``(mean, biased var)`` of the charge (of x as the implementation reads it)."""
    return reduce.batch_stats(impl.apply(_in_weight_dtype(x, weight).double(), weight.double(), None, dilation,
                                         layout), channel_dim(layout))


def fold_batch(weight: torch.Tensor, bn: BatchNorm, stats: tuple, exact: Callable[[], tuple]) -> tuple:
    """``(stats, fold_checked(...))`` of a batch's ``stats = (mean, var)`` (checked before the running ones take
    them in). Where the check refuses them on the CPU, once more with the float64 statistics ``exact()``, cast
    back (beyond the dtype's range: inf, refused): a sum that overflowed on the way (``n * var`` beyond the
    range, ``var`` within it) depends on the order and precision a method sums in."""
    try:
        return stats, fold_checked(weight, bn, *stats, batch=True)
    except ValueError:
        if stats[0].dtype == torch.float64 or not stats[0].is_cpu:
            raise
    stats = tuple(s.to(t.dtype) for s, t in zip(exact(), stats))
    return stats, fold_checked(weight, bn, *stats, batch=True)


def update_running_stats(bn: BatchNorm, mean: torch.Tensor, var: torch.Tensor, n: int) -> None:
    """Blend a batch's mean and unbiased variance into ``bn``'s running statistics in place (an empty
    batch has none to blend in)."""
    if n <= 0 or bn.running_mean is None:
        return
    with torch.no_grad():
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
        factor = _running_factor(bn, 0)
        if torch.compiler.is_compiling():
            _blend_running(bn.running_mean, bn.running_var, mean.detach(), var.detach(), float(factor), n)
            return
        mean, var = mean.detach().to(bn.running_mean), (var.detach() * (n / max(n - 1, 1))).to(bn.running_var)
        bn.running_mean.lerp_(mean, factor)
        bn.running_var.lerp_(var, factor)


@torch.library.custom_op("spikingjelly_mfpsn::blend_running", mutates_args=("running_mean", "running_var"))
def _blend_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                   factor: float, n: int) -> None:
    """:func:`update_running_stats` under torch.compile, an operator inductor does not fuse into the kernel
    that sums the statistics: Triton 3.6 (torch 2.11) fails to compile some such fusions for CUDA ("operand
    does not dominate this use" in its layout pass). The finiteness check is an assertion there, perhaps
    run after this: a non-finite statistic leaves its running one as it was. (``n``, not a float of it: a
    batch size dynamic in the graph stays so.)"""
    mean, var = mean.to(running_mean), (var * (n / max(n - 1, 1))).to(running_var)
    running_mean.lerp_(torch.where(torch.isfinite(mean), mean, running_mean), factor)
    running_var.lerp_(torch.where(torch.isfinite(var), var, running_var), factor)


@_blend_running.register_fake
def _(running_mean, running_var, mean, var, factor, n) -> None:
    return None


def fold_checked(weight: torch.Tensor, bn: BatchNorm, mean: torch.Tensor, var: torch.Tensor,
                 batch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.reduce.fold_bn`, refusing NaN or inf in what it folds (see :func:`check_finite`). On the
    CPU one sum over the folded weight, bias and var decides first (NaN or inf in any input, or
    ``var + eps <= 0``, leaves one of them non-finite); a folding that overflows from finite inputs
    passes (the quantiser clamps it)."""
    w, b = reduce.fold_bn(weight, bn.gamma, bn.beta, mean, var, bn.eps)
    if w.dtype != weight.dtype or b.dtype != weight.dtype:  # (statistics or affine kept in another dtype)
        w, b = w.to(weight.dtype), b.to(weight.dtype)
    if w.is_cpu and not torch.compiler.is_compiling():
        with torch.no_grad():
            total = torch.cat((w.reshape(-1), b.reshape(-1), var.reshape(-1))).sum(dtype=torch.float64)
        if math.isfinite(float(total)):
            return w, b
    check_finite({"weight": weight, "gamma": bn.gamma, "beta": bn.beta}, (mean, var, bn.eps), batch)
    return w, b


def check_finite(named: dict, stats: Optional[tuple] = None, batch: bool = False) -> None:
    """Refuse NaN or inf in the tensors ``named`` (and, for ``stats = (mean, var, eps)``, in the statistics,
    with ``var + eps > 0``): it would silence a channel. ``batch``: the statistics are the batch's.
    Every call: a check skipped while tensors keep their version counters would miss a change through
    ``.data``. On CUDA, and in a ``torch.compile`` graph (which cannot branch on values), torch's
    asynchronous assertion (no synchronisation; a ``RuntimeError`` naming what it checks)."""
    with torch.no_grad():
        parts = [t.reshape(-1) for t in named.values()]
        if stats is not None:
            mean, var, eps = stats
            parts += [mean.reshape(-1), var.reshape(-1), torch.rsqrt(var + eps).reshape(-1)]
        flat = torch.cat(parts)
        if flat.is_meta:
            return  # (shape only: nothing to check)
        finite = torch.isfinite(flat).all() if flat.is_cuda or torch.compiler.is_compiling() else None
    if finite is not None:  # (outside no_grad: a compiled graph raising inside it leaves gradients disabled)
        what = ", ".join(named) + (", the batch statistics of its charge" if batch else ", running_mean, "
                                   "running_var" if stats is not None else "")
        torch._assert_async(finite, f"MF-PSN: NaN or inf (or var + eps <= 0) in {what}")
        return
    # One sum decides on the CPU: NaN or inf anywhere makes it so; a float64 sum of finite values that
    # overflows is looked at element by element
    if not math.isfinite(float(flat.sum(dtype=torch.float64))):
        message = _non_finite_message(named, stats, batch)
        if message is not None:
            raise ValueError(message)


def _non_finite_message(named: dict, stats: Optional[tuple], batch: bool) -> Optional[str]:
    """What :func:`check_finite` refused, by name; None where nothing is."""
    if stats is not None and not batch:
        named = {**named, "running_mean": stats[0], "running_var": stats[1]}
    bad = [name for name, t in named.items() if not torch.isfinite(t).all()]
    if bad:
        return (f"{', '.join(bad)} contains NaN or inf (diverged training or a bad checkpoint); spikes from it "
                f"would be meaningless")
    if stats is None:
        return None
    mean, var, eps = stats
    if batch and not (torch.isfinite(mean).all() and torch.isfinite(var).all()):
        return ("the batch statistics of its charge are NaN or inf: NaN or inf in its input, or values large "
                "enough to overflow (the running statistics were left as they were)")
    if torch.isfinite(torch.rsqrt(var + eps)).all():
        return None
    return (f"{'the batch variance' if batch else 'running_var'} + eps <= 0 (min {float(var.min())}): a batch "
            f"norm cannot be folded into the weight (a bad checkpoint?)")


# ---------------------------------------------------------------------------- the parameter threshold
def _param_spikes(impl, x, weight, bias, v_threshold, quantize, dilation, layout, code, alpha, sg) -> torch.Tensor:
    if v_threshold is not None and impl.param_fire is not None and code and x.numel():
        s = impl.param_fire(x, weight, v_threshold, quantize, dilation, layout, code, alpha)
        if s is not None:
            return s
    return _fire(impl, x, _quantized(weight, quantize), _checked_bias(weight, bias, v_threshold), dilation, layout,
                 code, alpha, sg)


def _checked_bias(weight, bias, v_threshold) -> Optional[torch.Tensor]:
    """The bias of a call without BN (``-v_threshold``, or ``bias``), refusing NaN or inf in it or the weight."""
    named = {"weight": weight}
    if v_threshold is not None:
        named["v_threshold"], bias = v_threshold, -v_threshold
    elif bias is not None:
        named["bias"] = bias
    check_finite(named)
    return bias


def _fire(impl, x, w, b, dilation, layout, code, alpha, sg) -> torch.Tensor:
    """``sg(charge(...))``, through the implementation's fused kernel when it has one. The folded ``w``,
    ``b`` are checked against ``x`` as a charge call is (e.g. a BN parameter of higher precision folds
    into a weight of its dtype, which x is then promoted to; their shapes were checked already)."""
    if x.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        impl, x = _checked(x, w, b, dilation, layout, impl.name)
    if impl.fire is not None and code:
        s = impl.fire(x, w, b, dilation, layout, code, alpha)
        if s is not None:
            return s
    x = _in_weight_dtype(x, w)
    h = exact_where_overflowed(impl.apply(x, w, b, dilation, layout), lambda: impl.apply(
        x.double(), w.double(), None if b is None else b.double(), dilation, layout))
    if not h.requires_grad and code and not torch.compiler.is_compiling() \
            and h.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        # No backward to come: SpikingJelly's spiking forward, Theta(H), without its Function, in place in
        # H (never in the input, should a registered implementation hand back a view of it). Eager only:
        # a compiled graph fuses the surrogate's forward anyway, and dynamo cannot trace storage pointers.
        return h.ge_(0)
    return sg(h)


def exact_where_overflowed(h: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The charge ``h``, with the exact float64 charge wherever ``h`` is not finite.

    ``h`` is kept where it is finite; where a charge narrower than float64 is not (a sum that overflowed on
    the way or in the end, or a NaN or inf input), the float64 charge ``exact()`` of the same inputs is used,
    cast back (beyond the dtype's range: the infinity of its sign). So a spike is the sign of the exact sum
    whatever order an implementation adds in, as the fused kernels do too. Eager only (a data-dependent
    branch); the check is one read of ``h`` (a float64 sum: no sum of finite float32 values overflows it).
    """
    if h.dtype == torch.float64 or h.is_meta or torch.compiler.is_compiling() \
            or bool(h.sum(dtype=torch.float64).isfinite()):
        return h
    return torch.where(torch.isfinite(h), h, exact().to(h.dtype))


# ---------------------------------------------------------------------------- the charge alone
def charge(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, dilation: int = 1,
           layout: str = "time_first", method: str = "auto") -> torch.Tensor:
    """The charge ``H = conv(X, W) + b`` alone (no quantiser, no spike).

    Computed by ``method`` (an implementation name, or ``'auto'``), after validating the call; an input of
    lower precision than the weight is computed in the weight's dtype.
    """
    dilation = _within_steps(x, dilation, layout)
    impl, x = _checked(x, weight, bias, dilation, layout, method)
    return impl.apply(_in_weight_dtype(x, weight), weight, bias, dilation, layout)


def _within_steps(x, dilation, layout: str):
    """``dilation``, or the number of steps of ``x`` where that is smaller: taps as far back read the causal
    zeros either way, and the kernels' 32-bit index arithmetic would overflow on a huge dilation."""
    if isinstance(dilation, int) and not isinstance(dilation, bool) and isinstance(x, torch.Tensor) \
            and layout in LAYOUTS and x.dim() >= 3 and dilation > x.shape[time_dim(layout)] >= 1:
        return x.shape[time_dim(layout)]
    return dilation


# ---------------------------------------------------------------------------- one step
def mf_psn_step(taps: list, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                v_threshold: Optional[torch.Tensor] = None, bn: Optional[BatchNorm] = None, method: str = "auto",
                backend: str = "torch", surrogate_function=None, quantize: Optional[str] = "whole",
                training: bool = False) -> torch.Tensor:
    """One step of :func:`mf_psn` from the inputs its taps read (single-step mode's ring buffer).

    Returns the spikes ``Theta(sum_i Wq[:, i] * taps[i] + b)`` of inputs ``(N, C, ...)``, ``taps[i]`` the
    input tap ``i`` reads, ``(k-1-i)*dilation`` steps back, or None before the first step (``taps[-1]``:
    this step's input). The threshold arguments as in :func:`mf_psn`; with ``bn`` in ``training``, the batch
    statistics are this step's. Without a gradient to compute, a pinned ``method`` (or a kernel
    ``backend``) with a fused step runs it in one kernel call.
    """
    sg, (code, _) = _surrogate(surrogate_function)
    _check_backend(backend)
    _check_step_args(taps, weight, bias, v_threshold, bn)
    x = taps[-1]
    for i, tap in enumerate(taps):
        bad_dtype = None if tap is None else input_dtype_error(tap.dtype, weight.dtype)
        if bad_dtype is not None:
            raise bad_dtype if tap is x else TypeError(f"taps[{i}] (an earlier input): {bad_dtype}")
    _check_threshold_args(weight, bias, v_threshold, bn, quantize, training)
    impl = None
    if method != "auto" or backend != "torch":  # (what cannot run the sequence cannot run its steps either)
        impl = get(method if method != "auto" else choose(x.unsqueeze(0), weight, 1, "time_first", backend))
        _as_read_by(impl, x.unsqueeze(0), weight, 1, "time_first")
    if code and impl is not None and not (bn is not None and training) and not autocasting(x):
        if impl.step_fire is not None:
            b = -v_threshold if v_threshold is not None else bias
            folded = None if bn is None else (bn.gamma, bn.beta, bn.running_mean, bn.running_var, bn.eps)
            s = impl.step_fire(taps, weight, b, folded, quantize is not None)
            if s is not None:
                return s if s.dtype == x.dtype else s.to(x.dtype)
    with _weight_precision(x):
        s = _step_spikes([t if t is None else _in_weight_dtype(t, weight) for t in taps], weight, bias,
                         v_threshold, bn, quantize, training, sg)
    return s if s.dtype == x.dtype else s.to(x.dtype)


def _step_charge(taps: list, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    cshape = [-1] + [1] * (taps[-1].dim() - 2)
    h = None
    for i, xi in enumerate(taps):
        if xi is not None:
            term = xi * w[:, i].view(cshape)
            h = term if h is None else h + term
    return h if b is None else h + b.view(cshape)


def _step_spikes(taps, weight, bias, v_threshold, bn, quantize, training, sg) -> torch.Tensor:
    if bn is not None and training:
        stats = reduce.batch_stats(_step_charge(taps, weight, None), 1)
        (mean, var), (w, b) = fold_batch(weight, bn, stats, lambda: reduce.batch_stats(
            _step_charge([t if t is None else t.double() for t in taps], weight.double(), None), 1))
        update_running_stats(bn, mean, var, taps[-1].numel() // max(weight.shape[0], 1))
    elif bn is not None:
        w, b = fold_checked(weight, bn, bn.running_mean, bn.running_var)
    else:
        w, b = weight, _checked_bias(weight, bias, v_threshold)
    wq = _quantized(w, quantize)
    h = exact_where_overflowed(_step_charge(taps, wq, b), lambda: _step_charge(
        [t if t is None else t.double() for t in taps], wq.double(), None if b is None else b.double()))
    return sg(h)


def _check_step_args(taps: list, weight, bias, v_threshold, bn) -> None:
    """Validate a :func:`mf_psn_step` call; raises ``ValueError`` naming the offending argument."""
    inputs = [t for t in taps if t is not None]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] < 1 \
            or len(taps) != weight.shape[1]:
        raise ValueError(f"weight must have shape (C, k) with one entry of taps per tap, got weight "
                         f"{tuple(getattr(weight, 'shape', ()))} and {len(taps)} taps")
    if not inputs or taps[-1] is None or any(not isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError("taps[-1] (the current input, lag 0) must be a tensor, and every other entry a tensor or None")
    for t in inputs:
        check_dense(t, "taps[-1]" if t is taps[-1] else "a tap")
    x = taps[-1]
    if x.dim() < 2 or x.shape[1] != weight.shape[0] or any(t.shape != x.shape for t in inputs):
        raise ValueError(f"every tap must be an (N, C, ...) input like taps[-1] with C = {weight.shape[0]} "
                         f"channels, got shapes {[tuple(t.shape) for t in inputs]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def step_taps(history: tuple, k: int, dilation: int) -> list:
    """The ``taps`` of :func:`mf_psn_step` for the newest of ``history`` (inputs oldest first)."""
    taps: list = [None] * k
    for i, lag, _ in tap_schedule(len(history), k, check_dilation(dilation), start=len(history) - 1):
        taps[i] = history[-1 - lag]
    return taps


# ---------------------------------------------------------------------------- deprecated entry points
def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"spikingjelly_mfpsn.ops.{name} is deprecated: use {instead}", DeprecationWarning, stacklevel=3)


def fire(x, weight, bias, dilation, layout, method, surrogate_function) -> torch.Tensor:
    """Deprecated: ``mf_psn(x, weight, bias=bias, quantize=None, ...)``."""
    _deprecated("fire", "ops.mf_psn(x, weight, bias=bias, quantize=None, ...)")
    return mf_psn(x, weight, bias=bias, dilation=dilation, layout=layout, method=method,
                  surrogate_function=surrogate_function, quantize=None)


def batch_stats(x, weight, dilation, layout, method) -> tuple[torch.Tensor, torch.Tensor]:
    """Deprecated: ``ops.reduce.batch_stats(ops.charge(...), channel_dim)``, or a BatchNorm in mf_psn."""
    _deprecated("batch_stats", "ops.reduce.batch_stats(ops.charge(x, weight, ...), channel_dim)")
    impl, x = _checked(x, weight, None, dilation, layout, method)
    mean, var = _stats(impl, x, weight, dilation, layout)
    if mean.dtype == torch.float64 or not mean.is_cpu or bool(torch.cat((mean, var)).sum(dtype=torch.float64).isfinite()):
        return mean, var
    exact = _exact_stats(impl, x, weight, dilation, layout)  # (as fold_batch: the same in every method)
    return exact[0].to(mean.dtype), exact[1].to(var.dtype)


def bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, method, surrogate_function, running=None,
            given=None) -> Optional[tuple]:
    """Deprecated: ``mf_psn(x, weight, bn=BatchNorm(...), ...)``. The implementation's fused step, or None."""
    _deprecated("bn_fire", "ops.mf_psn(x, weight, bn=ops.BatchNorm(...), ...)")
    impl, x = _checked(x, weight, None, dilation, layout, method)
    code, alpha = surrogate.fused(surrogate_function)
    if impl.bn_fire is None or not code or not x.numel():
        return None
    return impl.bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running, given)


def bn_fire_direct(x, weight, gamma, beta, eps, ste, dilation, layout, method, surrogate_function, running=None,
                   given=None) -> Optional[tuple]:
    """Deprecated: ``mf_psn(x, weight, bn=BatchNorm(...), method=method)`` tries a self-checking step first."""
    _deprecated("bn_fire_direct", "ops.mf_psn(x, weight, bn=ops.BatchNorm(...), method=method, ...)")
    impl = _resolved(x, weight, dilation, layout, method, "torch")
    code, alpha = surrogate.fused(surrogate_function)
    if impl is None or not impl.checks_inputs or not code or not _self_checkable(x, dilation, layout):
        return None
    return impl.bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running, given)


def param_fire(x, weight, v_threshold, ste, dilation, layout, method, surrogate_function) -> Optional[torch.Tensor]:
    """Deprecated: ``mf_psn(x, weight, v_threshold=v_threshold, ...)``. The fused step, or None."""
    _deprecated("param_fire", "ops.mf_psn(x, weight, v_threshold=v_threshold, ...)")
    impl, x = _checked(x, weight, None, dilation, layout, method)
    code, alpha = surrogate.fused(surrogate_function)
    if impl.param_fire is None or not code or not x.numel():
        return None
    return impl.param_fire(x, weight, v_threshold, ste, dilation, layout, code, alpha)


def step_fire(taps, weight, bias, bn, quantize, method, surrogate_function) -> Optional[torch.Tensor]:
    """Deprecated: ``mf_psn_step(taps, weight, ...)``. The implementation's fused step, or None."""
    _deprecated("step_fire", "ops.mf_psn_step(taps, weight, ...)")
    impl = get(method)
    _check_step_args(taps, weight, bias, None, None)
    if bn is not None and (bias is not None or any(tuple(t.shape) != (weight.shape[0],) for t in bn[:4])):
        raise ValueError(f"give either bias or bn = (gamma, beta, mean, var, eps), each of shape "
                         f"({weight.shape[0]},)")
    if bn is None and bias is None:
        raise ValueError("give either bias or bn = (gamma, beta, mean, var, eps)")
    if impl.step_fire is None or not surrogate.fused(surrogate_function)[0]:
        return None
    return impl.step_fire(taps, weight, bias, bn, quantize)
