"""Triton kernels for the charge in both layouts (paper Appendix A, Algorithms 2 and 3).

Every tensor is addressed through strides as logical ``(T, N, C, M)``, ``M`` being the trailing
feature dims merged into one (a view, so no copy, whenever their strides allow it; otherwise one
explicit copy): time-first ``(T, N, C, ...)`` and time-last ``(N, C, ..., T)`` run the same kernels
in place, with no reshape of ``T`` and no transpose.

A program owns a ``(BR, BC, BT)`` tile: rows ``r = n * M + m``, channels ``c``, steps ``t``.

* :func:`_charge_fwd_kernel` -- ``H[t] = sum_i W[c, i] * X[t - (k-1-i) d] + b[c]``, bias fused, and
  optionally the spike ``S = (H >= 0)`` (threshold fused: the bias is ``-V_th``) so that
  charge + fire reads X once and writes S once. Autotuned per layout (no reduction, so any tile gives
  the same bits).
* :func:`_charge_bwd_kernel` -- one pass over ``dL/dH`` and X giving all three gradients:
  ``dL/dX[t] = sum_i W[c, i] * dL/dH[t + (k-1-i) d]`` (the forward convolution with the flipped
  weight, run backwards in time), and per-program partial sums of ``dL/dW`` and ``dL/db`` that a
  second stage adds up in a fixed order (deterministic: no atomics). In the fused path it forms
  ``dL/dH = dL/dS * surrogate'(H)`` on the fly, H recomputed from X: a training step with the
  parameter threshold reads X and writes S forward, reads X and dL/dS and writes dL/dX backward.
* The BN-threshold step, six kernels: forward :func:`_bn_moments_kernel` (per-channel moments of the
  charge, nothing X-sized written), :func:`_bn_fold_kernel` (statistics, running statistics, the BN
  folded and quantised) and the spike kernel; backward :func:`_bn_grad_moments_kernel`,
  :func:`_bn_grad_fold_kernel` (the closed-form gradients of the folding and the statistics) and
  :func:`_bn_grad_x_kernel`. Only X is kept for the backward.
* A batch norm of X in front of the neuron (``input_bn``, IN_BN) fused into that step: its statistics
  by the moments and fold kernels run on X with a weight of ones (two more launches forward), X
  normalised where every kernel reads it, and its gradients among K5's closed forms (K4 adds per-tap
  sums over the steps a tap reaches); X is read once more forward, nothing more backward.

Kernels that reduce run on tiles and program counts chosen from the shape and device alone, and their
partial sums are added in a fixed order: every run and every process gives the same bits.
Accumulation is in float32 (float64 for float64 inputs). Kernels need a CUDA device, or
``TRITON_INTERPRET=1`` set before this module is imported (then they run on the CPU).
"""
from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from . import launch, surrogate, tiles
from .registry import LAYOUTS, Implementation, channel_dim, first_order_only, needs_grad, register

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- kernels
@triton.jit
def _tile_offsets(r, c, M, s_n, s_c, s_m):
    """(BR, BC, 1) offsets of rows ``r = n * M + m`` and channels ``c`` (time added separately)."""
    n = r // M
    m = r - n * M
    return (n * s_n + m * s_m)[:, None, None] + (c * s_c)[None, :, None]


@triton.jit
def _constant(hi, lo, ACC: tl.constexpr):
    """A float the host split into float32 ``hi + lo`` (kernel float arguments are float32), in ACC."""
    return tl.cast(hi, ACC) + tl.cast(lo, ACC)


_SG_ATAN = tl.constexpr(surrogate.CODES["ATan"])  # the surrogate table's codes


@triton.jit
def _surrogate_grad(h, c1, c2, SG: tl.constexpr):
    """SpikingJelly's surrogate derivative at ``h`` (constants from :func:`surrogate_constants`): ATan,
    ``c2 / (1 + (c1 h)^2)``; Sigmoid, ``c1 s (1 - s)`` with ``s = sigmoid(c1 h)``."""
    if SG == _SG_ATAN:
        ax = c1 * h
        g = c2 / (1.0 + ax * ax)
    else:
        s = tl.sigmoid(c1 * h)
        g = c1 * (1.0 - s) * s
    return g


@triton.jit
def _input_bn(P0, c, cmask, C, ACC: tl.constexpr):
    """Per channel (BC,): the input batch norm of a fused pair, ``Y = (X - mean0) * a0 + beta0``, as rows
    0, 1, 2 of the dense (5, C) P0 (``a0 = gamma0 / sqrt(var0 + eps0)``)."""
    mu = tl.load(P0 + c, mask=cmask, other=0.0).to(ACC)
    a = tl.load(P0 + C + c, mask=cmask, other=0.0).to(ACC)
    return mu, a, tl.load(P0 + 2 * C + c, mask=cmask, other=0.0).to(ACC)


@triton.jit
def _normalised(xv, mask, mu, a, b, IN_BN: tl.constexpr):
    """X as the charge reads it: through the input batch norm with IN_BN (zero outside ``mask``, the
    causal padding of Y), else as it is."""
    if IN_BN:
        xv = tl.where(mask, (xv - mu) * a + b, 0.0)
    return xv


@triton.jit
def _pre1(P0, c, cmask, C, IN_BN: tl.constexpr, ACC: tl.constexpr):
    """:func:`_input_bn` (placeholders without IN_BN)."""
    if IN_BN:
        out = _input_bn(P0, c, cmask, C, ACC)
    else:
        out = (0.0, 1.0, 0.0)
    return out


@triton.jit
def _pre3(P0, c, cmask, C, IN_BN: tl.constexpr, ACC: tl.constexpr):
    """:func:`_input_bn` shaped (1, BC, 1) for :func:`_charges` (placeholders without IN_BN)."""
    if IN_BN:
        mu, a, b = _input_bn(P0, c, cmask, C, ACC)
        out = (mu[None, :, None], a[None, :, None], b[None, :, None])
    else:
        out = (0.0, 1.0, 0.0)
    return out


@triton.jit
def _charge_fwd_kernel(X, W, B, H, S, P0, R, C, T, M, K, dilation,
                       sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k, sb,
                       HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, SPIKE: tl.constexpr, IN_BN: tl.constexpr,
                       ACC: tl.constexpr, EXACT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                       BT: tl.constexpr):
    """H (and/or S) for one (BR, BC, BT) tile; X strided, H and S dense of the same logical shape.
    EXACT (a float32 accumulator): spikes of non-finite charges from float64 (_exact_if_overflowed).
    IN_BN: X read through the input batch norm P0 (:func:`_input_bn`)."""
    pid = tl.program_id(0)
    n_tb = tl.cdiv(T, BT)
    n_cb = tl.cdiv(C, BC)
    tb = pid % n_tb
    cb = (pid // n_tb) % n_cb
    rb = pid // (n_tb * n_cb)
    r = (rb * BR + tl.arange(0, BR)).to(tl.int64)
    c = (cb * BC + tl.arange(0, BC)).to(tl.int64)
    t = (tb * BT + tl.arange(0, BT)).to(tl.int64)
    rc_mask = (r < R)[:, None, None] & (c < C)[None, :, None]
    x_rc = _tile_offsets(r, c, M, sx_n, sx_c, sx_m)
    pre = _pre3(P0, c, c < C, C, IN_BN, ACC)
    acc = tl.zeros((BR, BC, BT), dtype=ACC)
    for i in range(K):
        # Tap i reads (k-1-i)*d steps back; steps before 0 are the causal zero padding.
        src = t - (K - 1 - i) * dilation
        mask = rc_mask & ((src >= 0) & (t < T))[None, None, :]
        xv = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask, other=0.0).to(ACC)
        xv = _normalised(xv, mask, pre[0], pre[1], pre[2], IN_BN)
        wv = tl.load(W + c * sw_c + i * sw_k, mask=c < C, other=0.0)
        acc += wv.to(ACC)[None, :, None] * xv
    if HAS_BIAS:
        acc += tl.load(B + c * sb, mask=c < C, other=0.0).to(ACC)[None, :, None]
    out = _tile_offsets(r, c, M, so_n, so_c, so_m) + (t * so_t)[None, None, :]
    mask = rc_mask & (t < T)[None, None, :]
    if STORE_H:
        h = acc.to(H.dtype.element_ty)
        tl.store(H + out, h, mask=mask)
        acc = h.to(ACC)  # the Heaviside of the stored (rounded) H, exactly what the surrogate module would see
    if SPIKE:
        if EXACT:  # a charge beyond float32's range: the sign of the float64 one (see _exact_if_overflowed)
            acc = _exact_if_overflowed(acc, X, x_rc, rc_mask, t, T, W, B, P0, c, C, K, dilation, sx_t, sw_c, sw_k,
                                       sb, HAS_BIAS, IN_BN, BR, BC, BT)
        # (compared widened: the interpreter cannot compare bfloat16)
        tl.store(S + out, tl.where(acc >= 0, 1.0, 0.0).to(S.dtype.element_ty), mask=mask)


@triton.jit
def _exact_if_overflowed(acc, X, x_rc, rc_mask, t, T, W, B, P0, c, C, K, dilation, sx_t, sw_c, sw_k, sb,
                         HAS_BIAS: tl.constexpr, IN_BN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         BT: tl.constexpr):
    """``acc`` where it is finite; elsewhere (a sum that overflowed float32 on the way, or a NaN or inf
    input) the charge recomputed in float64 from the same taps and bias, in the same order. Only tiles
    with such an element run the recomputation (a branch on the tile)."""
    bad = (acc - acc) != 0  # (NaN where acc is not finite)
    if tl.sum(bad.to(tl.int32), axis=None) > 0:
        exact = tl.zeros((BR, BC, BT), dtype=tl.float64)
        pre = _pre3(P0, c, c < C, C, IN_BN, tl.float64)
        for i in range(K):
            src = t - (K - 1 - i) * dilation
            mask = rc_mask & ((src >= 0) & (t < T))[None, None, :]
            xv = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask, other=0.0).to(tl.float64)
            xv = _normalised(xv, mask, pre[0], pre[1], pre[2], IN_BN)
            wv = tl.load(W + c * sw_c + i * sw_k, mask=c < C, other=0.0)
            exact += wv.to(tl.float64)[None, :, None] * xv
        if HAS_BIAS:
            exact += tl.load(B + c * sb, mask=c < C, other=0.0).to(tl.float64)[None, :, None]
        acc = tl.where(bad, exact.to(acc.dtype), acc)
    return acc


@triton.jit
def _charge_at(X, x_rc, mask, t, W, B, c, C, K, dilation, sx_t, sw_c, sw_k, sb, HAS_BIAS: tl.constexpr,
               ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """H at steps ``t`` of one tile (``mask``: the elements inside the tensor), recomputed from X."""
    h = tl.zeros((BR, BC, BT), dtype=ACC)
    for j in range(K):
        src = t - (K - 1 - j) * dilation
        xj = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask & (src >= 0)[None, None, :],
                     other=0.0).to(ACC)
        h += tl.load(W + c * sw_c + j * sw_k, mask=c < C, other=0.0).to(ACC)[None, :, None] * xj
    if HAS_BIAS:
        h += tl.load(B + c * sb, mask=c < C, other=0.0).to(ACC)[None, :, None]
    return h


@triton.jit
def _charge_bwd_kernel(G, B, X, W, GX, PW, PB, R, C, T, M, K, dilation,
                       sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k, sb, c1_hi, c1_lo, c2_hi, c2_lo,
                       SG: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_GX: tl.constexpr, NEED_GW: tl.constexpr,
                       NEED_GB: tl.constexpr, ACC: tl.constexpr, EXACT: tl.constexpr, BK: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Program (channel block, split s) walks tiles s, s + S, ... of its channels. G (dL/dH, or dL/dS when
    SG != 0) and GX are dense; X is strided. With SG != 0 the charge H that the surrogate's derivative
    needs is recomputed from X (and the bias B), in ACC as the forward compared it (EXACT: see
    :func:`_exact_if_overflowed`): nothing X-sized is saved. Writes dL/dX tiles and this program's partial
    dL/dW (S, C, BK) and dL/db (S, C)."""
    cb, split = tl.program_id(0), tl.program_id(1)
    n_split = tl.num_programs(1)
    c = (cb * BC + tl.arange(0, BC)).to(tl.int64)
    kk = tl.arange(0, BK)
    n_tb = tl.cdiv(T, BT)
    n_tiles = tl.cdiv(R, BR) * n_tb
    gw = tl.zeros((BC, BK), dtype=ACC)
    gb = tl.zeros((BC,), dtype=ACC)
    for tile in range(split, n_tiles, n_split):
        r = ((tile // n_tb) * BR + tl.arange(0, BR)).to(tl.int64)
        t = ((tile % n_tb) * BT + tl.arange(0, BT)).to(tl.int64)
        rc_mask = (r < R)[:, None, None] & (c < C)[None, :, None]
        o_rc = _tile_offsets(r, c, M, so_n, so_c, so_m)
        x_rc = _tile_offsets(r, c, M, sx_n, sx_c, sx_m)
        xv = tl.zeros((BR, BC, BT), dtype=ACC)
        if NEED_GW:
            xv = tl.load(X + x_rc + (t * sx_t)[None, None, :], mask=rc_mask & (t < T)[None, None, :],
                         other=0.0).to(ACC)
        gx = tl.zeros((BR, BC, BT), dtype=ACC)
        for i in range(K):
            # X[t] reached H[t + (k-1-i)*d] through tap i.
            dst = t + (K - 1 - i) * dilation
            mask = rc_mask & (dst < T)[None, None, :]
            off = o_rc + (dst * so_t)[None, None, :]
            g = tl.load(G + off, mask=mask, other=0.0).to(ACC)
            if SG != 0:
                h = _charge_at(X, x_rc, mask, dst, W, B, c, C, K, dilation, sx_t, sw_c, sw_k, sb, HAS_BIAS, ACC,
                               BR, BC, BT)
                if EXACT:
                    h = _exact_if_overflowed(h, X, x_rc, rc_mask, dst, T, W, B, W, c, C, K, dilation, sx_t, sw_c,
                                             sw_k, sb, HAS_BIAS, False, BR, BC, BT)
                g = g * _surrogate_grad(h, _constant(c1_hi, c1_lo, ACC), _constant(c2_hi, c2_lo, ACC), SG)
            if NEED_GX:
                wv = tl.load(W + c * sw_c + i * sw_k, mask=c < C, other=0.0).to(ACC)
                gx += wv[None, :, None] * g
            if NEED_GW:
                part = tl.sum(tl.sum(g * xv, axis=2), axis=0)
                gw += tl.where(kk[None, :] == i, part[:, None], 0.0)
            if NEED_GB:
                if i == K - 1:  # the lag-0 tap: g is dL/dH[t] itself
                    gb += tl.sum(tl.sum(g, axis=2), axis=0)
        if NEED_GX:
            out = o_rc + (t * so_t)[None, None, :]
            tl.store(GX + out, gx.to(GX.dtype.element_ty), mask=rc_mask & (t < T)[None, None, :])
    row = split.to(tl.int64) * C + c
    if NEED_GW:
        tl.store(PW + row[:, None] * BK + kk[None, :], gw, mask=(c < C)[:, None])
    if NEED_GB:
        tl.store(PB + row, gb, mask=c < C)


# ---------------------------------------------------------------- BN-threshold training step
# Programs of the reduction kernels: (channel block, split); split s walks the tiles s, s + S, ... of its
# channels and writes one slot of per-channel partial sums, which the next kernel adds up in a fixed order.
# Tiles and the number of splits depend on the shape and the device only (never on autotuning), so
# every run and every process gives the same bits.
@triton.jit
def _tile_at(tile, n_tb, R, c, cmask, M, sx_n, sx_c, sx_m, BR: tl.constexpr, BT: tl.constexpr):
    """Tile number ``tile`` of channels ``c``: its rows and steps, the (BR, BC, 1) mask of rows and
    channels inside the tensor, and X's offsets of those rows and channels."""
    r = ((tile // n_tb) * BR + tl.arange(0, BR)).to(tl.int64)
    t = ((tile % n_tb) * BT + tl.arange(0, BT)).to(tl.int64)
    return r, t, (r < R)[:, None, None] & cmask[None, :, None], _tile_offsets(r, c, M, sx_n, sx_c, sx_m)


@triton.jit
def _charges(X, x_rc, rc_mask, t, W, WQ, B, pre, c, cmask, T, dilation, sx_t, sw_c, sw_k, K: tl.constexpr,
             FOLDED: tl.constexpr, RAW: tl.constexpr, IN_BN: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr,
             BC: tl.constexpr, BT: tl.constexpr):
    """On one tile, zero outside the tensor: ``(conv(Y, WQ) + B if FOLDED, conv(Y, W) if RAW)`` (zeros
    where not asked for), Y = X or, with IN_BN, X through the input batch norm ``pre`` (mean0, a0, beta0),
    each (1, BC, 1). WQ is a dense (C, K) tensor and B a dense (C,); W is addressed through strides."""
    hq = tl.zeros((BR, BC, BT), dtype=ACC)
    h = tl.zeros((BR, BC, BT), dtype=ACC)
    for i in tl.static_range(K):
        src = t - (K - 1 - i) * dilation
        mask = rc_mask & ((src >= 0) & (src < T) & (t < T))[None, None, :]
        xv = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask, other=0.0).to(ACC)
        xv = _normalised(xv, mask, pre[0], pre[1], pre[2], IN_BN)
        if FOLDED:
            hq += tl.load(WQ + c * K + i, mask=cmask, other=0.0).to(ACC)[None, :, None] * xv
        if RAW:
            h += tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0).to(ACC)[None, :, None] * xv
    if FOLDED:
        hq += tl.load(B + c, mask=cmask, other=0.0).to(ACC)[None, :, None]
    return hq, h


@triton.jit
def _shift(X, W, P0, c, cmask, C, T, dilation, sx_c, sx_t, sw_c, sw_k, K: tl.constexpr, IN_BN: tl.constexpr,
           ACC: tl.constexpr, BC: tl.constexpr):
    """Per channel, the charge of the first row at the last step: the point the moments are taken about,
    so that a charge that hardly varies (|mean| >> std) does not cancel in ``E[H^2] - E[H]^2``."""
    h = tl.zeros((BC,), dtype=ACC)
    pre = _pre1(P0, c, cmask, C, IN_BN, ACC)
    for i in tl.static_range(K):
        src = tl.full((BC,), 0, tl.int64) + (T - 1 - (K - 1 - i) * dilation)
        xv = tl.load(X + c * sx_c + src * sx_t, mask=cmask & (src >= 0), other=0.0).to(ACC)
        xv = _normalised(xv, cmask & (src >= 0), pre[0], pre[1], pre[2], IN_BN)
        h += tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0).to(ACC) * xv
    return h


@triton.jit
def _bn_moments_kernel(X, W, P0, PART, R, C, T, M, dilation, sx_n, sx_c, sx_m, sx_t, sw_c, sw_k,
                       K: tl.constexpr, IN_BN: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                       BT: tl.constexpr):
    """K1: this split's ``sum (H - shift)`` and ``sum (H - shift)^2`` per channel into PART (S, C, 2),
    ``H = conv(Y, W)`` recomputed in registers (nothing X-sized written; Y: see :func:`_charges`)."""
    cb = tl.program_id(0)
    split = tl.program_id(1)
    c = (cb * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    shift = _shift(X, W, P0, c, cmask, C, T, dilation, sx_c, sx_t, sw_c, sw_k, K, IN_BN, ACC, BC)[None, :, None]
    pre = _pre3(P0, c, cmask, C, IN_BN, ACC)
    n_tb = tl.cdiv(T, BT)
    s1 = tl.zeros((BR, BC, BT), dtype=ACC)
    s2 = tl.zeros((BR, BC, BT), dtype=ACC)
    for tile in range(split, tl.cdiv(R, BR) * n_tb, tl.num_programs(1)):
        r, t, rc_mask, x_rc = _tile_at(tile, n_tb, R, c, cmask, M, sx_n, sx_c, sx_m, BR, BT)
        _, h = _charges(X, x_rc, rc_mask, t, W, W, W, pre, c, cmask, T, dilation, sx_t, sw_c, sw_k, K, False, True,
                        IN_BN, ACC, BR, BC, BT)
        d = tl.where(rc_mask & (t < T)[None, None, :], h - shift, 0.0)
        s1 += d
        s2 += d * d
    row = (split.to(tl.int64) * C + c) * 2
    tl.store(PART + row, tl.sum(tl.sum(s1, axis=2), axis=0), mask=cmask)
    tl.store(PART + row + 1, tl.sum(tl.sum(s2, axis=2), axis=0), mask=cmask)


@triton.jit
def _finite(v):
    return (v - v) == 0.0  # NaN and inf give NaN


@triton.jit
def _pow2(w, F64: tl.constexpr):
    """Q(w) = sign(w) * 2^round(log2 |w|), the rounding decided exactly on the bits: 1.m * 2^e rounds up
    when m >= sqrt(2) - 1 (no tie: sqrt(2) is irrational), exponents clamped below inf. Subnormals
    are scaled into the normal range first (exactly), zero stays zero."""
    if F64:
        u = w.to(tl.int64, bitcast=True)
        sign = u & (-0x7FFFFFFFFFFFFFFF - 1)
        e = (u >> 52) & 0x7FF
        up = ((u & 0xFFFFFFFFFFFFF) >= 0x6A09E667F3BCD).to(tl.int64)
        q = (sign | (tl.minimum(e + up, 0x7FE) << 52)).to(tl.float64, bitcast=True)
        small = w * 18446744073709551616.0  # 2^64
        us = small.to(tl.int64, bitcast=True)
        es = (us >> 52) & 0x7FF
        ups = ((us & 0xFFFFFFFFFFFFF) >= 0x6A09E667F3BCD).to(tl.int64)
        qs = ((us & (-0x7FFFFFFFFFFFFFFF - 1)) | ((es + ups) << 52)).to(tl.float64, bitcast=True)
        qs = qs * 5.421010862427522e-20  # 2^-64
    else:
        u = w.to(tl.int32, bitcast=True)
        sign = u & (-0x7FFFFFFF - 1)
        e = (u >> 23) & 0xFF
        up = ((u & 0x7FFFFF) >= 0x3504F4).to(tl.int32)
        q = (sign | (tl.minimum(e + up, 0xFE) << 23)).to(tl.float32, bitcast=True)
        small = w * 18446744073709551616.0
        us = small.to(tl.int32, bitcast=True)
        es = (us >> 23) & 0xFF
        ups = ((us & 0x7FFFFF) >= 0x3504F4).to(tl.int32)
        qs = ((us & (-0x7FFFFFFF - 1)) | ((es + ups) << 23)).to(tl.float32, bitcast=True)
        qs = qs * 5.421010862427522e-20
    return tl.where(w == 0.0, w, tl.where(e == 0, qs, q))


@triton.jit
def _round_ste(g, w, wq):
    """``g * dQ/dw`` for the 'round' estimator, ``dQ/dw = |Q(w)| / |w|`` (0 at w = 0), in float64."""
    nonzero = w != 0.0
    return g * tl.where(nonzero, tl.abs(wq).to(tl.float64) / tl.where(nonzero, tl.abs(w), 1.0).to(tl.float64), 0.0)


@triton.jit
def _inv_std(var, eps, F64: tl.constexpr):
    """1 / sqrt(var + eps), correctly rounded (as the C++ kernels and torch on the CPU compute it)."""
    if F64:
        r = 1.0 / tl.sqrt(var + eps)
    else:
        v = var + eps
        r = tl.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))
    return r


@triton.jit
def _lerp(a, b, f):
    """torch.lerp(a, b, f) for a scalar f, with torch's two formulas."""
    return tl.where(f < 0.5, a + f * (b - a), b - (b - a) * (1.0 - f))


@triton.jit
def _bn_fold_kernel(PART, X, W, P0, GAMMA, BETA, RM, RV, MEAN, VAR, WQ, B, OK, n_split, C, T, count, dilation,
                    sx_c, sx_t, sw_c, sw_k, s_g, s_b, s_rm, s_rv, s_mean, s_var, eps_hi, eps_lo, f_hi, f_lo,
                    K: tl.constexpr, GIVEN: tl.constexpr, RUNNING: tl.constexpr, QUANT: tl.constexpr,
                    IN_BN: tl.constexpr, PRE: tl.constexpr, ACC: tl.constexpr, F64: tl.constexpr, BC: tl.constexpr,
                    BS: tl.constexpr):
    """K2, per channel: the batch statistics from K1's partials, added in a fixed order in float64 (or
    the given ones), the running statistics blended (only where the folding is finite), the BN folded
    into ``WQ = Q(gamma / sqrt(var + eps) * W)`` and ``B = beta - mean * gamma / sqrt(var + eps)`` (in
    the parameters' dtype P, as the general path computes them), and OK = whether that folding is finite
    (weight, gamma, beta, mean, var and ``var + eps > 0``). IN_BN: the charge's X through the input batch norm
    P0, whose OK row joins this one. PRE (the input batch norm's own fold, W = 1): B = beta, so that
    ``Y = (X - mean) * WQ + B``."""
    P = W.dtype.element_ty
    c = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    n = count.to(tl.float64)
    if GIVEN:
        mean = tl.load(MEAN + c * s_mean, mask=cmask, other=0.0).to(P)
        var = tl.load(VAR + c * s_var, mask=cmask, other=1.0).to(P)
    else:
        ss = tl.arange(0, BS)
        s1 = tl.zeros((BS, BC), dtype=tl.float64)
        s2 = tl.zeros((BS, BC), dtype=tl.float64)
        for s0 in range(0, n_split, BS):
            rows = (s0 + ss).to(tl.int64)
            off = (rows[:, None] * C + c[None, :]) * 2
            m = (rows < n_split)[:, None] & cmask[None, :]
            s1 += tl.load(PART + off, mask=m, other=0.0).to(tl.float64)
            s2 += tl.load(PART + off + 1, mask=m, other=0.0).to(tl.float64)
        m1 = tl.sum(s1, axis=0) / n
        var64 = tl.maximum(tl.sum(s2, axis=0) / n - m1 * m1, 0.0)
        shift = _shift(X, W, P0, c, cmask, C, T, dilation, sx_c, sx_t, sw_c, sw_k, K, IN_BN, ACC, BC)
        mean = (shift.to(tl.float64) + m1).to(P)
        var = var64.to(P)
        tl.store(MEAN + c, mean, mask=cmask)
        tl.store(VAR + c, var, mask=cmask)
    eps = _constant(eps_hi, eps_lo, P)
    gamma = tl.load(GAMMA + c * s_g, mask=cmask, other=1.0)
    beta = tl.load(BETA + c * s_b, mask=cmask, other=0.0)
    ok = _finite(gamma) & _finite(beta) & _finite(mean) & _finite(var) & (var.to(tl.float64) + eps.to(tl.float64) > 0)
    if IN_BN:  # and the input batch norm's folding (P0 row 4)
        ok = ok & (tl.load(P0 + 4 * C + c, mask=cmask, other=1.0) != 0)
    for i in tl.static_range(K):
        ok = ok & _finite(tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0))
    if RUNNING:
        f = _constant(f_hi, f_lo, P)
        upd = cmask & ok
        rm = tl.load(RM + c * s_rm, mask=upd, other=0.0)
        rv = tl.load(RV + c * s_rv, mask=upd, other=0.0)
        unbiased = var * (n / tl.maximum(n - 1.0, 1.0)).to(P)
        tl.store(RM + c * s_rm, _lerp(rm, mean, f), mask=upd)
        tl.store(RV + c * s_rv, _lerp(rv, unbiased, f), mask=upd)
    scale = gamma * _inv_std(var, eps, F64)
    for i in tl.static_range(K):
        wf = tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0) * scale
        if QUANT:
            wf = _pow2(wf, F64)
        tl.store(WQ + c * K + i, wf, mask=cmask)
    tl.store(B + c, beta if PRE else beta - mean * scale, mask=cmask)
    tl.store(OK + c, ok.to(OK.dtype.element_ty), mask=cmask)


@triton.jit
def _bn_grad_moments_kernel(G, X, W, WQ, B, MEAN, P0, PART, R, C, T, M, dilation,
                            sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k, c1_hi, c1_lo, c2_hi, c2_lo,
                            K: tl.constexpr, BK: tl.constexpr, SG: tl.constexpr, STATS: tl.constexpr,
                            IN_BN: tl.constexpr, ROWS: tl.constexpr, ACC: tl.constexpr, EXACT: tl.constexpr,
                            BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """K4: this split's per-channel sums into PART (S, C, ROWS, BK), with ``g = dL/dS * surrogate'(H')`` and
    ``H' = conv(Y, WQ) + B`` recomputed (Y: see :func:`_charges`): row 0 ``sum g Z_i`` (Z = X - mean0 with
    IN_BN, else X; Z_i as tap i reads it), row 3 ``sum g`` over the steps tap i reaches; with STATS (batch
    statistics) row 1 ``sum Z_i`` and row 2 ``sum (H - mean) Z_i``, ``H = conv(Y, W)``; with IN_BN and
    STATS, row 4 ``sum (H - mean)`` over the steps tap i reaches."""
    cb = tl.program_id(0)
    split = tl.program_id(1)
    c = (cb * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    kk = tl.arange(0, BK)
    c1 = _constant(c1_hi, c1_lo, ACC)
    c2 = _constant(c2_hi, c2_lo, ACC)
    mean = tl.load(MEAN + c, mask=cmask, other=0.0).to(ACC)[None, :, None]
    pre = _pre3(P0, c, cmask, C, IN_BN, ACC)
    n_tb = tl.cdiv(T, BT)
    g_x = tl.zeros((BC, BK), dtype=ACC)
    s_x = tl.zeros((BC, BK), dtype=ACC)
    q_x = tl.zeros((BC, BK), dtype=ACC)
    g_m = tl.zeros((BC, BK), dtype=ACC)
    h_m = tl.zeros((BC, BK), dtype=ACC)
    for tile in range(split, tl.cdiv(R, BR) * n_tb, tl.num_programs(1)):
        r, t, rc_mask, x_rc = _tile_at(tile, n_tb, R, c, cmask, M, sx_n, sx_c, sx_m, BR, BT)
        hq, h = _charges(X, x_rc, rc_mask, t, W, WQ, B, pre, c, cmask, T, dilation, sx_t, sw_c, sw_k, K, True,
                         STATS, IN_BN, ACC, BR, BC, BT)
        if EXACT:  # (WQ dense (C, K), B dense (C,))
            hq = _exact_if_overflowed(hq, X, x_rc, rc_mask, t, T, WQ, B, P0, c, C, K, dilation, sx_t, K, 1, 1, True,
                                      IN_BN, BR, BC, BT)
        o_mask = rc_mask & (t < T)[None, None, :]
        g = tl.load(G + _tile_offsets(r, c, M, so_n, so_c, so_m) + (t * so_t)[None, None, :], mask=o_mask,
                    other=0.0).to(ACC) * _surrogate_grad(hq, c1, c2, SG)
        hc = tl.where(o_mask, h - mean, 0.0)
        for i in tl.static_range(K):
            src = t - (K - 1 - i) * dilation
            reach = ((src >= 0) & (t < T))[None, None, :]
            mask = rc_mask & reach
            xv = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask, other=0.0).to(ACC)
            if IN_BN:
                xv = tl.where(mask, xv - pre[0], 0.0)
            g_x += tl.where(kk[None, :] == i, tl.sum(tl.sum(g * xv, axis=2), axis=0)[:, None], 0.0)
            g_m += tl.where(kk[None, :] == i, tl.sum(tl.sum(tl.where(reach, g, 0.0), axis=2), axis=0)[:, None], 0.0)
            if STATS:
                s_x += tl.where(kk[None, :] == i, tl.sum(tl.sum(xv, axis=2), axis=0)[:, None], 0.0)
                q_x += tl.where(kk[None, :] == i, tl.sum(tl.sum(hc * xv, axis=2), axis=0)[:, None], 0.0)
                if IN_BN:
                    h_m += tl.where(kk[None, :] == i, tl.sum(tl.sum(tl.where(reach, hc, 0.0), axis=2), axis=0)[:, None],
                                    0.0)
    out = ((split.to(tl.int64) * C + c) * ROWS)[:, None] * BK + kk[None, :]
    tl.store(PART + out, g_x, mask=cmask[:, None])
    tl.store(PART + out + BK, s_x, mask=cmask[:, None])
    tl.store(PART + out + 2 * BK, q_x, mask=cmask[:, None])
    tl.store(PART + out + 3 * BK, g_m, mask=cmask[:, None])
    if ROWS > 4:
        tl.store(PART + out + 4 * BK, h_m, mask=cmask[:, None])


@triton.jit
def _split_sum(PART, n_split, c, cmask, C, row: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
               BS: tl.constexpr):
    """(BC, BK): row ``row`` of K4's partials (S, C, ROWS, BK), added over the splits in a fixed order in
    float64."""
    kk = tl.arange(0, BK)
    ss = tl.arange(0, BS)
    acc = tl.zeros((BS, BC, BK), dtype=tl.float64)
    for s0 in range(0, n_split, BS):
        rows = (s0 + ss).to(tl.int64)
        off = ((rows[:, None] * C + c[None, :]) * ROWS + row)[:, :, None] * BK + kk[None, None, :]
        m = ((rows < n_split)[:, None] & cmask[None, :])[:, :, None]
        acc += tl.load(PART + off, mask=m, other=0.0).to(tl.float64)
    return tl.sum(acc, axis=0)


@triton.jit
def _bn_grad_fold_kernel(PART, W, GAMMA, MEAN, VAR, WQ, P0, GW, GGAMMA, GBETA, COEF, GPRE, n_split, C, T, count,
                         dilation, sw_c, sw_k, s_g, s_mean, s_var, eps_hi, eps_lo, eps0_hi, eps0_lo, K: tl.constexpr,
                         BK: tl.constexpr, ROUND: tl.constexpr, STATS: tl.constexpr, IN_BN: tl.constexpr,
                         STATS0: tl.constexpr, ROWS: tl.constexpr, F64: tl.constexpr, BC: tl.constexpr,
                         BS: tl.constexpr):
    """K5, per channel: K4's partials added in a fixed order in float64, then the closed-form gradients
    of the folding ``WQ = Q(a W)``, ``B = beta - mean a``, ``a = gamma / sqrt(var + eps)``: dL/dW,
    dL/dgamma, dL/dbeta; with STATS, also through the batch statistics, whose gradient w.r.t. the charge
    ``H`` is ``A + Bh (H - mean)`` per channel: (A, Bh) into COEF for K6, and their part of dL/dW. With
    IN_BN, the input batch norm's too (:func:`_input_bn_grads`)."""
    P = W.dtype.element_ty
    c = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    kk = tl.arange(0, BK)
    g_z = _split_sum(PART, n_split, c, cmask, C, 0, ROWS, BK, BC, BS)
    g_m = _split_sum(PART, n_split, c, cmask, C, 3, ROWS, BK, BC, BS)
    g_0 = tl.sum(tl.where(kk[None, :] == K - 1, g_m, 0.0), axis=1)  # (BC,): dL/dB (the lag-0 tap reaches every step)
    wmask = cmask[:, None] & (kk[None, :] < K)
    w = tl.load(W + c[:, None] * sw_c + kk[None, :] * sw_k, mask=wmask, other=0.0)
    wq = tl.load(WQ + c[:, None] * K + kk[None, :], mask=wmask, other=0.0)
    gamma = tl.load(GAMMA + c * s_g, mask=cmask, other=1.0)
    mean = tl.load(MEAN + c * s_mean, mask=cmask, other=0.0)
    var = tl.load(VAR + c * s_var, mask=cmask, other=1.0)
    inv = _inv_std(var, _constant(eps_hi, eps_lo, P), F64)
    a = gamma * inv  # (as K2 computes it)
    n = count.to(tl.float64)
    reach = (count // T).to(tl.float64) * tl.maximum(T - (K - 1 - kk) * dilation, 0).to(tl.float64)[None, :]
    mu0, a0, b0 = _pre1(P0, c, cmask, C, IN_BN, tl.float64)
    g_x = _through_input_bn(g_z, g_m, a0, b0, IN_BN)  # dL/dWQ
    if ROUND:  # dQ/dw = |Q(w)| / |w| (0 at w = 0)
        g_x = _round_ste(g_x, w * a[:, None], wq)
    a64 = a.to(tl.float64)
    inv64 = inv.to(tl.float64)
    g_w = a64[:, None] * g_x
    g_a = tl.sum(w.to(tl.float64) * g_x, axis=1) - mean.to(tl.float64) * g_0
    coef_a = tl.zeros((BC,), dtype=tl.float64)
    coef_b = tl.zeros((BC,), dtype=tl.float64)
    s_z = tl.zeros((BC, BK), dtype=tl.float64)
    q_z = s_z
    h_m = s_z
    if STATS:
        s_z = _split_sum(PART, n_split, c, cmask, C, 1, ROWS, BK, BC, BS)
        q_z = _split_sum(PART, n_split, c, cmask, C, 2, ROWS, BK, BC, BS)
        if IN_BN:
            h_m = _split_sum(PART, n_split, c, cmask, C, 4, ROWS, BK, BC, BS)
        coef_a = -a64 * g_0 / n
        coef_b = tl.where(var > 0, -g_a * gamma.to(tl.float64) * inv64 * inv64 * inv64 / n, 0.0)  # (as fold_bn)
        g_w += coef_a[:, None] * _through_input_bn(s_z, reach, a0, b0, IN_BN) + \
            coef_b[:, None] * _through_input_bn(q_z, h_m, a0, b0, IN_BN)
        tl.store(COEF + c * 2, coef_a.to(COEF.dtype.element_ty), mask=cmask)
        tl.store(COEF + c * 2 + 1, coef_b.to(COEF.dtype.element_ty), mask=cmask)
    tl.store(GW + c[:, None] * K + kk[None, :], g_w.to(P), mask=wmask)
    tl.store(GGAMMA + c, (g_a * inv64).to(P), mask=cmask)
    tl.store(GBETA + c, g_0.to(P), mask=cmask)
    if IN_BN:
        dl_dy = (tl.sum(wq.to(tl.float64) * g_m + w.to(tl.float64) * (coef_a[:, None] * reach + coef_b[:, None] * h_m),
                        axis=1),
                 tl.sum(wq.to(tl.float64) * g_z + w.to(tl.float64) * (coef_a[:, None] * s_z + coef_b[:, None] * q_z),
                        axis=1))
        _input_bn_grads(P0, GPRE, c, cmask, C, n, dl_dy, a0, _constant(eps0_hi, eps0_lo, P), STATS0, F64, BC)


@triton.jit
def _through_input_bn(s_z, s_1, a0, b0, IN_BN: tl.constexpr):
    """A per-tap sum over Y from the same sum over Z = X - mean0 and over the tap's reach (``Y = a0 Z + b0``
    there), or ``s_z`` itself without IN_BN."""
    if IN_BN:
        s_z = a0[:, None] * s_z + b0[:, None] * s_1
    return s_z


@triton.jit
def _input_bn_grads(P0, GPRE, c, cmask, C, n, dl_dy, a0, eps0, STATS0: tl.constexpr, F64: tl.constexpr,
                    BC: tl.constexpr):
    """The input batch norm's part of K5, from ``dl_dy = (S1, SZ)``, ``S1 = sum dL/dY`` and ``SZ = sum dL/dY Z``
    (``dL/dY[t] = sum_i WQ_i g[t + lag_i] + W_i (A + Bh (H[t + lag_i] - mean))``, Z = X - mean0), into GPRE
    (4, C): dL/dgamma0 ``= s0 SZ``, dL/dbeta0 ``= S1`` and, for K6's ``dL/dX = a0 dL/dY + off + slope Z``,
    ``off`` and ``slope`` (the batch statistics' part: zero with STATS0 false, running statistics)."""
    s1, sz = dl_dy
    s0 = _inv_std(tl.load(P0 + 3 * C + c, mask=cmask, other=1.0), eps0, F64).to(tl.float64)
    P = GPRE.dtype.element_ty
    tl.store(GPRE + c, (s0 * sz).to(P), mask=cmask)
    tl.store(GPRE + C + c, s1.to(P), mask=cmask)
    zero = tl.zeros((BC,), dtype=tl.float64)
    tl.store(GPRE + 2 * C + c, (-a0 * s1 / n if STATS0 else zero).to(P), mask=cmask)
    tl.store(GPRE + 3 * C + c, (-a0 * s0 * s0 * sz / n if STATS0 else zero).to(P), mask=cmask)


@triton.jit
def _bn_grad_x_kernel(G, X, W, WQ, B, MEAN, COEF, P0, GPRE, GX, R, C, T, M, dilation,
                      sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k, c1_hi, c1_lo, c2_hi, c2_lo,
                      K: tl.constexpr, SG: tl.constexpr, STATS: tl.constexpr, IN_BN: tl.constexpr, ACC: tl.constexpr,
                      EXACT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """K6: ``dL/dY[t] = sum_i WQ_i g[t + lag_i] + W_i (A + Bh (H[t + lag_i] - mean))`` for one tile
    (the second term with STATS), g and the charges at each ``t + lag_i`` recomputed from X; dL/dX is
    dL/dY, or with IN_BN ``a0 dL/dY + off + slope (X - mean0)`` (GPRE rows 2, 3)."""
    pid = tl.program_id(0)
    n_tb = tl.cdiv(T, BT)
    n_cb = tl.cdiv(C, BC)
    c = ((pid // n_tb) % n_cb * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    r, t, rc_mask, x_rc = _tile_at(pid % n_tb + (pid // (n_tb * n_cb)) * n_tb, n_tb, R, c, cmask, M, sx_n, sx_c,
                                   sx_m, BR, BT)
    o_rc = _tile_offsets(r, c, M, so_n, so_c, so_m)
    c1 = _constant(c1_hi, c1_lo, ACC)
    c2 = _constant(c2_hi, c2_lo, ACC)
    mean = tl.load(MEAN + c, mask=cmask, other=0.0).to(ACC)[None, :, None]
    coef_a = tl.load(COEF + c * 2, mask=cmask, other=0.0).to(ACC)[None, :, None]
    coef_b = tl.load(COEF + c * 2 + 1, mask=cmask, other=0.0).to(ACC)[None, :, None]
    pre = _pre3(P0, c, cmask, C, IN_BN, ACC)
    gx = tl.zeros((BR, BC, BT), dtype=ACC)
    for i in tl.static_range(K):
        dst = t + (K - 1 - i) * dilation  # X[t] reached H[dst] through tap i
        hq, h = _charges(X, x_rc, rc_mask, dst, W, WQ, B, pre, c, cmask, T, dilation, sx_t, sw_c, sw_k, K, True,
                         STATS, IN_BN, ACC, BR, BC, BT)
        if EXACT:
            hq = _exact_if_overflowed(hq, X, x_rc, rc_mask, dst, T, WQ, B, P0, c, C, K, dilation, sx_t, K, 1, 1, True,
                                      IN_BN, BR, BC, BT)
        d_mask = rc_mask & (dst < T)[None, None, :]
        g = tl.load(G + o_rc + (dst * so_t)[None, None, :], mask=d_mask, other=0.0).to(ACC)
        gx += tl.load(WQ + c * K + i, mask=cmask, other=0.0).to(ACC)[None, :, None] * g * \
            _surrogate_grad(hq, c1, c2, SG)
        if STATS:
            wv = tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0).to(ACC)[None, :, None]
            gx += wv * tl.where(d_mask, coef_a + coef_b * (h - mean), 0.0)
    in_mask = rc_mask & (t < T)[None, None, :]
    if IN_BN:
        z = tl.where(in_mask, tl.load(X + x_rc + (t * sx_t)[None, None, :], mask=in_mask, other=0.0).to(ACC) - pre[0],
                     0.0)
        off = tl.load(GPRE + 2 * C + c, mask=cmask, other=0.0).to(ACC)[None, :, None]
        slope = tl.load(GPRE + 3 * C + c, mask=cmask, other=0.0).to(ACC)[None, :, None]
        gx = pre[1] * gx + off + slope * z
    tl.store(GX + o_rc + (t * so_t)[None, None, :], gx.to(GX.dtype.element_ty), mask=in_mask)


# ---------------------------------------------------------------- parameter-threshold step
@triton.jit
def _param_fold_kernel(W, VTH, WQ, B, OK, C, sw_c, sw_k, s_v, K: tl.constexpr, QUANT: tl.constexpr,
                       F64: tl.constexpr, BC: tl.constexpr):
    """Per channel: ``WQ = Q(W)`` (or W), ``B = -V_th`` and OK = whether both are finite."""
    c = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    vth = tl.load(VTH + c * s_v, mask=cmask, other=0.0)
    ok = _finite(vth)
    for i in tl.static_range(K):
        w = tl.load(W + c * sw_c + i * sw_k, mask=cmask, other=0.0)
        ok = ok & _finite(w)
        if QUANT:
            w = _pow2(w, F64)
        tl.store(WQ + c * K + i, w, mask=cmask)
    tl.store(B + c, -vth, mask=cmask)
    tl.store(OK + c, ok.to(OK.dtype.element_ty), mask=cmask)


@triton.jit
def _param_grad_fold_kernel(PW, PB, W, WQ, GW, GV, n_split, C, sw_c, sw_k, K: tl.constexpr, BK: tl.constexpr,
                            ROUND: tl.constexpr, F64: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr):
    """Per channel: the backward kernel's partial sums added in a fixed order, ``dL/dW = dL/dWQ`` (times
    ``|Q(w)| / |w|`` with ROUND) and ``dL/dV_th = -dL/dB``."""
    P = W.dtype.element_ty
    c = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = c < C
    kk = tl.arange(0, BK)
    ss = tl.arange(0, BS)
    acc_w = tl.zeros((BS, BC, BK), dtype=tl.float64)
    acc_b = tl.zeros((BS, BC), dtype=tl.float64)
    for s0 in range(0, n_split, BS):
        rows = (s0 + ss).to(tl.int64)
        m = (rows < n_split)[:, None] & cmask[None, :]
        row = rows[:, None] * C + c[None, :]
        acc_w += tl.load(PW + row[:, :, None] * BK + kk[None, None, :], mask=m[:, :, None], other=0.0).to(tl.float64)
        acc_b += tl.load(PB + row, mask=m, other=0.0).to(tl.float64)
    g_w = tl.sum(acc_w, axis=0)
    wmask = cmask[:, None] & (kk[None, :] < K)
    if ROUND:
        w = tl.load(W + c[:, None] * sw_c + kk[None, :] * sw_k, mask=wmask, other=0.0)
        wq = tl.load(WQ + c[:, None] * K + kk[None, :], mask=wmask, other=0.0)
        g_w = _round_ste(g_w, w, wq)
    tl.store(GW + c[:, None] * K + kk[None, :], g_w.to(P), mask=wmask)
    tl.store(GV + c, (-tl.sum(acc_b, axis=0)).to(P), mask=cmask)


# What each kernel reads and writes of its tensor arguments, for counting memory traffic
# (benchmarks/memory_passes.py): ``(reads, writes)``, each a name, or ``"NAME if FLAG"`` (``"NAME if not
# FLAG"``) for a tensor used only when the launch's FLAG argument is true (false). A tensor is counted once however many shifted
# loads of it a tile makes (they hit the cache); X is not listed where a kernel samples k values of it
# per channel (the moments' shift).
TRAFFIC = {
    "_charge_fwd_kernel": (("X", "W", "B if HAS_BIAS", "P0 if IN_BN"), ("H if STORE_H", "S if SPIKE")),
    "_charge_bwd_kernel": (("G", "X", "W", "B if HAS_BIAS"), ("GX if NEED_GX", "PW", "PB")),
    "_bn_moments_kernel": (("X", "W", "P0 if IN_BN"), ("PART",)),
    "_bn_fold_kernel": (("PART if not GIVEN", "W", "GAMMA", "BETA", "RM if RUNNING", "RV if RUNNING",
                         "MEAN if GIVEN", "VAR if GIVEN", "P0 if IN_BN"),
                        ("RM if RUNNING", "RV if RUNNING", "MEAN if not GIVEN", "VAR if not GIVEN", "WQ", "B", "OK")),
    "_bn_grad_moments_kernel": (("G", "X", "W", "WQ", "B", "MEAN", "P0 if IN_BN"), ("PART",)),
    "_bn_grad_fold_kernel": (("PART", "W", "GAMMA", "MEAN", "VAR", "WQ", "P0 if IN_BN"),
                             ("GW", "GGAMMA", "GBETA", "COEF", "GPRE if IN_BN")),
    "_bn_grad_x_kernel": (("G", "X", "W", "WQ", "B", "MEAN", "COEF", "P0 if IN_BN", "GPRE if IN_BN"), ("GX",)),
    "_param_fold_kernel": (("W", "VTH"), ("WQ", "B", "OK")),
    "_param_grad_fold_kernel": (("PW", "PB", "W if ROUND", "WQ if ROUND"), ("GW", "GV")),
}


# ---------------------------------------------------------------- autotune configs per layout
INTERPRETED = type(_charge_fwd_kernel).__name__ == "InterpretedFunction"

_TILES = tiles.INTERPRETER_TILES if INTERPRETED else tiles.GPU_TILES


def _configs(layout: str) -> list:
    return [triton.Config({"BR": br, "BC": bc, "BT": bt}, num_warps=tiles.num_warps((br, bc, bt)))
            for br, bc, bt in _TILES[layout]]


def _prune(configs, named_args, **kwargs):
    """The autotuner's early prune: the configs of :func:`tiles.worth_trying` for this shape."""
    shape = [int(named_args[n]) for n in ("R", "C", "T")]
    kept = tiles.worth_trying([(cf.kwargs["BR"], cf.kwargs["BC"], cf.kwargs["BT"]) for cf in configs], *shape)
    return [cf for cf in configs if (cf.kwargs["BR"], cf.kwargs["BC"], cf.kwargs["BT"]) in kept]


_KEY = ["R", "C", "T", "M", "K"]
# The forward kernel is autotuned (no reduction: every tile gives the same bits). Kernels that reduce run
# on tiles chosen from the shape alone (:func:`_reduction_tile`), so their sums are added in the same
# order in every run and every process.
_FWD = {layout: launch.Bound(triton.autotune(_configs(layout), key=_KEY, prune_configs_by={
    "early_config_prune": _prune})(_charge_fwd_kernel)) for layout in _TILES}
# Every kernel is launched through launch.Bound: Triton's binding of its arguments once per specialisation.
_BOUND = {k.__name__: launch.Bound(k) for k in (
    _charge_bwd_kernel, _bn_moments_kernel, _bn_fold_kernel, _bn_grad_moments_kernel, _bn_grad_fold_kernel,
    _bn_grad_x_kernel, _param_fold_kernel, _param_grad_fold_kernel)}


# ---------------------------------------------------------------- launchers
@functools.lru_cache(maxsize=512)
def _geometry(shape: torch.Size, strides: tuple, layout: str) -> Optional[tuple]:
    """``(strides (n, c, m, t), M, (R, C, T))`` of a tensor of this shape and these strides addressed as
    logical (T, N, C, M) (R = N * M rows), or None where its feature dims do not merge into one stride.
    Cached: a training loop meets a handful of shapes, and this is host time on every launch."""
    meta = torch.empty_strided(shape, strides, device="meta")
    feat = shape[3:] if layout == "time_first" else shape[2:-1]
    m = math.prod(feat)
    try:
        if layout == "time_first":
            s_t, s_n, s_c, s_m = meta.view(*shape[:3], m).stride()
            xs, t, c = (s_n, s_c, s_m, s_t), shape[0], shape[2]
        else:
            xs, t, c = meta.view(shape[0], shape[1], m, shape[-1]).stride(), shape[-1], shape[1]
    except RuntimeError:
        return None
    return tuple(xs), m, (math.prod(shape) // max(t * c, 1), c, t)


class _Plan(NamedTuple):
    """What a step's launchers derive from X's shape and strides, X's and the weight's dtypes and the device
    alone (:func:`_planned`): cached, since a training loop meets a handful of them."""
    xs: tuple  # X's strides (n, c, m, t) as logical (T, N, C, M)
    dense: tuple  # the same of a dense tensor of X's shape (the spikes, dL/dS, dL/dX)
    m: int
    r: int  # rows, N * M
    c: int
    t: int
    tile: tuple  # (BR, BC, BT) of the kernels that reduce and of dL/dX's (:func:`_reduction_tile`)
    tile_args: dict  # the same, as the kernels' constants, with the warps
    n_cb: int  # a reducing kernel's channel blocks and splits (:func:`tiles.reduction_grid`)
    n_split: int
    gx_grid: tuple  # dL/dX's kernel: one program per tile
    fwd_grid: "_TilesGrid"  # the autotuned forward kernel's
    acc: object  # Triton's accumulator dtype: float64 for a float64 X or weight, else float32
    # dL/dX's dtype in the kernels: X's, but float32 for a 16-bit X summed in float64 under the interpreter
    # (Triton 3.9's interpreter turns float64 into bfloat16 wrongly; the caller casts)
    gx_dtype: torch.dtype
    spike_dtype: torch.dtype  # the fused steps' spikes' (:func:`_spike_dtype`)


@functools.lru_cache(maxsize=512)
def _plan(shape: torch.Size, strides: tuple, layout: str, dtype: torch.dtype, w_dtype: torch.dtype,
          device: torch.device) -> Optional[_Plan]:
    """The :class:`_Plan` of an X of this shape, strides and dtype, or None where its feature dims do not
    merge into one stride."""
    g = _geometry(shape, strides, layout)
    if g is None:
        return None
    xs, m, (r, c, t) = g
    dense = _geometry(shape, torch.empty(shape, device="meta").stride(), layout)[0]
    tile = _reduction_tile(layout, c, t, m)
    acc = tl.float64 if torch.float64 in (dtype, w_dtype) else tl.float32
    narrow = INTERPRETED and acc is tl.float64 and dtype in (torch.float16, torch.bfloat16)
    n_cb, n_split = tiles.reduction_grid(tile, r, c, t, _split_target(device))
    fwd_grid = _TilesGrid(r, c, t)
    return _Plan(xs, dense, m, r, c, t, tile, _tile_args(tile), n_cb, n_split, fwd_grid(_tile_args(tile)), fwd_grid,
                 acc, torch.float32 if narrow else dtype, _spike_dtype(dtype, w_dtype))


def _planned(x: torch.Tensor, weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, _Plan]:
    """``(X, its plan)``: X itself (its data pointer is all a kernel needs) or, where its feature dims do not
    merge into one stride, a contiguous copy."""
    plan = _plan(x.shape, x.stride(), layout, x.dtype, weight.dtype, x.device)
    if plan is None:
        x = x.contiguous()
        plan = _plan(x.shape, x.stride(), layout, x.dtype, weight.dtype, x.device)
    return x, plan


class _TilesGrid(NamedTuple):
    """The autotuned forward kernel's grid: one program per (BR, BC, BT) tile of (R, C, T). A grid callable
    sees the kernel's other arguments converted under the interpreter, so it holds the sizes itself; and
    equal sizes give an equal grid, as :class:`launch.Bound` keys it."""
    r: int
    c: int
    t: int

    def __call__(self, meta: dict) -> tuple[int]:
        return (tiles.cdiv(self.r, meta["BR"]) * tiles.cdiv(self.c, meta["BC"]) * tiles.cdiv(self.t, meta["BT"]),)


_F32_MAX = 3.4028234663852886e38


@functools.lru_cache(maxsize=256)  # (a step's eps and momentum are the same at every call)
def _hi_lo(v: float) -> tuple[float, float]:
    """``v`` as float32 ``hi + lo`` (a kernel's float arguments are float32; float64 kernels add them);
    beyond float32's range ``(±inf, 0)``."""
    hi = struct.unpack("f", struct.pack("f", v))[0] if abs(v) <= _F32_MAX else math.copysign(math.inf, v)
    return hi, struct.unpack("f", struct.pack("f", v - hi))[0] if math.isfinite(hi) else 0.0


@functools.lru_cache(maxsize=256)
def _passes(v: float, dtype: torch.dtype) -> bool:
    """Whether a kernel of ``dtype`` gets ``v`` through :func:`_hi_lo` as the other methods use it: finite
    in float32, and in float64 to about its precision (not below float32's normal range)."""
    hi, lo = _hi_lo(v)
    return math.isfinite(hi) and (dtype != torch.float64 or abs(hi + lo - v) <= abs(v) * 2.0 ** -45)


@functools.lru_cache(maxsize=64)
def surrogate_constants(kind: int, alpha: float) -> tuple[float, float, float, float]:
    """``(c1, c2)`` of :func:`_surrogate_grad` for the surrogate table's ``kind`` (zeros for none), each as
    ``hi, lo`` (:func:`_hi_lo`)."""
    c1, c2 = surrogate.constants(kind, alpha) if kind else (0.0, 0.0)
    return (*_hi_lo(c1), *_hi_lo(c2))


def _reduction_tile(layout: str, c: int, t: int, m: int) -> tuple[int, int, int]:
    """The (BR, BC, BT) tile of the kernels that reduce (and of the dL/dX kernel beside them): from the
    shape alone. Time-last: long in the contiguous T; time-first: wide in channels when they are the
    contiguous axis (M = 1), else in rows."""
    if INTERPRETED:
        return tiles.INTERPRETER_TILES[layout][0]
    if layout == "time_last":
        bt = min(tiles.pow2_ceil(t), 64)
        return 1024 // bt, 1, bt
    if m == 1:
        bc = min(tiles.pow2_ceil(c), 128)
        return max(512 // bc, 1), bc, 2
    return 256, 1, 4


@functools.lru_cache(maxsize=None)
def _split_target(device: torch.device) -> int:
    """Programs a reduction kernel aims for: enough to fill the GPU (8 on the interpreter)."""
    if INTERPRETED or device.type != "cuda":
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=64)  # (the same few tiles at every launch; the dict is only unpacked)
def _tile_args(tile: tuple) -> dict:
    br, bc, bt = tile
    return dict(BR=br, BC=bc, BT=bt, num_warps=tiles.num_warps(tile))


def _on_device_of(position: int):
    """Run the decorated launcher with its argument ``position``'s CUDA device current: Triton launches
    on the current device, so a tensor on cuda:1 while cuda:0 is current would be read from the wrong
    device."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = args[position]
            if t.is_cuda and t.device.index != torch.cuda.current_device():
                with torch.cuda.device(t.device):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return run
    return wrap


@_on_device_of(0)
def charge_forward(x, weight, bias, dilation, layout, spike_kind=0, store_h=True, out_dtype=None):
    """Run the forward kernel: returns (H or None, S or None), dense in ``x``'s shape, of ``out_dtype``
    (default: ``x``'s and ``weight``'s promoted)."""
    out_dtype = out_dtype or torch.result_type(x, weight)
    h = torch.empty(x.shape, dtype=out_dtype, device=x.device) if store_h else None
    s = torch.empty(x.shape, dtype=out_dtype, device=x.device) if spike_kind else None
    if x.numel():
        _forward(*_planned(x, weight, layout), weight, bias, h, s, dilation, layout)
    return h, s


def _forward(x4, p, weight, bias, h, s, dilation, layout, pre=None) -> None:
    """The forward kernel into H and (or) S, dense; ``pre``: X read through this input batch norm
    (:func:`_input_bn`)."""
    out = h if h is not None else s
    _FWD[layout][p.fwd_grid](
        (x4, weight, bias if bias is not None else weight, out, s if s is not None else out,
         pre if pre is not None else weight),
        (p.r, p.c, p.t, p.m, weight.shape[1], dilation, *p.xs, *p.dense, *weight.stride(),
         bias.stride(0) if bias is not None else 0), (),
        HAS_BIAS=bias is not None, STORE_H=h is not None, SPIKE=s is not None, IN_BN=pre is not None, ACC=p.acc,
        EXACT=p.acc is not tl.float64)


def _fused_spikes(x4, p, wq, b, dilation, layout, pre=None) -> torch.Tensor:
    """K3 of the fused steps: the spikes of X's plan ``p`` (no H), in :attr:`_Plan.spike_dtype`."""
    s = torch.empty(x4.shape, dtype=p.spike_dtype, device=x4.device)
    _forward(x4, p, wq, b, None, s, dilation, layout, pre)
    return s


@_on_device_of(2)
def charge_backward(grad, bias, x, weight, dilation, layout, spike_kind=0, alpha=0.0,
                    need=(True, True, True), partials=False):
    """Run the backward kernel: (dL/dX, dL/dW, dL/db), each None unless asked for in ``need`` (with
    ``partials``: dL/dX and the per-split partial sums of the other two, to be added up in a fixed order).

    ``grad`` is dL/dH, or dL/dS when ``spike_kind`` names a surrogate (the charge recomputed with ``bias``).
    """
    need_gx, need_gw, need_gb = need
    k = weight.shape[1]
    x4, p = _planned(x, weight, layout)
    part_dtype = torch.float64 if p.acc is tl.float64 else torch.float32
    bk = tiles.pow2_ceil(k)
    # Every program writes its slot of partial sums, so they need no zero fill (but an empty x runs none).
    alloc = torch.empty if x.numel() else torch.zeros
    pw = alloc((p.n_split, p.c, bk), dtype=part_dtype, device=x.device)
    pb = alloc((p.n_split, p.c), dtype=part_dtype, device=x.device)
    gx = torch.empty(x.shape, dtype=p.gx_dtype, device=x.device) if need_gx else None
    if x.numel() > 0:
        grad = grad.contiguous()  # dense like H; a copy only for strided or broadcast gradients
        _BOUND['_charge_bwd_kernel'][(p.n_cb, p.n_split)](
            (grad, bias if bias is not None else weight, x4, weight, gx if gx is not None else grad, pw, pb),
            (p.r, p.c, p.t, p.m, k, dilation, *p.xs, *p.dense, *weight.stride(),
             bias.stride(0) if bias is not None else 0),
            surrogate_constants(spike_kind, float(alpha)), SG=spike_kind, HAS_BIAS=bias is not None, NEED_GX=need_gx,
            NEED_GW=need_gw, NEED_GB=need_gb, ACC=p.acc, EXACT=p.acc is not tl.float64, BK=bk, **p.tile_args)
    gx = gx if gx is None or gx.dtype == x.dtype else gx.to(x.dtype)
    if partials:
        return gx, pw, pb
    gw = pw.sum(0)[:, :k].to(weight.dtype) if need_gw else None
    gb = pb.sum(0) if need_gb else None
    return gx, gw, gb


class _TritonCharge(torch.autograd.Function):
    """H = charge(X, W, b), or S = Heaviside(H) with a fused surrogate gradient when ``spike_kind``."""

    @staticmethod
    def forward(ctx, x, weight, bias, dilation, layout, spike_kind, alpha):
        h, s = charge_forward(x, weight, bias, dilation, layout, spike_kind, store_h=not spike_kind)
        ctx.save_for_backward(x, weight, bias if spike_kind else None)
        ctx.args = (dilation, layout, spike_kind, alpha, None if bias is None else bias.dtype)
        return s if spike_kind else h

    @staticmethod
    def backward(ctx, grad):
        first_order_only("triton")
        x, weight, bias = ctx.saved_tensors
        dilation, layout, spike_kind, alpha, bias_dtype = ctx.args
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias_dtype is not None and ctx.needs_input_grad[2])
        gx, gw, gb = charge_backward(grad, bias, x, weight, dilation, layout, spike_kind, alpha, need)
        return gx, gw, None if gb is None else gb.to(bias_dtype), None, None, None, None


# ---------------------------------------------------------------- the BN-threshold step (K1-K6)
def _spike_dtype(dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The fused steps' spikes: in a float16/bfloat16 input's own dtype (computed in float32), else
    promoted with the parameters'."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.promote_types(dtype, w_dtype)


class _Refused(Exception):
    """The folding is not finite (NaN or inf in the weight, gamma, beta or statistics, or var + eps <= 0):
    nothing was updated, and the caller's general path reports what is wrong."""


def _refuse_unless_finite(ok: torch.Tensor, x: torch.Tensor, what: str, saved=()) -> None:
    """After a fold kernel: where ``ok`` (per channel) is not all true, on CUDA an asynchronous device
    assert naming ``what`` (no host synchronisation, so a step can be captured as a CUDA graph); on the
    CPU the running statistics of ``saved``, pairs ``(tensors, copies)``, are put back and :class:`_Refused`
    is raised."""
    if x.is_cuda:
        torch._assert_async(ok.all(), f"MulFreeChannelwisePSN (triton): NaN/inf in {what}")
    elif not bool(ok.all()):
        for tensors, copies in saved or ():
            for t, copy in zip(tensors, copies):
                t.copy_(copy)
        raise _Refused(f"MulFreeChannelwisePSN (triton): NaN/inf in {what}")


def _fold_blocks(c: int, n_split: int, per_channel: int) -> tuple[int, int]:
    """(channel block, split block) of the per-channel kernels K2 and K5, about 2048 values a step."""
    return (4, 8) if INTERPRETED else tiles.fold_blocks(c, n_split, per_channel)


def _input_norm(x4, plan, gamma0, beta0, pre_cfg, dtype, saved) -> torch.Tensor:
    """The input batch norm's fold: P0 (5, C) = (mean0, a0, beta0, var0, OK), from its batch statistics
    (two kernels, the running ones updated) or from the given running ones; raises :class:`_Refused`."""
    eps0, running0, given0 = pre_cfg
    p0 = torch.empty((5, plan.c), dtype=dtype, device=x4.device)
    ones = torch.ones((plan.c, 1), dtype=dtype, device=x4.device)  # (per call, not cached: a tensor kept from a
    # call inside torch.compile's CUDA graphs would live in their memory pool, which they refuse)
    mean, a, beta, var, ok = p0.unbind(0)
    mean0, var0 = _stats_and_fold(x4, plan, ones, gamma0, beta0, (a, beta, ok, mean, var),
                                  (eps0, False, 1, running0, given0), pre=True, saved=saved)
    if given0 is not None:
        mean.copy_(mean0)
        var.copy_(var0)
    return p0


def _stats_and_fold(x4, plan, weight, gamma, beta, outs, fold_cfg, p0=None, pre=False, saved=None):
    """K1 (the batch moments of ``conv(X, weight)``, X through the input batch norm ``p0`` where given;
    none with given statistics) and K2 (statistics, running ones blended, the folding) into ``outs = (WQ,
    B, OK, mean, var)``; ``pre``: the input batch norm's own fold (``weight`` ones). ``fold_cfg``: ``(eps,
    quantise, dilation, running, given)``. Returns the statistics folded ``(mean, var)``."""
    eps, quant, dilation, running, given = fold_cfg
    wq, b, ok, mean, var = outs
    k, in_bn, c, n_split, acc = weight.shape[1], p0 is not None, plan.c, plan.n_split, plan.acc
    p0 = p0 if in_bn else weight
    if given is None:
        part = torch.empty((n_split, c, 2), dtype=torch.float64 if acc is tl.float64 else torch.float32,
                           device=x4.device)
        _BOUND['_bn_moments_kernel'][(plan.n_cb, n_split)](
            (x4, weight, p0, part), (plan.r, c, plan.t, plan.m, dilation, *plan.xs, *weight.stride()), (), K=k,
            IN_BN=in_bn, ACC=acc, **plan.tile_args)
    else:
        (mean, var), part, n_split = given, weight, 0
    rm, rv, factor = running if running is not None else (mean, var, 0.0)
    if running is not None and saved is not None:
        saved.append(((rm, rv), (rm.clone(), rv.clone())))
    bc, bs = _fold_blocks(c, n_split, 2)
    _BOUND['_bn_fold_kernel'][(tiles.cdiv(c, bc),)](
        (part, x4, weight, p0, gamma, beta, rm, rv, mean, var, wq, b, ok),
        (n_split, c, plan.t, plan.r * plan.t, dilation, plan.xs[1], plan.xs[3], *weight.stride(), gamma.stride(0),
         beta.stride(0), rm.stride(0), rv.stride(0), mean.stride(0), var.stride(0)),
        (*_hi_lo(eps), *_hi_lo(float(factor))), K=k, GIVEN=given is not None, RUNNING=running is not None,
        QUANT=quant, IN_BN=in_bn, PRE=pre, ACC=acc, F64=weight.dtype == torch.float64, BC=bc, BS=bs)
    return mean, var


@_on_device_of(0)
def _bn_forward(x, weight, gamma, beta, cfg, gamma0=None, beta0=None):
    """K1 (moments), K2 (fold), K3 (spikes), after the input batch norm's two (``cfg[8]``, P0):
    ``(spikes, mean, var, Wq, b, P0 or None, folded)``, ``folded`` the allocation that holds Wq, b and
    the batch statistics (:func:`_unfolded`); raises :class:`_Refused`."""
    eps, ste, dilation, layout, _, _, running, given, pre_cfg = cfg
    x4, plan = _planned(x, weight, layout)
    k, c, dtype, device = weight.shape[1], plan.c, weight.dtype, x.device
    saved = None if x.is_cuda else []
    p0 = None if pre_cfg is None else _input_norm(x4, plan, gamma0, beta0, pre_cfg, dtype, saved)
    # Every per-channel output in one allocation: Wq (C, k), b, OK (1.0 where the folding is finite), and
    # the batch mean and variance.
    flat = torch.empty(c * (k + 4), dtype=dtype, device=device)
    wq, b, ok, mean, var = _unfolded(flat, c, k)
    mean, var = _stats_and_fold(x4, plan, weight, gamma, beta, (wq, b, ok, mean, var),
                                (eps, ste is not None, dilation, running, given), p0=p0, saved=saved)
    _refuse_unless_finite(ok, x, "its weight, gamma, beta or batch statistics (NaN or inf in its input?), or "
                                 "var + eps <= 0" + (", or in its input batch norm's" if p0 is not None else ""),
                          saved)
    written = (tuple(running[:2]) if running is not None else ()) + \
        (tuple(pre_cfg[1][:2]) if pre_cfg is not None and pre_cfg[1] is not None else ())
    for v in written:
        increment_version(v)  # written by a kernel: let autograd know, as an in-place op would
    return _fused_spikes(x4, plan, wq, b, dilation, layout, p0), mean, var, wq, b, p0, flat


def _unfolded(flat, c, k):
    """Views of the fold's allocation: Wq (C, k), b, OK, and the batch mean and variance."""
    wq, b, ok, mean, var = flat.split_with_sizes((c * k, c, c, c, c))
    return wq.view(c, k), b, ok, mean, var


@_on_device_of(1)
def _bn_backward(grad, x, weight, gamma, mean, var, wq, b, p0, cfg, need_gx):
    """K4 (per-split sums), K5 (per-channel closed form), K6 (dL/dX): ``(dL/dX or None, dL/dW, dL/dgamma,
    dL/dbeta, dL/dgamma0 and dL/dbeta0 (input batch norm P0) or None)``."""
    eps, ste, dilation, layout, kind, alpha, stats, pre = cfg
    x4, p = _planned(x, weight, layout)
    k, c, dtype, device = weight.shape[1], p.c, weight.dtype, x.device
    grad = grad.contiguous()  # dense like the spikes (read in its dtype, summed in ACC)
    bk, rows, in_bn = tiles.pow2_ceil(k), 4 if p0 is None else 5, p0 is not None
    consts = surrogate_constants(kind, alpha)  # (COEF is stored in the parameters' dtype)
    mean, p0 = mean.contiguous(), p0 if in_bn else weight
    part = torch.empty((p.n_split, c, rows, bk), dtype=torch.float64 if p.acc is tl.float64 else torch.float32,
                       device=device)
    ints = (p.r, c, p.t, p.m, dilation, *p.xs, *p.dense, *weight.stride())  # (K4's and K6's)
    _BOUND['_bn_grad_moments_kernel'][(p.n_cb, p.n_split)](
        (grad, x4, weight, wq, b, mean, p0, part), ints, consts, K=k, BK=bk, SG=kind, STATS=stats, IN_BN=in_bn,
        ROWS=rows, ACC=p.acc, EXACT=p.acc is not tl.float64, **p.tile_args)
    # dL/dW, dL/dgamma, dL/dbeta, the statistics' coefficients for K6 and the input batch norm's (dL/dgamma0,
    # dL/dbeta0 and K6's two) in one allocation
    g_weight, g_gamma, g_beta, coef, g_pre = torch.empty(c * (k + 4 + 4 * in_bn), dtype=dtype, device=device) \
        .split_with_sizes((c * k, c, c, 2 * c, 4 * c * in_bn))
    g_weight = g_weight.view(c, k)
    eps0, stats0 = pre if in_bn else (1.0, False)
    bc, bs = _fold_blocks(c, p.n_split, rows * bk)
    _BOUND['_bn_grad_fold_kernel'][(tiles.cdiv(c, bc),)](
        (part, weight, gamma, mean, var, wq, p0, g_weight, g_gamma, g_beta, coef, g_pre if in_bn else coef),
        (p.n_split, c, p.t, p.r * p.t, dilation, *weight.stride(), gamma.stride(0), mean.stride(0), var.stride(0)),
        (*_hi_lo(eps), *_hi_lo(eps0)), K=k, BK=bk, ROUND=ste == "round", STATS=stats, IN_BN=in_bn, STATS0=stats0,
        ROWS=rows, F64=dtype == torch.float64, BC=bc, BS=bs)
    gx = None
    if need_gx:
        gx = torch.empty(x.shape, dtype=p.gx_dtype, device=device)
        _BOUND['_bn_grad_x_kernel'][p.gx_grid](
            (grad, x4, weight, wq, b, mean, coef, p0, g_pre if in_bn else coef, gx), ints, consts, K=k, SG=kind,
            STATS=stats, IN_BN=in_bn, ACC=p.acc, EXACT=p.acc is not tl.float64, **p.tile_args)
        gx = gx if gx.dtype == x.dtype else gx.to(x.dtype)
    return gx, g_weight, g_gamma, g_beta, *((g_pre[:c], g_pre[c:2 * c]) if in_bn else (None, None))


class _TritonBNFire(torch.autograd.Function):
    """A BN-threshold neuron's step as one autograd node: three kernels forward, three backward, nothing
    X-sized kept but X (the charge is recomputed from it); with an input batch norm (``gamma0``, ``beta0``)
    fused in front, two more forward. ``cfg``: ``(eps, ste, dilation, layout, kind, alpha, running, given,
    (eps0, running0, given0) or None)``. Returns ``(spikes, mean, var)``, or the spikes alone with ``given``
    statistics (constants: no gradient through them)."""

    @staticmethod
    def forward(ctx, x, weight, gamma, beta, gamma0, beta0, cfg):
        s, mean, var, wq, b, p0, _ = _bn_forward(x, weight, gamma, beta, cfg, gamma0, beta0)
        ctx.save_for_backward(x, weight, gamma, mean, var)
        ctx.folded = (wq, b, p0)
        ctx.cfg = (*cfg[:6], cfg[7] is None, None if cfg[8] is None else (cfg[8][0], cfg[8][2] is None))
        if cfg[7] is not None:
            return s
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)
        return s, mean, var

    @staticmethod
    def backward(ctx, grad, *_stats_grads):
        first_order_only("triton")
        if grad is None:
            return None, None, None, None, None, None, None
        x, weight, gamma, mean, var = ctx.saved_tensors
        return (*_bn_backward(grad, x, weight, gamma, mean, var, *ctx.folded, ctx.cfg, ctx.needs_input_grad[0]), None)


# ---------------------------------------------------------------- the parameter-threshold step
@_on_device_of(0)
def _param_forward(x, weight, v_threshold, cfg):
    """The fold kernel, then the spike kernel: ``(spikes, Wq, b, folded)``, ``folded`` the allocation that
    holds Wq and b; raises :class:`_Refused`."""
    ste, dilation, layout, _, _ = cfg
    c, k = weight.shape
    flat = torch.empty(c * (k + 2), dtype=weight.dtype, device=x.device)
    wq, b, ok = flat.split_with_sizes((c * k, c, c))
    wq = wq.view(c, k)
    bc = 4 if INTERPRETED else min(tiles.pow2_ceil(c), 256)
    _BOUND['_param_fold_kernel'][(tiles.cdiv(c, bc),)](
        (weight, v_threshold, wq, b, ok), (c, *weight.stride(), v_threshold.stride(0)), (), K=k,
        QUANT=ste is not None, F64=weight.dtype == torch.float64, BC=bc)
    _refuse_unless_finite(ok, x, "its weight or v_threshold")
    return _fused_spikes(*_planned(x, weight, layout), wq, b, dilation, layout), wq, b, flat


class _TritonParamFire(torch.autograd.Function):
    """A parameter-threshold neuron's step, ``Theta(conv(X, Q(W)) - V_th)``, as one autograd node: two
    kernels forward (fold, spikes), two backward (dL/dX with partial sums, then their fixed-order sum
    with the quantiser's and the threshold's gradients); only X kept."""

    @staticmethod
    def forward(ctx, x, weight, v_threshold, cfg):
        s, wq, b, _ = _param_forward(x, weight, v_threshold, cfg)
        ctx.save_for_backward(x, weight)
        ctx.folded = (wq, b)
        ctx.cfg = cfg
        return s

    @staticmethod
    def backward(ctx, grad):
        first_order_only("triton")
        x, weight = ctx.saved_tensors
        return (*_param_backward(grad, x, weight, *ctx.folded, ctx.cfg, ctx.needs_input_grad[0]), None)


@_on_device_of(1)
def _param_backward(grad, x, weight, wq, b, cfg, need_gx):
    """The backward kernel (dL/dX and partial sums), then their fixed-order sum: ``(dL/dX or None, dL/dW,
    dL/dV_th)``."""
    ste, dilation, layout, kind, alpha = cfg
    c, k = weight.shape
    gx, pw, pb = charge_backward(grad, b, x, wq, dilation, layout, kind, alpha, (need_gx, True, True),
                                 partials=True)
    g_weight, g_vth = torch.empty(c * (k + 1), dtype=weight.dtype, device=x.device).split_with_sizes((c * k, c))
    g_weight = g_weight.view(c, k)
    bc, bs = _fold_blocks(c, pw.shape[0], pw.shape[2] + 1)
    _BOUND['_param_grad_fold_kernel'][(tiles.cdiv(c, bc),)](
        (pw, pb, weight, wq, g_weight, g_vth), (pw.shape[0], c, *weight.stride()), (), K=k, BK=pw.shape[2],
        ROUND=ste == "round", F64=weight.dtype == torch.float64, BC=bc, BS=bs)
    return gx, g_weight, g_vth


# ---------------------------------------------------------------- under torch.compile: custom operators
# Eagerly the autograd Functions above run. Under torch.compile the same launchers run as opaque operators
# (``torch.ops.spikingjelly_mfpsn.triton_*``; fake kernels give shapes, dtypes and strides), so a compiled
# graph holds the kernels without a break and mode="reduce-overhead" captures them in its CUDA graphs.
# (``compiles=False`` below: method='auto' under compile still prefers what inductor can fuse.)
# Each returns fresh, dense tensors (views of one allocation are returned as that allocation).
Tensor = torch.Tensor
_STE = {"none": None, "whole": "whole", "round": "round"}


def _refusing(fn, *args):
    """``fn(*args)``, a refused folding (on the CPU) raised as the ValueError an operator can give."""
    try:
        return fn(*args)
    except _Refused as e:
        raise ValueError(str(e)) from None


def _none_if_empty(t: Tensor) -> Optional[Tensor]:
    return t if t.numel() else None


@torch.library.custom_op("spikingjelly_mfpsn::triton_charge", mutates_args=())
def _charge_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], dilation: int, layout: str, kind: int,
               alpha: float) -> Tensor:
    h, s = charge_forward(x, weight, bias, dilation, layout, kind, store_h=not kind)
    return s if kind else h


@torch.library.custom_op("spikingjelly_mfpsn::triton_charge_backward", mutates_args=())
def _charge_backward_op(grad: Tensor, bias: Optional[Tensor], x: Tensor, weight: Tensor, dilation: int, layout: str,
                        kind: int, alpha: float, need_gx: bool, need_gw: bool,
                        need_gb: bool) -> tuple[Tensor, Tensor, Tensor]:
    gx, gw, gb = charge_backward(grad, bias, x, weight, dilation, layout, kind, alpha, (need_gx, need_gw, need_gb))
    return (x.new_empty(0) if gx is None else gx, x.new_empty(0) if gw is None else gw.contiguous(),
            x.new_empty(0) if gb is None else gb.to(weight.dtype))


def _charge_setup(ctx, inputs, output):
    x, weight, bias, dilation, layout, kind, alpha = inputs
    ctx.save_for_backward(x, weight, bias if kind else None)
    ctx.args = (dilation, layout, kind, alpha, None if bias is None else bias.dtype)


def _charge_grad(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    dilation, layout, kind, alpha, bias_dtype = ctx.args
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias_dtype is not None and ctx.needs_input_grad[2])
    gx, gw, gb = _charge_backward_op(grad, bias, x, weight, dilation, layout, kind, alpha, *need)
    return gx if need[0] else None, gw if need[1] else None, gb.to(bias_dtype) if need[2] else None, None, None, \
        None, None


@torch.library.custom_op("spikingjelly_mfpsn::triton_bn_step", mutates_args=())
def _bn_step_op(x: Tensor, weight: Tensor, gamma: Tensor, beta: Tensor, gamma0: Optional[Tensor],
                beta0: Optional[Tensor], eps: float, eps0: float, ste: str, dilation: int, layout: str, kind: int,
                alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(spikes, folded (Wq, b, OK, mean, var), P0 or empty)`` of a BN training step with batch statistics
    (an operator mutates nothing: the caller blends them into the running ones)."""
    cfg = (eps, _STE[ste], dilation, layout, kind, alpha, None, None, None if gamma0 is None else (eps0, None, None))
    s, *_, p0, flat = _refusing(_bn_forward, x, weight, gamma, beta, cfg, gamma0, beta0)
    return s, flat, weight.new_empty(0) if p0 is None else p0


@torch.library.custom_op("spikingjelly_mfpsn::triton_bn_step_backward", mutates_args=())
def _bn_step_backward_op(grad: Tensor, x: Tensor, weight: Tensor, gamma: Tensor, flat: Tensor, p0: Tensor,
                         eps: float, eps0: float, ste: str, dilation: int, layout: str, kind: int, alpha: float,
                         need_gx: bool) -> tuple[Tensor, Tensor]:
    """``(dL/dX or empty, (dL/dW, dL/dgamma, dL/dbeta, dL/dgamma0, dL/dbeta0) in one tensor)``."""
    c, k = weight.shape
    wq, b, _, mean, var = _unfolded(flat, c, k)
    p0 = _none_if_empty(p0)
    cfg = (eps, _STE[ste], dilation, layout, kind, alpha, True, None if p0 is None else (eps0, True))
    gx, *grads = _bn_backward(grad, x, weight, gamma, mean, var, wq, b, p0, cfg, need_gx)
    return x.new_empty(0) if gx is None else gx, torch.cat([g.reshape(-1) for g in grads if g is not None])


def _bn_setup(ctx, inputs, output):
    x, weight, gamma, beta, gamma0 = inputs[:5]
    ctx.save_for_backward(x, weight, gamma, output[1], output[2])
    eps, eps0, ste, dilation, layout, kind, alpha = inputs[6:]
    ctx.cfg, ctx.in_bn = (eps, eps0, ste, dilation, layout, kind, alpha), gamma0 is not None


def _bn_grad(ctx, grad, *_):
    x, weight, gamma, flat, p0 = ctx.saved_tensors
    c, k = weight.shape
    gx, grads = _bn_step_backward_op(grad, x, weight, gamma, flat, p0, *ctx.cfg, ctx.needs_input_grad[0])
    g_w, g_gamma, g_beta, *g_pre = grads.split_with_sizes((c * k, c, c) + (c, c) * ctx.in_bn)
    return (_none_if_empty(gx), g_w.view(c, k), g_gamma, g_beta, *(g_pre or (None, None))) + (None,) * 7


@torch.library.custom_op("spikingjelly_mfpsn::triton_param_step", mutates_args=())
def _param_step_op(x: Tensor, weight: Tensor, v_threshold: Tensor, ste: str, dilation: int, layout: str, kind: int,
                   alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(spikes, folded)`` of a parameter-threshold step (folded: Wq, b and OK in one tensor)."""
    s, *_, flat = _refusing(_param_forward, x, weight, v_threshold, (_STE[ste], dilation, layout, kind, alpha))
    return s, flat


@torch.library.custom_op("spikingjelly_mfpsn::triton_param_step_backward", mutates_args=())
def _param_step_backward_op(grad: Tensor, x: Tensor, weight: Tensor, flat: Tensor, ste: str, dilation: int,
                            layout: str, kind: int, alpha: float, need_gx: bool) -> tuple[Tensor, Tensor]:
    """``(dL/dX or empty, (dL/dW, dL/dV_th) in one tensor)``."""
    c, k = weight.shape
    wq, b = flat[:c * k].view(c, k), flat[c * k:c * (k + 1)]
    gx, g_w, g_vth = _param_backward(grad, x, weight, wq, b, (_STE[ste], dilation, layout, kind, alpha), need_gx)
    return x.new_empty(0) if gx is None else gx, torch.cat((g_w.reshape(-1), g_vth))


def _param_setup(ctx, inputs, output):
    x, weight, _, *cfg = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.cfg = cfg


def _param_grad(ctx, grad, _):
    x, weight, flat = ctx.saved_tensors
    c, k = weight.shape
    gx, grads = _param_step_backward_op(grad, x, weight, flat, *ctx.cfg, ctx.needs_input_grad[0])
    return (_none_if_empty(gx), grads[:c * k].view(c, k), grads[c * k:]) + (None,) * 5


def _register_fakes_and_grads():
    """Shapes, dtypes and strides of the operators' outputs (dense, as the kernels write them)."""
    dense = lambda x, dtype=None: x.new_empty(x.shape, dtype=dtype)  # noqa: E731
    _charge_op.register_fake(lambda x, weight, *_: dense(x, torch.result_type(x, weight)))
    _charge_backward_op.register_fake(lambda grad, bias, x, weight, *args: (
        dense(x) if args[-3] else x.new_empty(0), weight.new_empty(weight.shape) if args[-2] else x.new_empty(0),
        weight.new_empty(weight.shape[0]) if args[-1] else x.new_empty(0)))
    _bn_step_op.register_fake(lambda x, weight, gamma, beta, gamma0, *_: (
        dense(x, _spike_dtype(x.dtype, weight.dtype)), weight.new_empty(weight.shape[0] * (weight.shape[1] + 4)),
        weight.new_empty(0 if gamma0 is None else (5, weight.shape[0]))))
    _bn_step_backward_op.register_fake(lambda grad, x, weight, gamma, flat, p0, *args: (
        dense(x) if args[-1] else x.new_empty(0),
        weight.new_empty(weight.shape[0] * (weight.shape[1] + 2 + 2 * (p0.numel() > 0)))))
    _param_step_op.register_fake(lambda x, weight, *_: (
        dense(x, _spike_dtype(x.dtype, weight.dtype)), weight.new_empty(weight.shape[0] * (weight.shape[1] + 2))))
    _param_step_backward_op.register_fake(lambda grad, x, weight, flat, *args: (
        dense(x) if args[-1] else x.new_empty(0), weight.new_empty(weight.shape[0] * (weight.shape[1] + 1))))
    _charge_op.register_autograd(_charge_grad, setup_context=_charge_setup)
    _bn_step_op.register_autograd(_bn_grad, setup_context=_bn_setup)
    _param_step_op.register_autograd(_param_grad, setup_context=_param_setup)


_register_fakes_and_grads()


# ---------------------------------------------------------------- registry entries
def charge(x, weight, bias, dilation, layout):
    """Registry contract: H, dense, differentiable w.r.t. x, weight and bias."""
    return fire(x, weight, bias, dilation, layout, 0, 0.0)


def fire(x, weight, bias, dilation, layout, code, alpha) -> torch.Tensor:
    """Registry contract: fused charge + Heaviside + the gradient of surrogate ``code``."""
    if torch.compiler.is_compiling():
        return _charge_op(x, weight, bias, dilation, layout, code, float(alpha))
    return _TritonCharge.apply(x, weight, bias, dilation, layout, code, alpha)


def bn_fire(x, weight, gamma, beta, eps, ste, dilation, layout, code, alpha, running=None, given=None,
            input_bn=None):
    """Registry contract: ``(spikes, mean, var)`` from the three forward kernels (one autograd node, three
    kernels backward), or None for an empty batch, parameters or statistics of another dtype or device
    than the weight, a folding with NaN or inf (on the CPU; on CUDA an asynchronous error stops the
    stream), or under torch.compile with given statistics (where the general path's kernel is as fast).
    ``input_bn``: ``(gamma0, beta0, eps0, running0, given0)`` of a batch norm of X fused in front (its
    statistics in two more kernels; None for a batch of one value per channel, which a batch norm refuses
    in training). Tried before the general path's checks (``checks_inputs``): anything those would refuse or
    change goes that way (:func:`_as_checked`)."""
    if not x.numel() or not _as_checked(x, weight, dilation, layout):
        return None
    dtype, device = weight.dtype, x.device
    vectors = (gamma, beta) + (() if running is None else tuple(running[:2])) + (() if given is None else tuple(given))
    if input_bn is not None:
        gamma0, beta0, eps0, running0, given0 = input_bn
        vectors += (gamma0, beta0) + tuple(running0[:2] if running0 is not None else ()) + tuple(given0 or ())
        if given0 is None and x.numel() <= weight.shape[0]:
            return None
    if dtype not in (torch.float32, torch.float64) or x.dtype not in DTYPES or weight.device != device \
            or not _vectors_of(dtype, device, weight.shape[0], vectors, running, input_bn):
        return None
    pre = None if input_bn is None else (float(eps0), running0, given0)
    cfg = (float(eps), ste, dilation, layout, code, alpha, running, given, pre)
    gamma0, beta0 = (None, None) if input_bn is None else input_bn[:2]
    if torch.compiler.is_compiling():
        return None if given is not None or (pre is not None and pre[2] is not None) else \
            _compiled_bn_fire(x, weight, gamma, beta, gamma0, beta0, cfg)
    floats = [eps] + ([] if running is None else [running[2]]) + ([] if input_bn is None else [eps0]) + \
        ([] if input_bn is None or running0 is None else [running0[2]])
    if not all(_passes(float(v), dtype) for v in floats):  # (e.g. a float64 eps below float32's range; eager
        return None                                       # only: a compiled graph cannot branch on it)
    try:
        if needs_grad(x, weight, gamma, beta, gamma0, beta0):
            out = _TritonBNFire.apply(x, weight, gamma, beta, gamma0, beta0, cfg)
        else:
            s, mean, var, *_ = _bn_forward(x, weight, gamma, beta, cfg, gamma0, beta0)
            out = s if given is not None else (s, mean, var)
    except _Refused:
        return None
    return out if given is None else (out, *given)


def _vectors_of(dtype, device, c, vectors, running, input_bn) -> bool:
    """Whether every tensor of ``vectors`` holds one value per channel, ``(c,)``, of ``dtype`` on ``device``,
    and no running statistic the step writes is expanded (stride 0: every channel would write one element).
    (Loops: a generator costs as much as the checks.)"""
    for v in vectors:
        if v.dtype != dtype or v.device != device or v.dim() != 1 or v.shape[0] != c:
            return False
    written = (running or ())[:2] + ((input_bn[3] or ())[:2] if input_bn is not None else ())
    for v in written:
        if c > 1 and v.stride(0) == 0:
            return False
    return True


def _as_checked(x, weight, dilation, layout) -> bool:
    """Whether the general path's checks would pass this call to Triton as it is: an input of three dims or
    more with the weight's channels, of at most the weight's precision (a lower one Triton reads itself), that
    Triton's kernels run (the dtypes and devices ``bn_fire`` checks itself; the caller has checked the layout
    and the dilation)."""
    if x.dim() < 3 or weight.dim() != 2 or weight.shape[1] < 1 or x.shape[channel_dim(layout)] != weight.shape[0]:
        return False
    return torch.promote_types(x.dtype, weight.dtype) == weight.dtype and not requirements(x, weight, dilation, layout)


def _compiled_bn_fire(x, weight, gamma, beta, gamma0, beta0, cfg):
    """``bn_fire`` under torch.compile, as the operator, then the running statistics blended in as
    K2 does: ``(spikes, mean, var)``."""
    eps, ste, dilation, layout, code, alpha, running, _, pre = cfg
    eps0, running0, _ = pre if pre is not None else (1.0, None, None)
    s, flat, p0 = _bn_step_op(x, weight, gamma, beta, gamma0, beta0, eps, eps0, ste or "none", dilation, layout,
                              code, float(alpha))
    _, _, _, mean, var = _unfolded(flat.detach(), *weight.shape)
    n = x.numel() // weight.shape[0]
    with torch.no_grad():
        for stats, row in ((running, None), (running0, 0)):
            if stats is not None:
                m, v = (mean, var) if row is None else (p0[0], p0[3])
                stats[0].lerp_(m, stats[2])
                stats[1].lerp_(v * (n / max(n - 1, 1)), stats[2])
    return s, mean, var


def param_fire(x, weight, v_threshold, ste, dilation, layout, code, alpha) -> Optional[torch.Tensor]:
    """Registry contract: the spikes from two kernels each way, or None for an empty batch, a threshold
    of another dtype or device than the weight, NaN or inf in the weight or threshold (on the CPU; on
    CUDA an asynchronous error; under torch.compile an error)."""
    if not x.numel():
        return None
    if weight.dtype not in (torch.float32, torch.float64) or x.dtype not in DTYPES or weight.device != x.device \
            or v_threshold.dtype != weight.dtype or v_threshold.device != x.device or v_threshold.dim() != 1:
        return None
    cfg = (ste, dilation, layout, code, alpha)
    if torch.compiler.is_compiling():
        return _param_step_op(x, weight, v_threshold, ste or "none", dilation, layout, code, float(alpha))[0]
    try:
        if needs_grad(x, weight, v_threshold):
            return _TritonParamFire.apply(x, weight, v_threshold, cfg)
        return _param_forward(x, weight, v_threshold, cfg)[0]
    except _Refused:
        return None


def _driver_device() -> Optional[str]:
    """The device type Triton's kernels run on here: the CPU under its interpreter, else its active
    driver's (CUDA; the CPU for a CPU backend), None where it has none."""
    if INTERPRETED:
        return "cpu"
    try:
        return _device_type_of(triton.runtime.driver.active)
    except Exception:  # (Triton raises RuntimeError where no driver is active; a driver may raise more)
        return None


@functools.lru_cache(maxsize=4)  # (per driver object: a test may make another one active)
def _device_type_of(driver) -> str:
    return driver.get_active_torch_device().type


def requirements(x, weight, dilation, layout) -> list[str]:
    """CUDA tensors, or CPU ones where Triton runs on the CPU (its interpreter; read at the call: a test
    may switch it)."""
    if x.is_cuda or (x.is_cpu and _driver_device() == "cpu"):
        return []
    hint = "; on the CPU set TRITON_INTERPRET=1 before importing spikingjelly_mfpsn" if x.is_cpu else ""
    return [f"triton kernels need CUDA tensors (x is on {x.device}){hint}"]


# On the CPU only through Triton's interpreter, and never chosen by method='auto' there.
register(Implementation(
    "triton", "triton", LAYOUTS, charge, "Triton kernels on the strided layout: bias and (with a fused surrogate) spike "
    "fused, and the BN- and parameter-threshold steps in three and two kernels each way",
    requirements=requirements, dtypes=DTYPES,
    priority=lambda device, k, t: 20 if device == "cuda" else -1,
    fire=fire, bn_fire=bn_fire, param_fire=param_fire, fuses_input_bn=True, compiles=False, checks_inputs=True,
    autoselect=not INTERPRETED and torch.cuda.is_available()))  # a candidate where its kernels run compiled
