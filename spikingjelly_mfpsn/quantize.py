"""Power-of-two weight quantisation (paper Sec. 4.2) and its straight-through estimators.

``Q(w) = sign(w) * 2 ** round(log2 |w|)``: every quantised weight is a signed power of two, so a
product ``Q(w) * x`` is a bit shift of ``x`` on integer hardware.

Two gradients are offered:

* ``'whole'`` (default, the paper's choice): ``dQ/dw = 1``, the whole quantiser is treated as the
  identity in the backward pass.
* ``'round'``: only ``round`` is straight-through (``round'(x) = 1``), which gives
  ``dQ/dw = 2 ** round(log2 |w|) / |w|``; discontinuous, kept for the paper's ablation. Its value at
  ``w = 0`` is defined as 0 instead of 0/0.
"""
from __future__ import annotations

import functools
import math

import torch

STE_MODES = ("whole", "round")


@functools.lru_cache(maxsize=None)
def _round_up_from(dtype: torch.dtype) -> float:
    """The smallest mantissa ``m`` in [1/2, 1) of ``dtype`` with ``m >= sqrt(1/2)``: ``|w| = m * 2**e``
    rounds to ``2**e`` from there on and to ``2**(e-1)`` below (an exact test, unlike a float log2, which
    can round across the midpoint). ``m = N / 2**p`` with ``p`` significand bits: the least ``N`` with
    ``N**2 >= 2**(2p-1)``."""
    p = round(-math.log2(torch.finfo(dtype).eps)) + 1
    return (math.isqrt(2 ** (2 * p - 1) - 1) + 1) / 2 ** p


def _exponent(w: torch.Tensor) -> torch.Tensor:
    """``round(log2 |w|)``, decided exactly, clamped to the largest integer e with 2**e finite in the
    dtype of ``w`` (127 for float32); -inf where ``w == 0``, NaN where ``w`` is NaN.

    A float log2 can round across a midpoint 2**(e + 1/2). Every float32 (so float16 and bfloat16)
    value lies too far from one for float64's log2 to (a test checks every float32 mantissa), so those
    take it; float64 compares its mantissa with the least one >= sqrt(1/2)."""
    top = math.frexp(torch.finfo(w.dtype).max)[1] - 1
    if w.dtype != torch.float64:
        return torch.log2(w.abs().double()).round_().clamp_(max=top).to(w.dtype)
    m, e = torch.frexp(w.abs())
    e = torch.where(m < _round_up_from(w.dtype), e - 1, e).to(w.dtype).clamp_(max=top)
    return e.masked_fill_(w.isinf(), top).masked_fill_(w == 0, -math.inf).masked_fill_(w.isnan(), math.nan)


def quantize_pow2_(w: torch.Tensor) -> torch.Tensor:
    """``Q(w)`` without gradient: ``sign(w) * 2 ** round(log2 |w|)``.

    Zero stays zero (log2 0 = -inf, 2**-inf = 0, sign 0 = 0); exponents too small for the dtype
    underflow to zero as a long right shift would; exponents too large are clamped so the result
    stays finite.
    """
    return torch.sign(w) * torch.exp2(_exponent(w))


def shift_amounts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer exponents and signs of ``Q(w)``: ``Q(w) == sign * 2.0 ** shift`` (computed in ``w``'s dtype).

    Returns ``(shift, sign)``, both ``int32`` of the shape of ``w``. Where ``w == 0`` the sign is 0 and
    the shift is reported as 0.
    """
    w = w.detach()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantise weights that contain NaN or inf")
    e = _exponent(w).masked_fill_(w == 0, 0)
    return e.to(torch.int32), torch.sign(w).to(torch.int32)


class _PowerOfTwoWholeSTE(torch.autograd.Function):
    """Q with ``dQ/dw = 1``. (Not ``w + (Q(w) - w).detach()``: where ``w`` overflowed to inf, e.g. a batch
    norm folded into it, that is NaN, while Q clamps it to the largest power of two.)"""

    @staticmethod
    def forward(w):
        return quantize_pow2_(w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class _PowerOfTwoRoundSTE(torch.autograd.Function):
    """Q with ``round'(x) = 1``: ``dQ/dw = 2 ** round(log2|w|) / |w|`` (0 at w = 0)."""

    @staticmethod
    def forward(w):
        return quantize_pow2_(w)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (this form runs under torch.func transforms too)
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        w, q = ctx.saved_tensors
        absw = w.abs()
        safe = torch.where(absw > 0, absw, torch.ones_like(absw))
        return grad * torch.where(absw > 0, q.abs() / safe, torch.zeros_like(absw))


def quantize(w: torch.Tensor, ste: str = "whole") -> torch.Tensor:
    """Power-of-two quantiser with a straight-through gradient (see module docstring)."""
    if ste not in STE_MODES:
        raise ValueError(f"ste must be one of {STE_MODES}, got {ste!r}")
    if not (w.requires_grad and torch.is_grad_enabled()):
        return quantize_pow2_(w)  # no graph to build (e.g. eval under no_grad): the same values
    return (_PowerOfTwoWholeSTE if ste == "whole" else _PowerOfTwoRoundSTE).apply(w)
