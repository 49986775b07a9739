"""Move rows between two layouts of the same groups, in one pass (padding and unpadding).

Both layouts hold ``G`` consecutive groups, given by ``(G,)`` non-decreasing cumulative
group ends; the ``i``-th row of group ``g`` in one pairs with the ``i``-th row of group
``g`` in the other while both groups have it. :func:`relayout` writes every row of the
destination exactly once: its partner row from the source, or zeros (padding rows,
rows past the last group). No separate zero fill, no host sync, deterministic.
"""

import torch

from ._triton import tl, triton, use_triton
from .bias import _row_group

__all__ = ["relayout", "relayout_reference", "gather_rows", "gather_rows_reference",
           "combine_rows", "combine_rows_reference"]


def _starts(ends: torch.Tensor) -> torch.Tensor:
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def relayout_reference(src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor,
                       num_dst_rows: int) -> torch.Tensor:
    """Plain-PyTorch :func:`relayout`: a searchsorted pairing, then a masked gather."""
    dst_ends, src_ends = dst_ends.to(torch.int64), src_ends.to(torch.int64)
    num_groups = dst_ends.shape[0]
    rows = torch.arange(num_dst_rows, device=src.device, dtype=torch.int64)
    dst_starts, src_starts = _starts(dst_ends), _starts(src_ends)
    group = torch.searchsorted(dst_ends, rows, right=True)
    clamped = group.clamp(max=num_groups - 1)
    local = rows - dst_starts.index_select(0, clamped)
    limit = torch.minimum(dst_ends - dst_starts, src_ends - src_starts)
    valid = (group < num_groups) & (local < limit.index_select(0, clamped))
    if src.shape[0] == 0 or num_dst_rows == 0:
        return src.new_zeros(num_dst_rows, src.shape[1])
    index = (src_starts.index_select(0, clamped) + local).clamp(0, src.shape[0] - 1)
    return src.index_select(0, index).masked_fill_(~valid.unsqueeze(1), 0)


@triton.jit
def _relayout_kernel(src_ptr, dst_ptr, src_ends_ptr, dst_ends_ptr, R_dst, H, G,
                     stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    group = _row_group(dst_ends_ptr, rows, G, BLOCK_G)
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
    G = dst_ends.shape[0]
    if (not use_triton(src) or src.dim() != 2 or src.stride(-1) != 1 or src.shape[0] == 0
            or num_dst_rows == 0 or G > 4096):
        return relayout_reference(src, src_ends, dst_ends, num_dst_rows)
    H = src.shape[1]
    dst = torch.empty(num_dst_rows, H, device=src.device, dtype=src.dtype)
    block_r, block_h = 16, min(256, triton.next_power_of_2(max(H, 16)))
    grid = (triton.cdiv(num_dst_rows, block_r), triton.cdiv(H, block_h))
    _relayout_kernel[grid](src, dst, src_ends, dst_ends, num_dst_rows, H, G, src.stride(0),
                           dst.stride(0), BLOCK_R=block_r, BLOCK_H=block_h,
                           BLOCK_G=min(64, triton.next_power_of_2(G)))
    return dst


# --------------------------------------------------------------------------- row gathers
def gather_rows_reference(src: torch.Tensor, index: torch.Tensor,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = scale[r] * src[index[r]]``, a zero row where ``index[r]`` is outside ``src``."""
    valid = (index >= 0) & (index < src.shape[0])
    if src.shape[0] == 0 or index.numel() == 0:
        return src.new_zeros(index.shape[0], *src.shape[1:])
    out = src.index_select(0, index.clamp(0, src.shape[0] - 1))
    out = out.masked_fill_(~valid.view(-1, *([1] * (src.dim() - 1))), 0)
    if scale is not None:
        out = (out.float() * scale.float().masked_fill(~valid, 0).unsqueeze(1)).to(src.dtype)
    return out


def combine_rows_reference(src: torch.Tensor, row_map: torch.Tensor,
                           weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[row_map[t, j]]`` in float32, over the slots whose
    row lies inside ``src``; output in ``src``'s dtype."""
    tokens, k = row_map.shape
    rows = gather_rows_reference(src, row_map.reshape(-1)).view(tokens, k, -1).float()
    if weights is not None:
        valid = (row_map >= 0) & (row_map < src.shape[0])
        rows = rows * weights.float().masked_fill(~valid, 0).unsqueeze(-1)
    return rows.sum(dim=1).to(src.dtype)


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, index_ptr, scale_ptr, R, R_src, H, stride_src,
                        stride_dst, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    index = tl.load(index_ptr + rows, mask=rows < R, other=-1).to(tl.int64)
    valid = (index >= 0) & (index < R_src)
    values = tl.load(src_ptr + index[:, None] * stride_src + cols[None, :],
                     mask=valid[:, None] & col_mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        values = values.to(tl.float32) * scale[:, None]
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :],
             values.to(dst_ptr.dtype.element_ty), mask=(rows < R)[:, None] & col_mask)


@triton.jit
def _combine_rows_kernel(src_ptr, dst_ptr, map_ptr, weights_ptr, T, K, R_src, H, stride_src,
                         stride_dst, HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    token_mask = tokens < T
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in range(0, K):  # fixed slot order: deterministic
        slot = tokens.to(tl.int64) * K + j
        row = tl.load(map_ptr + slot, mask=token_mask, other=-1).to(tl.int64)
        valid = (row >= 0) & (row < R_src)
        values = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :],
                         mask=valid[:, None] & col_mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        acc += values
    tl.store(dst_ptr + tokens.to(tl.int64)[:, None] * stride_dst + cols[None, :],
             acc.to(dst_ptr.dtype.element_ty), mask=token_mask[:, None] & col_mask)


def _rows_kernel_ok(src: torch.Tensor) -> bool:
    return (use_triton(src) and src.dim() == 2 and src.stride(-1) == 1
            and src.dtype != torch.float64 and src.shape[1] > 0)


def gather_rows(src: torch.Tensor, index: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(R_src, H)`` -> ``(R, H)``: row ``index[r]`` of ``src`` (times ``scale[r]``, in
    float32, when given), zeros where the index is outside ``src`` (-1 for "none").
    One read of the gathered rows, one write."""
    if (not _rows_kernel_ok(src) or index.numel() == 0 or src.shape[0] == 0
            or (scale is not None and scale.dtype == torch.float64)):
        return gather_rows_reference(src, index, scale)
    R, H = index.shape[0], src.shape[1]
    # The CPU interpreter truncates float32 -> bf16: with a scale, torch does the rounding.
    out_dtype = torch.float32 if scale is not None and src.device.type == "cpu" else src.dtype
    out = torch.empty(R, H, device=src.device, dtype=out_dtype)
    block_r, block_h = 16, min(256, triton.next_power_of_2(H))
    _gather_rows_kernel[(triton.cdiv(R, block_r), triton.cdiv(H, block_h))](
        src, out, index.contiguous(), scale.contiguous() if scale is not None else src, R,
        src.shape[0], H, src.stride(0), out.stride(0), HAS_SCALE=scale is not None,
        BLOCK_R=block_r, BLOCK_H=block_h)
    return out.to(src.dtype)


def combine_rows(src: torch.Tensor, row_map: torch.Tensor,
                 weights: torch.Tensor | None) -> torch.Tensor:
    """``(R_src, H)`` -> ``(T, H)``: ``sum_j weights[t, j] * src[row_map[t, j]]`` over the
    slots whose row lies in ``src``, accumulated in float32 in slot order. One read of
    the routed rows, one write."""
    tokens, k = row_map.shape
    if not _rows_kernel_ok(src) or tokens == 0 or k == 0 or src.shape[0] == 0 or (
            weights is not None and weights.dtype == torch.float64):
        return combine_rows_reference(src, row_map, weights)
    H = src.shape[1]
    # Triton 3.6's CPU interpreter truncates float32 -> bf16 instead of rounding: there the
    # kernel writes float32 and torch rounds.
    out_dtype = torch.float32 if src.device.type == "cpu" else src.dtype
    out = torch.empty(tokens, H, device=src.device, dtype=out_dtype)
    block_t, block_h = 16, min(256, triton.next_power_of_2(H))
    _combine_rows_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(H, block_h))](
        src, out, row_map.contiguous(), weights.contiguous() if weights is not None else src,
        tokens, k, src.shape[0], H, src.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_T=block_t, BLOCK_H=block_h)
    return out.to(src.dtype)
