"""Triton kernels for the charge in both layouts (paper Appendix A, Algorithms 2 and 3).

Every tensor is addressed through strides as logical ``(T, N, C, M)``, ``M`` being the trailing
feature dims merged into one (a view, so no copy, whenever their strides allow it; otherwise one
explicit copy): time-first ``(T, N, C, ...)`` and time-last ``(N, C, ..., T)`` run the same kernels
in place, with no reshape of ``T`` and no transpose. What differs per layout is the tile shape, so
each layout has its own ``triton.autotune`` config list keyed on the problem shape.

A program owns a ``(BR, BC, BT)`` tile: rows ``r = n * M + m``, channels ``c``, steps ``t``.

* :func:`_charge_fwd_kernel` -- ``H[t] = sum_i W[c, i] * X[t - (k-1-i) d] + b[c]``, bias fused, and
  optionally the spike ``S = (H >= 0)`` (threshold fused: the bias is ``-V_th``) so that
  charge + fire reads X once and writes S (and H, which the surrogate gradient needs) once.
* :func:`_charge_bwd_kernel` -- one pass over ``dL/dH`` and X giving all three gradients:
  ``dL/dX[t] = sum_i W[c, i] * dL/dH[t + (k-1-i) d]`` (the forward convolution with the flipped
  weight, run backwards in time), and per-program partial sums of ``dL/dW`` and ``dL/db`` that a
  second stage adds up in a fixed order (deterministic: no atomics). In the fused path it forms
  ``dL/dH = dL/dS * surrogate'(H)`` on the fly, so ``dL/dH`` never goes to memory.

Accumulation is in float32 (float64 for float64 inputs). Kernels need a CUDA device, or
``TRITON_INTERPRET=1`` set before this module is imported (then they run on the CPU).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .registry import Implementation, first_order_only, needs_grad, register, surrogate_kind

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_PI: tl.constexpr = tl.constexpr(math.pi / 2)


# ---------------------------------------------------------------- kernels
@triton.jit
def _tile_offsets(r, c, M, s_n, s_c, s_m):
    """(BR, BC, 1) offsets of rows ``r = n * M + m`` and channels ``c`` (time added separately)."""
    n = r // M
    m = r - n * M
    return (n * s_n + m * s_m)[:, None, None] + (c * s_c)[None, :, None]


@triton.jit
def _surrogate_grad(h, alpha, SG: tl.constexpr):
    """SpikingJelly's surrogate derivative at ``h``: 1 = ATan, 2 = Sigmoid."""
    if SG == 1:
        ax = _HALF_PI * alpha * h
        g = (0.5 * alpha) / (1.0 + ax * ax)
    else:
        s = tl.sigmoid(alpha * h)
        g = alpha * (1.0 - s) * s
    return g


@triton.jit
def _charge_fwd_kernel(X, W, B, H, S, R, C, T, M, K, dilation,
                       sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k,
                       HAS_BIAS: tl.constexpr, STORE_H: tl.constexpr, SPIKE: tl.constexpr,
                       ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """H (and/or S) for one (BR, BC, BT) tile; X strided, H and S dense of the same logical shape."""
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
    acc = tl.zeros((BR, BC, BT), dtype=ACC)
    for i in range(K):
        # Tap i reads (k-1-i)*d steps back; steps before 0 are the causal zero padding.
        src = t - (K - 1 - i) * dilation
        mask = rc_mask & ((src >= 0) & (t < T))[None, None, :]
        xv = tl.load(X + x_rc + (src * sx_t)[None, None, :], mask=mask, other=0.0)
        wv = tl.load(W + c * sw_c + i * sw_k, mask=c < C, other=0.0)
        acc += wv.to(ACC)[None, :, None] * xv.to(ACC)
    if HAS_BIAS:
        acc += tl.load(B + c, mask=c < C, other=0.0).to(ACC)[None, :, None]
    out = _tile_offsets(r, c, M, so_n, so_c, so_m) + (t * so_t)[None, None, :]
    mask = rc_mask & (t < T)[None, None, :]
    h = acc.to(H.dtype.element_ty)
    if STORE_H:
        tl.store(H + out, h, mask=mask)
    if SPIKE:
        # Heaviside of the stored (rounded) H, exactly what the surrogate module would see; compared
        # widened, which is exact (and the interpreter cannot compare bfloat16).
        tl.store(S + out, tl.where(h.to(ACC) >= 0, 1.0, 0.0).to(S.dtype.element_ty), mask=mask)


@triton.jit
def _charge_bwd_kernel(G, H, X, W, GX, PW, PB, R, C, T, M, K, dilation, alpha,
                       sx_n, sx_c, sx_m, sx_t, so_n, so_c, so_m, so_t, sw_c, sw_k,
                       SG: tl.constexpr, NEED_GX: tl.constexpr, NEED_GW: tl.constexpr,
                       NEED_GB: tl.constexpr, ACC: tl.constexpr, BK: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Program (channel block, split s) walks tiles s, s + S, ... of its channels.

    G (dL/dH, or dL/dS when SG != 0), H (saved, SG != 0 only) and GX are dense; X is strided.
    Writes dL/dX tiles and this program's partial dL/dW (S, C, BK) and dL/db (S, C).
    """
    cb = tl.program_id(0)
    split = tl.program_id(1)
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
        xv = tl.zeros((BR, BC, BT), dtype=ACC)
        if NEED_GW:
            x_off = _tile_offsets(r, c, M, sx_n, sx_c, sx_m) + (t * sx_t)[None, None, :]
            xv = tl.load(X + x_off, mask=rc_mask & (t < T)[None, None, :], other=0.0).to(ACC)
        gx = tl.zeros((BR, BC, BT), dtype=ACC)
        for i in range(K):
            # X[t] reached H[t + (k-1-i)*d] through tap i.
            dst = t + (K - 1 - i) * dilation
            mask = rc_mask & (dst < T)[None, None, :]
            off = o_rc + (dst * so_t)[None, None, :]
            g = tl.load(G + off, mask=mask, other=0.0).to(ACC)
            if SG != 0:
                g = g * _surrogate_grad(tl.load(H + off, mask=mask, other=0.0).to(ACC), alpha, SG)
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


# ---------------------------------------------------------------- autotune configs per layout
INTERPRETED = type(_charge_fwd_kernel).__name__ == "InterpretedFunction"

# (BR, BC, BT) tiles. Time-first (T, N, C, M): C (when M = 1) or M is the contiguous axis and T the
# outermost, so tiles are wide in rows/channels and short in T. Time-last (N, C, M, T): T is
# contiguous, so tiles are long in T, with row-heavy ones for the short T common in SNNs (T = 4..8).
GPU_TILES = {"time_first": [(1, 256, 2), (4, 64, 4), (16, 16, 4), (64, 4, 4), (256, 1, 2), (128, 1, 8)],
             "time_last": [(4, 1, 256), (8, 1, 128), (16, 1, 64), (32, 1, 32), (64, 1, 16), (128, 1, 8),
                           (256, 1, 4)]}
# The interpreter: one config per layout (nothing to benchmark on the CPU); few, large programs, as
# each program costs interpreter overhead; test shapes past 32 rows / 4 channels / 16 steps still
# span several tiles.
INTERPRETER_TILES = {"time_first": [(32, 4, 16)], "time_last": [(32, 4, 16)]}
_TILES = INTERPRETER_TILES if INTERPRETED else GPU_TILES


def _configs(layout: str, tiles=None) -> list:
    return [triton.Config({"BR": br, "BC": bc, "BT": bt}, num_warps=4 if br * bc * bt <= 1024 else 8)
            for br, bc, bt in (tiles or _TILES)[layout]]


def _padded_work(config, r: int, c: int, t: int) -> int:
    """Elements a config's tiles cover for an (R, C, T) problem, masked-off padding included."""
    kw = config.kwargs
    return math.prod(triton.cdiv(n, kw[b]) * kw[b] for b, n in (("BR", r), ("BC", c), ("BT", t)))


def _prune(configs, named_args, **kwargs):
    """Benchmark only tiles that waste little on this shape: padded work within 2x of the least."""
    r, c, t = (int(named_args[n]) for n in ("R", "C", "T"))
    least = min(_padded_work(cf, r, c, t) for cf in configs)
    return [cf for cf in configs if _padded_work(cf, r, c, t) <= 2 * least]


_KEY = ["R", "C", "T", "M", "K"]
_FWD = {layout: triton.autotune(_configs(layout), key=_KEY, prune_configs_by={"early_config_prune": _prune})(
    _charge_fwd_kernel) for layout in _TILES}
_BWD = {layout: triton.autotune(_configs(layout), key=_KEY, prune_configs_by={"early_config_prune": _prune},
                                reset_to_zero=["PW", "PB"])(_charge_bwd_kernel) for layout in _TILES}


# ---------------------------------------------------------------- launchers
def _view4(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, tuple[int, int, int, int], int]:
    """``x`` as logical (T, N, C, M): (tensor to address, strides (n, c, m, t), M).

    ``reshape`` merges the feature dims into M as a view when their strides allow, else copies once.
    """
    if layout == "time_first":
        x4 = x.reshape(*x.shape[:3], -1)
        s_t, s_n, s_c, s_m = x4.stride()
        return x4, (s_n, s_c, s_m, s_t), x4.shape[3]
    x4 = x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    return x4, x4.stride(), x4.shape[2]


def _sizes(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(R, C, T): rows N*M, channels, steps."""
    t = x.shape[0] if layout == "time_first" else x.shape[-1]
    c = x.shape[2] if layout == "time_first" else x.shape[1]
    return x.numel() // max(t * c, 1), c, t


def _acc_dtype(*tensors):
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else tl.float32


def _forward_grid(tile: dict, r: int, c: int, t: int) -> tuple[int]:
    """One program per (BR, BC, BT) tile."""
    return (triton.cdiv(r, tile["BR"]) * triton.cdiv(c, tile["BC"]) * triton.cdiv(t, tile["BT"]),)


def charge_forward(x, weight, bias, dilation, layout, spike_kind=0, alpha=0.0, store_h=True):
    """Run the forward kernel: returns (H or None, S or None), dense in ``x``'s shape."""
    out_dtype = torch.result_type(x, weight)
    h = torch.empty(x.shape, dtype=out_dtype, device=x.device) if store_h else None
    s = torch.empty(x.shape, dtype=out_dtype, device=x.device) if spike_kind else None
    if x.numel() == 0:
        return h, s
    x4, xs, m = _view4(x, layout)
    out = h if h is not None else s
    _, os_, _ = _view4(out, layout)
    r, c, t = _sizes(x, layout)
    grid = functools.partial(_forward_grid, r=r, c=c, t=t)
    _FWD[layout][grid](x4, weight, bias if bias is not None else weight, out, s if s is not None else out,
                       r, c, t, m, weight.shape[1], dilation, *xs, *os_, *weight.stride(),
                       HAS_BIAS=bias is not None, STORE_H=store_h, SPIKE=bool(spike_kind),
                       ACC=_acc_dtype(x, weight, bias))
    return h, s


@functools.lru_cache(maxsize=None)
def _split_target(device: torch.device) -> int:
    """Programs the backward kernel aims for: enough to fill the GPU (8 on the interpreter)."""
    if INTERPRETED or device.type != "cuda":
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _backward_grid(tile: dict, r: int, c: int, t: int, target: int) -> tuple[int, int]:
    """(channel blocks, splits): each channel block's tiles are shared by enough programs to reach
    about ``target`` programs in all."""
    n_cb = triton.cdiv(c, tile["BC"])
    n_tiles = triton.cdiv(r, tile["BR"]) * triton.cdiv(t, tile["BT"])
    return n_cb, max(1, min(n_tiles, target // n_cb))


def charge_backward(grad, h, x, weight, dilation, layout, spike_kind=0, alpha=0.0,
                    need=(True, True, True)):
    """Run the backward kernel: (dL/dX, dL/dW, dL/db), each None unless asked for in ``need``.

    ``grad`` is dL/dH, or dL/dS with the saved ``h`` when ``spike_kind`` names a surrogate.
    """
    need_gx, need_gw, need_gb = need
    k = weight.shape[1]
    r, c, t = _sizes(x, layout)
    acc = _acc_dtype(x, weight)
    part_dtype = torch.float64 if acc == tl.float64 else torch.float32
    target = _split_target(x.device)
    grid = functools.partial(_backward_grid, r=r, c=c, t=t, target=target)
    most = max(grid(cf.kwargs)[1] for cf in _BWD[layout].configs)  # a partial-sum slot per split
    bk = triton.next_power_of_2(k)
    pw = torch.zeros((most, c, bk), dtype=part_dtype, device=x.device)
    pb = torch.zeros((most, c), dtype=part_dtype, device=x.device)
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_gx else None
    if x.numel() > 0:
        grad = grad.contiguous()  # dense like H; a copy only for strided or broadcast gradients
        x4, xs, m = _view4(x, layout)
        _, os_, _ = _view4(grad, layout)
        _BWD[layout][grid](grad, h if h is not None else grad, x4, weight, gx if gx is not None else grad,
                           pw, pb, r, c, t, m, k, dilation, float(alpha), *xs, *os_, *weight.stride(),
                           SG=spike_kind, NEED_GX=need_gx, NEED_GW=need_gw, NEED_GB=need_gb, ACC=acc, BK=bk)
    gw = pw.sum(0)[:, :k].to(weight.dtype) if need_gw else None
    gb = pb.sum(0) if need_gb else None
    return gx, gw, gb


class _TritonCharge(torch.autograd.Function):
    """H = charge(X, W, b), or S = Heaviside(H) with a fused surrogate gradient when ``spike_kind``."""

    @staticmethod
    def forward(ctx, x, weight, bias, dilation, layout, spike_kind, alpha, keep_h):
        h, s = charge_forward(x, weight, bias, dilation, layout, spike_kind, alpha,
                              store_h=not spike_kind or keep_h)
        ctx.save_for_backward(x, weight, h if spike_kind else None)
        ctx.args = (dilation, layout, spike_kind, alpha, None if bias is None else bias.dtype)
        return s if spike_kind else h

    @staticmethod
    def backward(ctx, grad):
        first_order_only("triton")
        x, weight, h = ctx.saved_tensors
        dilation, layout, spike_kind, alpha, bias_dtype = ctx.args
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias_dtype is not None and ctx.needs_input_grad[2])
        gx, gw, gb = charge_backward(grad, h, x, weight, dilation, layout, spike_kind, alpha, need)
        return gx, gw, None if gb is None else gb.to(bias_dtype), None, None, None, None, None


# ---------------------------------------------------------------- registry entries
def charge(x, weight, bias, dilation, layout):
    """Registry contract: H, dense, differentiable w.r.t. x, weight and bias."""
    return _TritonCharge.apply(x, weight, bias, dilation, layout, 0, 0.0, True)


def fire(x, weight, bias, dilation, layout, surrogate_function) -> Optional[torch.Tensor]:
    """Fused charge + Heaviside + surrogate gradient, or None when this surrogate/dtype is not fused."""
    kind = surrogate_kind(surrogate_function)
    if not kind or torch.result_type(x, weight) == torch.float64:
        return None  # float64: the surrogate constants are float32 kernel scalars
    # H is written only when a backward pass will need it.
    keep_h = needs_grad(x, weight, bias)
    return _TritonCharge.apply(x, weight, bias, dilation, layout, kind, float(surrogate_function.alpha), keep_h)


def requirements(x, weight, dilation, layout) -> list[str]:
    reasons = []
    if not INTERPRETED and not x.is_cuda:
        reasons.append(f"triton kernels need CUDA tensors (x is on {x.device}); on the CPU set "
                       "TRITON_INTERPRET=1 before importing spikingjelly_mfpsn")
    if weight.device != x.device:
        reasons.append(f"triton needs weight on x's device {x.device}, got {weight.device}")
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.dtype not in DTYPES:
            reasons.append(f"triton supports {name} dtypes {[str(d) for d in DTYPES]}, got {tensor.dtype}")
    return reasons


register(Implementation("triton", "triton", ("time_first", "time_last"), charge,
                        "Triton kernels on the strided layout: bias and (with ATan/Sigmoid) spike fused",
                        requirements, fire,
                        # a candidate only where its kernels can run compiled: on a CUDA device
                        autoselect=not INTERPRETED and torch.cuda.is_available()))
