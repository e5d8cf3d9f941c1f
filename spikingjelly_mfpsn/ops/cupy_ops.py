"""CuPy backend of the charge: the CUDA C kernels of ``cuda/mfpsn_charge.cu`` behind an autograd Function.

Registered as implementation ``'cupy'`` (backend ``'cupy'``, both layouts) only when the ``cupy``
package is installed and torch sees a CUDA device; otherwise nothing is registered and
:func:`unavailable_reason` says why. ``cupy`` itself is imported at the first launch.

How the kernels see a tensor: four logical axes ``(N, C, M, T)`` (all feature axes merged into M)
read through their strides, so permuted or expanded inputs need no copy; only when the feature axes
cannot be merged into one stride is the tensor made contiguous first (one explicit copy).
Outputs are contiguous. Float32, float64, float16 and bfloat16 are supported; half types
accumulate in float32. ``dL/dW`` and ``dL/db`` are block partial sums added up by torch, without
atomics, so every result is reproducible bit for bit.

Everything between the tensors and the kernels goes through a *launcher*
``launch(name, blocks, args, device)`` with attributes ``block`` (threads per block, the
``MFPSN_BLOCK`` the source was compiled with) and ``max_blocks``. :class:`CupyLauncher` runs the
kernels on the GPU; the tests pass a launcher that runs the same source on the CPU.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .registry import LAYOUTS, Implementation, check_layout, first_order_only, note_unavailable, register

KERNEL_FILE = Path(__file__).with_name("cuda") / "mfpsn_charge.cu"

# Storage dtype -> (kernel name suffix, accumulation dtype of weights, bias and partial sums).
DTYPES = {torch.float32: ("f32", torch.float32), torch.float64: ("f64", torch.float64),
          torch.float16: ("f16", torch.float32), torch.bfloat16: ("bf16", torch.float32)}

# grad_W/grad_b: each block sums about this many elements per thread before the block reduction.
ITEMS_PER_THREAD = 8

# The kernels with 32-bit index arithmetic (suffix _i32) run a launch whose every element index and
# memory offset stays below this; the 64-bit ones the others.
INDEX32_LIMIT = 2 ** 31 - 1


def kernel_source() -> str:
    """The CUDA C source of the kernels (plain text, no includes)."""
    return KERNEL_FILE.read_text()


# ---------------------------------------------------------------- launching on the GPU
class CupyLauncher:
    """Compiles the source once per device with CuPy (NVRTC) and launches on torch's current stream."""

    block = 256
    lanes = 32  # channels a grad_wb block sums side by side where the channel axis is the contiguous one
    max_blocks = 1 << 16  # kernels loop over what a grid this large does not cover

    def __init__(self):
        self._module = None

    def function(self, name: str):
        import cupy
        if self._module is None:
            self._module = cupy.RawModule(code=kernel_source(), options=(f"-DMFPSN_BLOCK={self.block}",))
        return self._module.get_function(name)  # compiled per device on first use, then cached

    def __call__(self, name: str, blocks: int, args: tuple, device: torch.device) -> None:
        import cupy
        with cupy.cuda.Device(device.index):
            stream = torch.cuda.current_stream(device)
            with cupy.cuda.ExternalStream(stream.cuda_stream):
                self.function(name)((blocks,), (self.block,), args)


_CUPY_LAUNCHER = CupyLauncher()


# ---------------------------------------------------------------- tensors -> kernel arguments
def _axes(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, tuple[int, int, int, int], tuple[int, ...]]:
    """``t`` viewed with four axes; returns (tensor to read, sizes (N, C, M, T), strides (N, C, M, T))."""
    if layout == "time_first":
        steps, n, c = t.shape[:3]
        m = math.prod(t.shape[3:])
        shape, order = (steps, n, c, m), (1, 2, 3, 0)
    else:
        n, c, steps = t.shape[0], t.shape[1], t.shape[-1]
        m = math.prod(t.shape[2:-1])
        shape, order = (n, c, m, steps), (0, 1, 2, 3)
    try:
        view = t.view(shape)
    except RuntimeError:  # the feature axes do not merge into one stride: the one documented copy
        t = t.contiguous()
        view = t.view(shape)
    strides = view.stride()
    return t, (n, c, m, steps), tuple(strides[i] for i in order)


def _ptr(t: Optional[torch.Tensor]) -> np.uintp:
    return np.uintp(0 if t is None else t.data_ptr())


def _i64(*values: int) -> tuple:
    return tuple(np.int64(v) for v in values)


def _grid(total: int, launch) -> int:
    return max(1, min(-(-total // launch.block), launch.max_blocks))


def _index_suffix(launch, sizes, *strides) -> str:
    """``'_i32'`` where a launch over ``sizes`` (N, C, M, T) indexes within :data:`INDEX32_LIMIT` (every
    element index, plus one grid's stride past the last, and every offset through each of ``strides``),
    else ``''`` (64-bit)."""
    reach = math.prod(sizes) + launch.max_blocks * launch.block
    offsets = [sum((n - 1) * abs(s) for n, s in zip(sizes, st)) for st in strides]
    return "_i32" if max([reach, *offsets]) <= INDEX32_LIMIT else ""


def forward(launch, x, weight, bias, dilation: int, layout: str) -> torch.Tensor:
    """``H`` (contiguous, ``x``'s shape and dtype) from ``x`` and accumulation-dtype ``weight``/``bias``."""
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if h.numel() == 0:
        return h
    x, sizes, strides = _axes(x, layout)
    sfx = DTYPES[x.dtype][0] + _index_suffix(launch, sizes, strides)
    args = (_ptr(x), _ptr(weight), _ptr(bias), _ptr(h), *_i64(*sizes, *strides),
            np.int32(layout == "time_last"), np.int32(weight.shape[1]), np.int64(dilation),
            np.int32(bias is not None))
    launch(f"mfpsn_forward_{sfx}", _grid(h.numel(), launch), args, x.device)
    return h


def grad_input(launch, grad_h, weight, dilation: int, layout: str) -> torch.Tensor:
    """``dL/dX`` (contiguous) from ``dL/dH``: the correlation with the time-reversed taps."""
    gx = torch.empty(grad_h.shape, dtype=grad_h.dtype, device=grad_h.device)
    if gx.numel() == 0:
        return gx
    grad_h, sizes, strides = _axes(grad_h, layout)
    sfx = DTYPES[grad_h.dtype][0] + _index_suffix(launch, sizes, strides)
    args = (_ptr(grad_h), _ptr(weight), _ptr(gx), *_i64(*sizes, *strides),
            np.int32(layout == "time_last"), np.int32(weight.shape[1]), np.int64(dilation))
    launch(f"mfpsn_grad_x_{sfx}", _grid(gx.numel(), launch), args, grad_h.device)
    return gx


def grad_weight_bias(launch, x, grad_h, k: int, dilation: int, layout: str, with_bias: bool):
    """``(dL/dW (C, k), dL/db (C,) or None)`` in the accumulation dtype, summed over N, M and T."""
    x, sizes, x_strides = _axes(x, layout)
    grad_h, _, g_strides = _axes(grad_h, layout)
    n, c, m, steps = sizes
    acc = DTYPES[x.dtype][1]
    taps = k + int(with_bias)
    per_channel = n * m * steps
    # Channels side by side where they are x's contiguous axis (time-first (T, N, C)), else one per block.
    lanes = min(launch.lanes, 1 << max(c - 1, 0).bit_length()) if x_strides[1] == 1 and m == 1 else 1
    groups = -(-c // lanes)
    parts = max(1, min(-(-per_channel // (launch.block // lanes * ITEMS_PER_THREAD)),
                       launch.max_blocks // max(1, taps * groups)))
    partial = torch.empty(taps, c, parts, dtype=acc, device=x.device)
    if per_channel == 0:
        partial.zero_()
    else:
        args = (_ptr(x), _ptr(grad_h), _ptr(partial), *_i64(*sizes, *x_strides, *g_strides),
                np.int32(layout == "time_last"), np.int32(k), np.int64(dilation), np.int64(parts), np.int32(lanes))
        sfx = DTYPES[x.dtype][0] + _index_suffix(launch, sizes, x_strides, g_strides)
        launch(f"mfpsn_grad_wb_{sfx}", taps * groups * parts, args, x.device)
    sums = partial.sum(-1)  # (taps, C), a fixed-order reduction
    return sums[:k].t().contiguous(), (sums[k] if with_bias else None)


class _Charge(torch.autograd.Function):
    """The charge through a launcher; ``x`` in its storage dtype, ``weight``/``bias`` in the accumulation dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, dilation, layout, launch):
        ctx.save_for_backward(x, weight)
        ctx.dilation, ctx.layout, ctx.launch, ctx.has_bias = dilation, layout, launch, bias is not None
        return forward(launch, x, weight, bias, dilation, layout)

    @staticmethod
    def backward(ctx, grad_h):  # (not once_differentiable: that runs it under no_grad, past the check)
        first_order_only("cupy")
        x, weight = ctx.saved_tensors
        grad_h = grad_h.to(x.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_input(ctx.launch, grad_h, weight, ctx.dilation, ctx.layout)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            grad_w, grad_b = grad_weight_bias(ctx.launch, x, grad_h, weight.shape[1], ctx.dilation,
                                              ctx.layout, ctx.has_bias)
        return grad_x, grad_w, grad_b, None, None, None


def charge_with(launch, x, weight, bias, dilation: int, layout: str) -> torch.Tensor:
    """The registry contract, run through ``launch``: ``H`` in ``result_type(x, weight)``, contiguous."""
    check_layout(layout)
    dtype = torch.result_type(x, weight)
    if dtype not in DTYPES:
        raise ValueError(f"the cupy charge supports dtypes {[str(d) for d in DTYPES]}, got {dtype}")
    acc = DTYPES[dtype][1]
    w = weight.to(acc).contiguous()
    b = None if bias is None else bias.to(acc).contiguous()
    return _Charge.apply(x.to(dtype), w, b, dilation, layout, launch)


@torch.compiler.disable  # (torch.compile cannot trace a CuPy launch: it runs eagerly between graphs)
def cupy_charge(x, weight, bias, dilation, layout):
    """CUDA kernels launched through CuPy (CUDA tensors only)."""
    return charge_with(_CUPY_LAUNCHER, x, weight, bias, dilation, layout)


# ---------------------------------------------------------------- availability and registration
def unavailable_reason() -> Optional[str]:
    """Why the cupy backend cannot run on this machine, or ``None`` when it can."""
    if importlib.util.find_spec("cupy") is None:
        return "the cupy package is not installed"
    if not torch.cuda.is_available():
        return "cupy is installed but torch sees no CUDA device"
    return None


IMPLEMENTATION = Implementation("cupy", "cupy", LAYOUTS, cupy_charge,
                                "CUDA C kernels via CuPy: one thread per output, block-reduced weight gradient",
                                devices=("cuda",), dtypes=tuple(DTYPES), priority=lambda device, k, t: 15,
                                compiles=False)


def register_if_available() -> Optional[str]:
    """Register :data:`IMPLEMENTATION` if this machine can run it; else record and return why not."""
    reason = unavailable_reason()
    if reason is None:
        register(IMPLEMENTATION)
    else:
        note_unavailable("cupy", reason)
    return reason


register_if_available()
