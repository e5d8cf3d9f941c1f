"""Pure-PyTorch implementations of the charge (paper Appendix A, plus shift-add).

Each function has the registry contract ``fn(x, weight, bias, dilation, layout) -> h`` (see
:mod:`.registry`); where X has a size-1 dim, the gradient each gives X is contiguous, as the C++
and Triton ones always are (torch's CPU batch norm in front could misread a strided one there:
``_compat.batch_norm``). Shapes: time-first ``(T, N, C, *)``, time-last ``(N, C, *, T)``; ``weight (C, k)``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .._compat import dense_grad
from .reduce import channel_dot, channel_sum
from .registry import LAYOUTS, Implementation, channel_dim, channel_view_shape, needs_grad, register, tap_schedule, time_dim

# A (C, T, T) Toeplitz weight beyond this many elements is refused by Vmap+MM.
MAX_MM_ELEMENTS = 1 << 28


def _causal_pad(x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """Left-pad the last axis with (k-1)*d zeros so a valid convolution is causal."""
    return F.pad(x, ((weight.shape[1] - 1) * dilation, 0))


# ---------------------------------------------------------------- reshape + Conv1d ("vanilla")
def conv1d(x, weight, bias, dilation, layout):
    """Move time last and channels next to it, fuse the rest into the batch, run a grouped Conv1d.

    The moves are non-adjacent for both layouts, so each costs a copy in and a copy out: this is the
    paper's "vanilla" baseline.
    """
    c, k = weight.shape
    x = dense_grad(x)
    xt = x.movedim(0, -1) if layout == "time_first" else x  # (N, C, *, T)
    seq = xt.movedim(1, -2)  # (N, *, C, T)
    lead = seq.shape[:-2]
    h = F.conv1d(_causal_pad(seq.reshape(-1, c, seq.shape[-1]), weight, dilation),
                 weight.unsqueeze(1), bias, dilation=dilation, groups=c)
    h = h.reshape(*lead, c, h.shape[-1]).movedim(-2, 1)  # (N, C, *, T)
    if layout == "time_first":
        h = h.movedim(-1, 0)
    return h.contiguous()


# ---------------------------------------------------------------- time-last Conv2d
def conv2d(x, weight, bias, dilation, layout):
    """Time-last ``(N, C, *, T)`` viewed as ``(N, C, M, T)``: a depthwise Conv2d with kernel (1, k)."""
    n, c, t = x.shape[0], x.shape[1], x.shape[-1]
    x4 = dense_grad(x).reshape(n, c, -1, t)
    h = F.conv2d(_causal_pad(x4, weight, dilation), weight.view(c, 1, 1, -1), bias,
                 dilation=(1, dilation), groups=c)
    return h.reshape(x.shape).contiguous()


# ---------------------------------------------------------------- time-last Vmap + Conv1d
def vmap_conv1d(x, weight, bias, dilation, layout):
    """Time-last ``(N, C, M, T)``: ``torch.vmap`` of a depthwise Conv1d over the M axis."""
    n, c, t = x.shape[0], x.shape[1], x.shape[-1]
    w = weight.unsqueeze(1)

    def one(xm):  # (N, C, T)
        return F.conv1d(_causal_pad(xm, weight, dilation), w, bias, dilation=dilation, groups=c)

    h = torch.vmap(one, in_dims=2, out_dims=2)(dense_grad(x).reshape(n, c, -1, t))
    return h.reshape(x.shape).contiguous()


# ---------------------------------------------------------------- Vmap + MM (both layouts)
@functools.lru_cache(maxsize=64)
def _toeplitz_index(t: int, k: int, dilation: int, device: torch.device) -> torch.Tensor:
    """(T, T) index into a zero-padded weight row: A[t, j] = w[idx[t, j]] (idx == k means 0). Built as
    a normal tensor even under ``torch.inference_mode`` (it is cached for later calls with autograd)."""
    with torch.inference_mode(False):
        lag = torch.arange(t).view(-1, 1) - torch.arange(t).view(1, -1)  # t - j
        tap = (k - 1) - torch.div(lag, dilation, rounding_mode="floor")
        valid = (lag >= 0) & (lag % dilation == 0) & (tap >= 0)
        return torch.where(valid, tap, torch.full_like(tap, k)).to(device)


def toeplitz_weight(weight: torch.Tensor, t: int, dilation: int) -> torch.Tensor:
    """The paper's (C, T, T) matrix A with ``H[:, c] = A[c] @ X[:, c]`` (time-first)."""
    idx = _toeplitz_index(t, weight.shape[1], dilation, weight.device)
    return F.pad(weight, (0, 1))[:, idx]


def vmap_mm(x, weight, bias, dilation, layout):
    """Per channel, multiply the sequence by the (T, T) Toeplitz matrix, vectorised over C.

    The product multiplies every step of a lane by the matrix's zeros outside the taps' window, and
    ``0 * NaN`` is NaN: a NaN or inf input would reach every step of its lane. So an input with one
    runs tap by tap (:func:`shift_add`, the same charge), where it stays inside its window; in a
    compiled graph (no data-dependent branch) the finite part runs as a product and the non-finite
    values are added tap by tap.
    """
    if torch.compiler.is_compiling():
        finite = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return _vmap_mm(finite, weight, bias, dilation, layout) + shift_add(x - finite, weight, None, dilation,
                                                                           layout)
    # (one read; a float64 sum overflowing goes there too; a meta tensor has no values)
    if not x.is_meta and not bool(x.sum(dtype=torch.float64).isfinite()):
        return shift_add(x, weight, bias, dilation, layout)
    return _vmap_mm(x, weight, bias, dilation, layout)


def _vmap_mm(x, weight, bias, dilation, layout):
    x, t = dense_grad(x), x.shape[time_dim(layout)]
    a = toeplitz_weight(weight, t, dilation)
    if layout == "time_first":  # x[:, :, c] is (T, N, *): H_c = A_c @ X_c
        def one(ac, xc):
            return (ac @ xc.reshape(t, -1)).reshape(xc.shape)
        h = torch.vmap(one, in_dims=(0, 2), out_dims=2)(a, x)
    else:  # x[:, c] is (N, *, T): H_c = X_c @ A_c^T
        def one(ac, xc):
            return xc @ ac.transpose(0, 1)
        h = torch.vmap(one, in_dims=(0, 1), out_dims=1)(a, x)
    if bias is not None:
        h = h + bias.view(channel_view_shape(x.dim(), layout))
    return h.contiguous()


def _vmap_mm_requirements(x, weight, dilation, layout):
    t = x.shape[time_dim(layout)]
    size = weight.shape[0] * t * t
    if size > MAX_MM_ELEMENTS:
        return [f"vmap_mm needs a (C, T, T) = ({weight.shape[0]}, {t}, {t}) weight matrix, "
                f"more than {MAX_MM_ELEMENTS} elements"]
    return []


# ---------------------------------------------------------------- shift-add (both layouts)
def _taps(weight: torch.Tensor, x: torch.Tensor, dilation: int, layout: str):
    """Yield (i, w_i broadcastable to x, lag_i) for every tap whose lag is shorter than T."""
    shape = channel_view_shape(x.dim(), layout)
    for i, lag, _ in tap_schedule(x.shape[time_dim(layout)], weight.shape[1], dilation):
        yield i, weight[:, i].view(shape), lag


def _shift_add(x, weight, bias, dilation, layout):
    """The charge, with no graph: k shifted slices of X, each scaled by its tap and accumulated in place."""
    td = time_dim(layout) % x.dim()
    t = x.shape[td]
    h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if bias is not None:
        h.copy_(bias.view(channel_view_shape(x.dim(), layout)).expand(x.shape))
    else:
        h.zero_()
    for _, w_i, lag in _taps(weight, x, dilation, layout):
        h.narrow(td, lag, t - lag).addcmul_(x.narrow(td, 0, t - lag), w_i)
    return h


def _shift_add_out_of_place(x, weight, bias, dilation, layout):
    """:func:`_shift_add` as a sum of shifted, zero-padded products (for a compiled graph, which fuses it)."""
    td = time_dim(layout) % x.dim()
    t = x.shape[td]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    h = torch.zeros(x.shape, dtype=dtype, device=x.device) if bias is None else \
        bias.view(channel_view_shape(x.dim(), layout)).to(dtype).expand(x.shape)
    for _, w_i, lag in _taps(weight, x, dilation, layout):
        pad = x.new_zeros(x.shape[:td] + (lag,) + x.shape[td + 1:], dtype=dtype)
        h = h + torch.cat([pad, x.narrow(td, 0, t - lag) * w_i], td)
    return h


class _ShiftAdd(torch.autograd.Function):
    """:func:`_shift_add` with its own backward; saves only X and W."""

    @staticmethod
    def forward(x, weight, bias, dilation, layout):
        if torch.compiler.is_compiling():  # (dynamo of torch 2.11 lost the gradient of an output built in place)
            return _shift_add_out_of_place(x, weight, bias, dilation, layout)
        return _shift_add(x, weight, bias, dilation, layout)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form runs under torch.func transforms too)
        x, weight, bias, dilation, layout = inputs
        ctx.save_for_backward(x, weight)
        ctx.dilation, ctx.layout, ctx.has_bias = dilation, layout, bias is not None

    @staticmethod
    def backward(ctx, grad_h):
        x, weight = ctx.saved_tensors
        layout, dilation = ctx.layout, ctx.dilation
        td = time_dim(layout) % x.dim()
        cd = channel_dim(layout)
        t = x.shape[td]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dL/dX = the same correlation run backwards in time (flipped weight).
            grad_x = torch.zeros(x.shape, dtype=grad_h.dtype, device=grad_h.device)
            for _, w_i, lag in _taps(weight, x, dilation, layout):
                grad_x.narrow(td, 0, t - lag).addcmul_(grad_h.narrow(td, lag, t - lag), w_i)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)
            for i, _, lag in _taps(weight, x, dilation, layout):
                grad_w[:, i] = channel_dot(grad_h.narrow(td, lag, t - lag), x.narrow(td, 0, t - lag), cd)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = channel_sum(grad_h, cd)
        return grad_x, grad_w, grad_b, None, None


def shift_add(x, weight, bias, dilation, layout):
    """Accumulate k time-shifted slices of X scaled by their taps; no reshape, no transpose."""
    if not needs_grad(x, weight, bias):
        return _shift_add(x, weight, bias, dilation, layout)
    return _ShiftAdd.apply(x, weight, bias, dilation, layout)


# method='auto' on the torch backend (priorities from the speed suite on CPUs): shift-add reads X once per
# tap with no reshape, which beats every convolution for the small orders MF-PSN is used with; for large
# orders the Toeplitz product wins while its (C, T, T) matrix is small, else the layout's convolution.
register(Implementation("conv1d", "torch", LAYOUTS, conv1d, "reshape to (N*, C, T) + grouped Conv1d (the paper's vanilla)",
                        priority=lambda device, k, t: 1))
register(Implementation("vmap_mm", "torch", LAYOUTS, vmap_mm, "Vmap over C of a (T, T) Toeplitz matrix multiplication",
                        priority=lambda device, k, t: 5 if t <= 64 else 0, requirements=_vmap_mm_requirements))
register(Implementation("vmap_conv1d", "torch", ("time_last",), vmap_conv1d,
                        "Vmap over the feature dims of a grouped Conv1d"))
register(Implementation("conv2d", "torch", ("time_last",), conv2d,
                        "grouped Conv2d with a (1, k) kernel over (N, C, M, T)", priority=lambda device, k, t: 2))
register(Implementation("shift_add", "torch", LAYOUTS, shift_add, "k shifted slices accumulated in place, custom backward",
                        priority=lambda device, k, t: 10 if k <= 8 else 0))
