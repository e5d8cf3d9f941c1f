"""Tile geometry of the Triton kernels, in plain Python: which tiles exist, which the autotuner tries.

A tile is ``(BR, BC, BT)``: rows (samples times features), channels and time steps that one program
covers. Nothing here imports Triton, so the rules are the same on any machine.
"""
import functools
import math

# Time-first (T, N, C, M): C (when M = 1) or M is the contiguous axis and T the outermost, so tiles are
# wide in rows/channels and short in T. Time-last (N, C, M, T): T is contiguous, so tiles are long in T,
# with row-heavy ones for the short T common in SNNs (T = 4..8).
GPU_TILES = {"time_first": [(1, 256, 2), (4, 64, 4), (16, 16, 4), (64, 4, 4), (256, 1, 2), (128, 1, 8)],
             "time_last": [(4, 1, 256), (8, 1, 128), (16, 1, 64), (32, 1, 32), (64, 1, 16), (128, 1, 8),
                           (256, 1, 4)]}
# Triton's interpreter: one tile per layout (nothing to benchmark on the CPU); few, large programs, as
# each program costs interpreter overhead; test shapes past 32 rows / 4 channels / 16 steps still span
# several tiles.
INTERPRETER_TILES = {"time_first": [(32, 4, 16)], "time_last": [(32, 4, 16)]}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def pow2_ceil(n: int) -> int:
    """The least power of two that is at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def pow2_floor(n: int) -> int:
    """The greatest power of two that is at most ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n.bit_length() - 1, 0)


@functools.lru_cache(maxsize=256)  # (host time on every launch; a loop meets a few shapes)
def fold_blocks(c: int, n_split: int, per_channel: int, budget: int = 2048, max_bc: int = 64) -> tuple[int, int]:
    """``(channel block, split block)`` of a per-channel kernel that adds ``per_channel`` values of each
    of ``n_split`` splits: about ``budget`` values a step, both powers of two (``tl.arange`` sizes)."""
    bc = min(pow2_ceil(c), pow2_floor(max(budget // per_channel, 1)), max_bc)
    return bc, min(pow2_ceil(n_split), pow2_floor(max(budget // (bc * per_channel), 1)))


def num_warps(tile: tuple) -> int:
    """Warps per program: 4 for tiles of at most 1024 elements, else 8."""
    return 4 if math.prod(tile) <= 1024 else 8


def padded_work(tile: tuple, r: int, c: int, t: int) -> int:
    """Elements the tiles cover for an ``(R, C, T)`` problem, masked-off padding included."""
    return math.prod(cdiv(n, b) * b for b, n in zip(tile, (r, c, t)))


def worth_trying(tiles: list, r: int, c: int, t: int) -> list:
    """The tiles the autotuner benchmarks for this shape: padded work within 2x of the least.

    Never empty for a non-empty ``tiles``: the least wasteful tile is always kept.
    """
    least = min(padded_work(tile, r, c, t) for tile in tiles)
    return [tile for tile in tiles if padded_work(tile, r, c, t) <= 2 * least]


@functools.lru_cache(maxsize=256)  # (host time on every launch; a loop meets a few shapes)
def reduction_grid(tile: tuple, r: int, c: int, t: int, target: int) -> tuple[int, int]:
    """Programs of a reducing kernel, ``(channel blocks, splits)``.

    Each channel block's tiles are shared by enough programs (splits) to reach about ``target``
    programs in all, and never more programs than tiles.
    """
    br, bc, bt = tile
    n_cb = cdiv(c, bc)
    n_tiles = cdiv(r, br) * cdiv(t, bt)
    return n_cb, max(1, min(n_tiles, target // n_cb))
