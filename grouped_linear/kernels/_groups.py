"""Where rows and tiles fall among groups: Triton helpers the kernels share, and the
plain-PyTorch row -> group map.

Groups are given either by their cumulative row ends (``ends`` ``(G,)``, non-decreasing)
or by their sizes (``sizes`` ``(G,)``, any integers: negative ones count as 0 and the ends
are clamped to the rows there are).
"""

import torch

from ._triton import tl, triton

__all__ = ["row_groups", "row_group", "group_rows", "group_span", "tile_list", "tile_origin",
           "tile_masks", "weight_tile"]


def row_groups(ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(M,)`` group of every row; ``G`` for rows past ``ends[-1]``."""
    rows = torch.arange(num_rows, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, rows, right=True)


@triton.jit
def row_group(ends_ptr, rows, G, BLOCK_G: tl.constexpr):
    """Group of each row: how many group ends are <= the row (``G`` past the last end)."""
    count = tl.zeros_like(rows)
    for g0 in range(0, G, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        ends = tl.load(ends_ptr + gs, mask=gs < G, other=2147483647)
        count += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    return count


@triton.jit
def group_rows(sizes_ptr, G, M, BLOCK_G: tl.constexpr):
    """Vectors over ``BLOCK_G > G`` slots: group start and end rows, clamped to
    ``[0, M]`` (negative sizes count as 0); slot ``G`` is the tail ``[sum, M)``."""
    gs = tl.arange(0, BLOCK_G)
    sizes = tl.maximum(tl.load(sizes_ptr + gs, mask=gs < G, other=0).to(tl.int64), 0)
    inclusive = tl.cumsum(sizes, axis=0)
    ends = tl.minimum(inclusive, M)
    starts = tl.minimum(inclusive - sizes, M)
    ends = tl.where(gs == G, M, ends)
    return gs, starts, ends


@triton.jit
def group_span(g, sizes_ptr, G, M, BLOCK_G: tl.constexpr):
    """Group ``g``'s (clamped) start and end rows, as :func:`group_rows` gives them."""
    gs, starts, ends = group_rows(sizes_ptr, G, M, BLOCK_G)
    return tl.sum(tl.where(gs == g, starts, 0), axis=0), tl.sum(tl.where(gs == g, ends, 0), axis=0)


@triton.jit
def tile_list(sizes_ptr, G, M, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """The persistent schedule: every group's (row tile, column tile) pairs of an ``(M, W)``
    output, numbered group after group (slot ``G``, the tail, included). Returns the per-slot
    vectors the tiles are looked up in, and the tile count."""
    gs, starts, ends = group_rows(sizes_ptr, G, M, BLOCK_G)
    n_tiles = tl.cdiv(W, BLOCK_N)
    tiles = ((ends - starts + BLOCK_M - 1) // BLOCK_M) * n_tiles
    tile_end = tl.cumsum(tiles, axis=0)
    return gs, starts, ends, tile_end - tiles, tile_end, tl.sum(tiles, axis=0)


@triton.jit
def tile_origin(tile, gs, starts, ends, tile_begin, tile_end, W, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Tile ``tile`` of :func:`tile_list`: its group (``G`` for the tail), the group's end
    row, the tile's first row and its column-tile index."""
    owner = (tile_begin <= tile) & (tile < tile_end)
    n_tiles = tl.cdiv(W, BLOCK_N)
    g = tl.sum(tl.where(owner, gs, 0), axis=0)
    local = tile - tl.sum(tl.where(owner, tile_begin, 0), axis=0)
    end = tl.sum(tl.where(owner, ends, 0), axis=0)
    row0 = tl.sum(tl.where(owner, starts, 0), axis=0) + (local // n_tiles) * BLOCK_M
    return g, end, row0, local % n_tiles


@triton.jit
def tile_masks(end, row0, col0, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's row and column offsets from ``row0`` / ``col0`` and their masks: rows before
    the group's ``end``, columns inside ``W``. The offsets stay int32 (int64 scalar bases:
    64-bit pointer tensors live across a K loop spill registers on sm90, ptxas -v)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    return rows, cols, rows < (end - row0).to(tl.int32), cols < (W - col0).to(tl.int32)


@triton.jit
def weight_tile(pid, sizes_ptr, G, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_G: tl.constexpr):
    """Tile ``pid`` of a ``(G, N, K)`` weight gradient, numbered group, N tile, K tile: its
    group, K tile, the group's (clamped) start and end rows, and its ``N`` and ``K``
    columns with their masks."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    g = pid // (n_tiles * k_tiles)
    n_tile = (pid // k_tiles) % n_tiles
    k_tile = pid % k_tiles
    start, end = group_span(g, sizes_ptr, G, M, BLOCK_G)
    cols_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    return g, k_tile, start, end, cols_n, cols_k, cols_n < N, cols_k < K
