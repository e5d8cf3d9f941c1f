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
