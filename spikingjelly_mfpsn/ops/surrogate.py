"""The surrogate table: SpikingJelly surrogates whose spike the fused kernels reproduce exactly.

One entry per surrogate: its kernel code and the two constants of its derivative from its ``alpha``.
Every backend reads it from here: the C++ kernels are compiled with the codes as macros
(:func:`cpp_defines`), the Triton kernels compare against :data:`CODES`, and both take the constants
from :func:`constants`. Adding a surrogate is one entry here plus its derivative in each kernel
(``surrogate_grad`` in ``cpu/mfpsn_cpu.cpp``, ``_surrogate_grad`` in ``triton_ops.py``); any other
surrogate runs unfused (the charge, then the surrogate module), with the same results.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch.nn.modules import module as _torch_module


class Fused(NamedTuple):
    code: int  # > 0; the kernels' ``kind`` (C++ ``MFPSN_SG_<NAME>``, Triton ``SG``)
    constants: Callable[[float], tuple[float, float]]  # alpha -> (c1, c2) of the kernels' derivative


# SpikingJelly class name -> entry. ATan: dS/dH = c2 / (1 + (c1 H)^2); Sigmoid: c1 s (1 - s), s = sigmoid(c1 H).
TABLE = {
    "ATan": Fused(1, lambda alpha: (math.pi / 2 * alpha, alpha / 2)),
    "Sigmoid": Fused(2, lambda alpha: (alpha, 0.0)),
}
CODES = {name: entry.code for name, entry in TABLE.items()}
NONE = (0, 0.0)  # what :func:`fused` gives for a surrogate the kernels do not reproduce
_BY_CODE = {entry.code: entry for entry in TABLE.values()}


@functools.lru_cache(maxsize=None)
def _types() -> dict:
    """SpikingJelly's class -> code (read at the first call: SpikingJelly imports late)."""
    from .._compat import surrogate
    return {getattr(surrogate, name): code for name, code in CODES.items()}


def fused(surrogate_function) -> tuple[int, float]:
    """``(code, alpha)`` of a surrogate the fused kernels reproduce exactly, else :data:`NONE`.

    Only SpikingJelly's own classes of the table (exact type, spiking mode, a float alpha, no hooks of its
    own or global module hooks): a subclass or a hooked module may behave differently, so it takes the
    unfused path, where the surrogate module is called."""
    # (under torch.compile read afresh: a cache filled inside the first trace made the second step recompile)
    types = _types.__wrapped__() if torch.compiler.is_compiling() else _types()
    code = types.get(type(surrogate_function), 0)
    if not code or not getattr(surrogate_function, "spiking", False) \
            or not isinstance(surrogate_function.alpha, (int, float)):
        return NONE
    if _hooked(surrogate_function):
        return NONE
    return code, float(surrogate_function.alpha)


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch's global module hooks (``register_module_forward_hook`` and kin): dicts it fills in place
_GLOBAL_HOOKS = tuple(getattr(_torch_module, "_global" + name, {}) for name in _HOOKS)


def _hooked(module) -> bool:
    """Whether a hook would see ``module``'s call: its own (forward or backward) or a global module hook."""
    return any(map(bool, _GLOBAL_HOOKS)) or any(getattr(module, name, None) for name in _HOOKS)


def constants(code: int, alpha: float) -> tuple[float, float]:
    """``(c1, c2)`` of the derivative of the surrogate with kernel ``code``."""
    return _BY_CODE[code].constants(alpha)


def cpp_defines() -> list[str]:
    """The compiler flags that give the C++ kernels the table's codes."""
    return [f"-DMFPSN_SG_{name.upper()}={code}" for name, code in CODES.items()]
