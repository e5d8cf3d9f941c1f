"""Per-channel reductions over every other dim, fast on strided CPU tensors.

``t.sum(dims)`` over several dims that keep one in the middle can be an order of magnitude slower on
CPUs than reducing the innermost dim first; these helpers reduce a contiguous-most axis first (where
the data is streamed once), then the much smaller remainder.
"""
from __future__ import annotations

import torch


def _first_axis(t: torch.Tensor, channel_axis: int) -> int:
    channel_axis %= t.dim()
    return t.dim() - 1 if channel_axis != t.dim() - 1 else 0


def _rest(r: torch.Tensor, channel_axis: int, removed: int) -> torch.Tensor:
    c = channel_axis if removed > channel_axis else channel_axis - 1
    dims = [i for i in range(r.dim()) if i != c]
    return r.sum(dims) if dims else r


def channel_sum(t: torch.Tensor, channel_axis: int) -> torch.Tensor:
    """``t`` summed over every dim but ``channel_axis``: shape ``(C,)``."""
    channel_axis %= t.dim()
    first = _first_axis(t, channel_axis)
    return _rest(t.sum(first), channel_axis, first)


def channel_dot(a: torch.Tensor, b: torch.Tensor, channel_axis: int) -> torch.Tensor:
    """``(a * b)`` summed over every dim but ``channel_axis``, without materialising ``a * b``."""
    channel_axis %= a.dim()
    first = _first_axis(a, channel_axis)
    return _rest(torch.linalg.vecdot(a, b, dim=first), channel_axis, first)


class BatchStats(torch.autograd.Function):
    """Per-channel mean and biased variance of ``y`` over every dim but ``channel_axis`` (0 and 0 for
    an empty batch, as the C++ kernels give; float16 and bfloat16 accumulated in float32).

    Corrected two-pass (the mean, then the sum and squared norm of ``z = y - mean``, with
    ``var = (|z|^2 - (sum z)^2 / n) / n``) so large means do not cancel, and a channel that is the same
    everywhere gets a variance of 0 even where the float mean is an ulp off; the backward is one fused
    pass, ``dy = a[c] * y + b[c]``. Much faster on CPUs than ``torch.var_mean`` over strided dims.
    """

    @staticmethod
    def forward(y, channel_axis):
        if y.dtype in (torch.float16, torch.bfloat16):  # (16-bit sums overflow float16's 65504 at 64k values of 1)
            mean, var = BatchStats.forward(y.float(), channel_axis)
            return mean.to(y.dtype), var.to(y.dtype)
        shape = [1] * y.dim()
        shape[channel_axis] = -1
        n = max(y.numel() // max(y.shape[channel_axis], 1), 1)  # an empty batch: mean 0, var 0, not NaN
        mean = channel_sum(y, channel_axis) / n
        z = y - mean.view(shape)
        off = channel_sum(z, channel_axis) / n
        # (out of place: dynamo of torch 2.11 lost the gradient of an output changed in place)
        var = (channel_dot(z, z, channel_axis) / n - off * off).clamp(min=0)
        return mean + off, var

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form runs under torch.func transforms too)
        y, channel_axis = inputs
        ctx.save_for_backward(y, output[0])
        ctx.shape = [-1 if d == channel_axis % y.dim() else 1 for d in range(y.dim())]
        ctx.n = max(y.numel() // max(y.shape[channel_axis], 1), 1)

    @staticmethod
    def backward(ctx, g_mean, g_var):
        y, mean = ctx.saved_tensors
        n, shape = ctx.n, ctx.shape
        g_mean = torch.zeros_like(mean) if g_mean is None else g_mean
        g_var = torch.zeros_like(mean) if g_var is None else g_var
        scale = 2.0 * g_var / n
        shift = g_mean / n - scale * mean
        return torch.addcmul(shift.view(shape), y, scale.view(shape)), None


def batch_stats(y: torch.Tensor, channel_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, biased var)`` per channel of ``y``, differentiable (see :class:`BatchStats`)."""
    return BatchStats.apply(y, channel_axis)


def fold_bn(weight: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, mean: torch.Tensor,
            var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch normalisation of the charge folded into its ``(C, k)`` weight and a bias:
    ``(gamma / sqrt(var + eps) * W, beta - gamma * mean / sqrt(var + eps))``.

    Where the variance is 0 (a constant channel: every deviation from the mean is 0, and so is the
    variance's derivative w.r.t. the charge) it passes no gradient: d/dvar of ``(var + eps) ** -0.5``
    overflows for a tiny eps, and inf times those zero deviations would be NaN."""
    if var.requires_grad:
        var = torch.where(var > 0, var, var.detach())
    scale = gamma * torch.rsqrt(var + eps)
    return weight * scale.unsqueeze(1), beta - mean * scale
