"""Move rows between two layouts of the same groups, in one pass (padding and unpadding).

Both layouts hold ``G`` consecutive groups, given by ``(G,)`` non-decreasing cumulative
group ends; the ``i``-th row of group ``g`` in one pairs with the ``i``-th row of group
``g`` in the other while both groups have it. :func:`relayout` writes every row of the
destination exactly once: its partner row from the source, or zeros (padding rows,
rows past the last group). No separate zero fill, no host sync, deterministic.
"""

import torch

from .._groups import row_group
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from ..ends import group_starts

__all__ = ["relayout", "relayout_reference"]


def relayout_reference(src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor,
                       num_dst_rows: int) -> torch.Tensor:
    """Plain-PyTorch :func:`relayout`: a searchsorted pairing, then a masked gather."""
    dst_ends, src_ends = dst_ends.to(torch.int64), src_ends.to(torch.int64)
    num_groups = dst_ends.shape[0]
    rows = torch.arange(num_dst_rows, device=src.device, dtype=torch.int64)
    dst_starts, src_starts = group_starts(dst_ends), group_starts(src_ends)
    group = torch.searchsorted(dst_ends, rows, right=True)
    clamped = group.clamp(max=num_groups - 1)
    local = rows - dst_starts.index_select(0, clamped)
    limit = torch.minimum(dst_ends - dst_starts, src_ends - src_starts)
    valid = (group < num_groups) & (local < limit.index_select(0, clamped))
    if src.shape[0] == 0 or num_dst_rows == 0:
        return src.new_zeros(num_dst_rows, src.shape[1])
    index = (src_starts.index_select(0, clamped) + local).clamp(0, src.shape[0] - 1)
    return src.index_select(0, index).masked_fill_(~valid.unsqueeze(1), 0)


@kernel
@triton.jit
def _relayout_kernel(src_ptr, dst_ptr, src_ends_ptr, dst_ends_ptr, R_dst, H, G,
                     stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    group = row_group(dst_ends_ptr, rows, G, BLOCK_G)
    g = tl.minimum(group, G - 1)
    dst_end = tl.load(dst_ends_ptr + g)
    dst_start = tl.load(dst_ends_ptr + g - 1, mask=g > 0, other=0)
    src_end = tl.load(src_ends_ptr + g)
    src_start = tl.load(src_ends_ptr + g - 1, mask=g > 0, other=0)
    local = rows - dst_start
    valid = (group < G) & (local < tl.minimum(dst_end - dst_start, src_end - src_start))
    src_rows = (src_start + local).to(tl.int64)
    col_mask = (cols < H)[None, :]
    values = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :],
                     mask=valid[:, None] & col_mask, other=0.0)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], values,
             mask=(rows < R_dst)[:, None] & col_mask)


def relayout(src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor,
             num_dst_rows: int) -> torch.Tensor:
    """``(R_src, H)`` in the source layout -> ``(num_dst_rows, H)`` in the destination one.

    ``src_ends`` / ``dst_ends``: ``(G,)`` cumulative group ends of each layout, on
    ``src``'s device, non-decreasing and within each tensor's rows.
    """
    if src.dim() == 2 and src.shape[1] == 0:  # no data to move (any row count)
        return src.new_empty(num_dst_rows, 0)
    G = dst_ends.shape[0]
    if (not use_triton(src) or src.dim() != 2 or src.stride(-1) != 1 or src.shape[0] == 0
            or num_dst_rows == 0 or G > 4096 or src.is_complex()):  # Triton has no complex
        return relayout_reference(src, src_ends, dst_ends, num_dst_rows)
    H = src.shape[1]
    dst = torch.empty(num_dst_rows, H, device=src.device, dtype=src.dtype)
    block_r, block_h = 16, min(256, next_power_of_2(max(H, 16)))
    grid = (cdiv(num_dst_rows, block_r), cdiv(H, block_h))
    _relayout_kernel[grid](src, dst, src_ends, dst_ends, num_dst_rows, H, G, src.stride(0),
                           dst.stride(0), BLOCK_R=block_r, BLOCK_H=block_h,
                           BLOCK_G=min(64, next_power_of_2(G)))
    return dst
