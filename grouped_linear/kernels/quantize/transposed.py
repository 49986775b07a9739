"""FP8 quantization into transposed copies: the weight-gradient GEMM's operands.

:func:`quantize_group_columns_t`: ``(M, C)`` rows split into groups -> FP8 ``(C, M')``,
transposed, one scale per (group, column) along the group's rows (or one per group), each
group optionally starting on an aligned column. Tiles of ``BLOCK_R`` destination columns
are numbered slot after slot (:func:`_column_tile`: each group's rows and alignment
padding, then the tail), so every tile is in flight at once whatever the group sizes. Two
launches: the column maxima over row tiles with atomic maxima
(:func:`_group_column_amax_kernel`, optionally the per-group column sums too), then one
quantize-and-transpose kernel over the same tiles (:func:`_quantize_columns_t_tiled_kernel`),
which derives the scales and writes the factors itself. Given per-group scales, or FP8
codes to move unchanged (:func:`transpose_group_columns`), only the second. (One program per
group and column block walking the group's rows twice ran at 0.28-0.31 of copy bandwidth
on dsv3_ep32_fc1's ``x`` and ``dy`` on the H200, these tiles at 0.37-0.40.) On sm90 the
second pass of the weight gradient's layout (groups on 128-column boundaries) is
:mod:`~grouped_linear.kernels.quantize.transposed_gluon`'s, same output.

The plain-PyTorch reference is :func:`quantize_group_columns_t_reference`; scales follow
:func:`grouped_linear.kernels.quantize.common.scale_from_amax`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._groups import row_groups
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from ..bias import bias_grad
from ..ends import aligned_ends
from . import transposed_gluon
from .common import (
    amax_to_scale,
    clamp_keeping_nan,
    finish,
    fold_row_factors,
    fp8_buffer,
    group_amax,
    piece_shift,
    piece_shifts,
    scale_from_amax,
)

__all__ = ["quantize_group_columns_t", "quantize_group_columns_t_reference",
           "quantize_group_columns_t_pieces", "transpose_group_columns", "quantize_columns_t",
           "fold_row_factors", "TiledConfig", "TILED_CONFIG"]


class TiledConfig(NamedTuple):
    """Launch shape of both kernels: destination columns (source rows) and source columns
    per tile, warps, and row tiles per program of the column-amax pass."""

    block_r: int
    block_c: int
    warps: int
    amax_sub_tiles: int = 2


# benchmarks/fp8_quantize.py times the alternatives on the H200.
TILED_CONFIG = TiledConfig(128, 64, 4, amax_sub_tiles=2)


def quantize_group_columns_t_reference(t: torch.Tensor, ends: torch.Tensor,
                                       fp8_dtype: torch.dtype, power_of_two: bool,
                                       group_scale: torch.Tensor | None = None,
                                       row_factors: torch.Tensor | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` -> FP8 transpose ``(C, M)`` scaled per (group, column) along the group's
    rows (or per group), and ``(G, C)`` float32 dequantization factors; rows past the
    last group are 0. ``row_factors`` ``(M,)``: quantize ``t`` with row ``m`` multiplied by
    ``row_factors[m]`` (:func:`fold_row_factors`)."""
    if row_factors is not None:
        t = fold_row_factors(t, row_factors)
    if group_scale is None:
        scale = scale_from_amax(group_amax(t, ends), fp8_dtype, power_of_two)
    else:
        scale = group_scale[:, None].expand(ends.shape[0], t.shape[1]).contiguous()
    groups = row_groups(ends, t.shape[0])
    per_row = torch.cat([scale, torch.ones_like(scale[:1])]).index_select(0, groups)
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = (t.float() * per_row).clamp(-fp8_max, fp8_max)
    data = scaled.masked_fill((groups == ends.shape[0]).unsqueeze(1), 0.0).to(fp8_dtype)
    return data.t().contiguous(), 1.0 / scale


def _aligned_width(rows: int, groups: int, align: int) -> int:
    """Columns of the transposed wgrad operand: ``rows``, or with ``align > 1`` room for
    every group's alignment padding, rounded up to 16 (FP8 GEMMs need 16-element rows)."""
    return -(-(rows + (align - 1) * groups) // 16) * 16 if align > 1 else rows


def _transposed_buffer(C: int, M: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Where the kernels write an FP8 ``(C, M)`` operand: on GPUs its row stride is ``M``
    rounded up to 16 elements (FP8 GEMMs need 16-byte aligned leading dimensions; the extra
    columns are never read); on CPUs float32 (see
    :func:`~grouped_linear.kernels.quantize.common.fp8_buffer`)."""
    if device.type == "cpu":
        return fp8_buffer((C, M), device, dtype)
    return torch.empty(C, -(-M // 16) * 16, device=device, dtype=dtype)[:, :M]


@triton.jit
def _fold(values, factors_ptr, row0, rows, left):
    """``values[r, :] * factors[row0 + r]`` for the tile's first ``left`` rows, saturated at
    float32's range (as :func:`fold_row_factors`)."""
    factors = tl.load(factors_ptr + row0 + rows, mask=rows < left, other=0.0)
    return clamp_keeping_nan(values * factors[:, None], 3.4028234663852886e38)


@triton.jit
def _column_tile(tile, ends_ptr, dst_ends_ptr, G, width, ALIGN: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tile ``tile`` of the transposed layout, tiles numbered slot after slot: slot ``g < G``
    covers group ``g``'s destination columns (its rows, then its alignment padding), slot
    ``G`` the columns past the last group up to ``width``. Returns the slot, the tile's
    first source row and the group's end row, the tile's first destination column, the
    slot's destination end and the number of tiles."""
    slots = tl.arange(0, BLOCK_S)  # BLOCK_S > G
    ends = tl.load(ends_ptr + slots, mask=slots < G, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + slots - 1, mask=(slots > 0) & (slots < G), other=0).to(tl.int64)
    dst_starts = tl.load(dst_ends_ptr + slots - 1, mask=(slots > 0) & (slots <= G),
                         other=0).to(tl.int64)
    lengths = tl.where(slots < G, (ends - starts + ALIGN - 1) // ALIGN * ALIGN,
                       tl.where(slots == G, tl.maximum(width - dst_starts, 0), 0))
    tiles = (lengths + BLOCK_R - 1) // BLOCK_R
    tile_end = tl.cumsum(tiles, axis=0)
    owner = (tile_end - tiles <= tile) & (tile < tile_end)
    local = tile - tl.sum(tl.where(owner, tile_end - tiles, 0), axis=0)
    g = tl.sum(tl.where(owner, slots, 0), axis=0)
    src0 = tl.sum(tl.where(owner, starts, 0), axis=0) + local * BLOCK_R
    end = tl.sum(tl.where(owner, ends, 0), axis=0)
    dst_start = tl.sum(tl.where(owner, dst_starts, 0), axis=0)
    dst_end = dst_start + tl.sum(tl.where(owner, lengths, 0), axis=0)
    return g, src0, end, dst_start + local * BLOCK_R, dst_end, tl.sum(tiles, axis=0)


@kernel
@triton.jit
def _group_column_amax_kernel(t_ptr, ends_ptr, amax_ptr, sums_ptr, shifts_ptr, factors_ptr,
                              M, C, G, stride_t, SUMS: tl.constexpr, PIECES: tl.constexpr,
                              FACTORS: tl.constexpr, SHIFT_MULTIPLE: tl.constexpr,
                              BLOCK_R: tl.constexpr, SUB_TILES: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """``amax[g, c] = max |t[r, c]|`` over the rows ``r`` of group ``g`` (``amax`` starts at
    0): ``SUB_TILES`` tiles of ``BLOCK_R`` rows of one group per program, then one atomic
    max per column. ``SUMS``: also the program's float32 column sums, at row ``program``
    of ``sums`` ``(programs, C)`` (summed per group, in order, by the reduce kernel).
    ``PIECES``: ``t`` is the first of a list of pieces read as one tensor (see
    :func:`~grouped_linear.kernels.quantize.common.piece_shift`). ``FACTORS``: the maxima are of
    ``t[r, c] * factors[r]`` (:func:`fold_row_factors`); the sums stay of
    ``t``."""
    g, src0, end, _, _, total = _column_tile(tl.program_id(0), ends_ptr, ends_ptr, G, 0,
                                             1, BLOCK_R * SUB_TILES, BLOCK_S)
    if (tl.program_id(0) < total) & (g < G):
        rows = tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        left = (end - src0).to(tl.int32)
        running = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        total_sum = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        row_base = src0 * stride_t
        if PIECES:
            row_base += piece_shift(shifts_ptr, g, SHIFT_MULTIPLE)
        for i in tl.static_range(SUB_TILES):
            values = tl.load(t_ptr + row_base + ((rows[:, None] + i * BLOCK_R) * stride_t
                                                 + cols[None, :]),
                             mask=(rows < left - i * BLOCK_R)[:, None] & col_mask[None, :],
                             other=0.0).to(tl.float32)
            if SUMS:
                total_sum += values
            if FACTORS:
                values = _fold(values, factors_ptr, src0 + i * BLOCK_R, rows, left - i * BLOCK_R)
            running = tl.maximum(running, tl.abs(values))
        group_max = tl.max(running, axis=0)
        tl.atomic_max(amax_ptr + g.to(tl.int64) * C + cols, group_max, mask=col_mask)
        if SUMS:
            tl.store(sums_ptr + tl.program_id(0).to(tl.int64) * C + cols, tl.sum(total_sum, axis=0),
                     mask=col_mask)


@kernel
@triton.jit
def _reduce_group_sums_kernel(sums_ptr, ends_ptr, out_ptr, C, G, ROWS_PER_TILE: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """``out[g, c]``: the partial sums of group ``g``'s column-amax programs, added in
    program order (deterministic)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slots = tl.arange(0, BLOCK_S)
    ends = tl.load(ends_ptr + slots, mask=slots < G, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + slots - 1, mask=(slots > 0) & (slots < G), other=0).to(tl.int64)
    tiles = tl.where(slots < G, (ends - starts + ROWS_PER_TILE - 1) // ROWS_PER_TILE, 0)
    first = tl.sum(tl.where(slots == g, tl.cumsum(tiles, axis=0) - tiles, 0), axis=0)
    count = tl.sum(tl.where(slots == g, tiles, 0), axis=0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, count):
        acc += tl.load(sums_ptr + (first + i) * C + cols, mask=cols < C, other=0.0)
    tl.store(out_ptr + g.to(tl.int64) * C + cols, acc, mask=cols < C)


@kernel
@triton.jit
def _quantize_columns_t_tiled_kernel(t_ptr, ends_ptr, dst_ends_ptr, scale_ptr, inv_ptr,
                                     q_ptr, shifts_ptr, factors_ptr, C, G, stride_t, stride_q,
                                     width, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                                     SCALING: tl.constexpr,
                                     PIECES: tl.constexpr, FACTORS: tl.constexpr,
                                     SHIFT_MULTIPLE: tl.constexpr,
                                     ALIGN: tl.constexpr,
                                     DST_MULTIPLE: tl.constexpr, BLOCK_R: tl.constexpr,
                                     BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """One tile of destination columns (row ``r`` of group ``g`` lands at column
    ``dst_start_g + r - start_g`` of ``q``, row ``c`` = the source column): scaled by the
    group's (column) scales and stored transposed; the group's alignment padding and the
    columns past the last group are written as zeros by the tiles that cover them.
    ``DST_MULTIPLE``: every tile's first destination column is a multiple of it (16 lets
    the transposed stores be 16-byte vectors). ``FACTORS``: row ``r`` is multiplied by
    ``factors[r]`` first (:func:`fold_row_factors`).

    ``SCALING``: ``"amax"`` (``scale_ptr`` holds the ``(G, C)`` column maxima, the scales
    are derived here), ``"group"`` (``(G,)`` scales) or ``"unit"`` (FP8 codes copied
    unchanged).
    Besides its tile, program ``g < G`` writes group ``g``'s ``(C,)`` dequantization factors
    (``1 / scale``) into ``inv``, empty groups included (the grid has more than ``G``
    programs); ``"unit"`` writes none."""
    if SCALING != "unit":
        inv_group = tl.program_id(0).to(tl.int64)
        if inv_group < G:
            inv_cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            if SCALING == "group":
                inv_scale = tl.zeros([BLOCK_C], dtype=tl.float32) + tl.load(scale_ptr + inv_group)
            else:
                inv_scale = amax_to_scale(tl.load(scale_ptr + inv_group * C + inv_cols,
                                                  mask=inv_cols < C, other=0.0), FP8_MAX, POW2)
            tl.store(inv_ptr + inv_group * C + inv_cols, 1.0 / inv_scale, mask=inv_cols < C)
    g, src0, end, dst0, dst_end, total = _column_tile(tl.program_id(0), ends_ptr,
                                                      dst_ends_ptr, G, width, ALIGN, BLOCK_R,
                                                      BLOCK_S)
    if tl.program_id(0) < total:
        rows = tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        row_mask = (rows < (end - src0).to(tl.int32)) & (g < G)
        clamped = tl.minimum(g, G - 1)
        row_base = src0 * stride_t
        if PIECES:  # a list read as one tensor (common.piece_shift)
            row_base += piece_shift(shifts_ptr, clamped, SHIFT_MULTIPLE)
        values = tl.load(t_ptr + row_base + (rows[:, None] * stride_t + cols[None, :]),
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        if FACTORS:  # rows of no group are masked off: their factor is never read
            values = _fold(values.to(tl.float32), factors_ptr, src0, rows,
                           tl.where(g < G, end - src0, 0).to(tl.int32))
        if SCALING == "unit":  # FP8 codes in, the same codes out
            scaled = values
        else:
            if SCALING == "group":
                scaled = values.to(tl.float32) * tl.load(scale_ptr + clamped)
            else:
                amax = tl.load(scale_ptr + clamped.to(tl.int64) * C + cols, mask=col_mask, other=0.0)
                scaled = values.to(tl.float32) * amax_to_scale(amax, FP8_MAX, POW2)[None, :]
            scaled = clamp_keeping_nan(scaled, FP8_MAX)
        # No-ops that tell the compiler what DST_MULTIPLE promises (the tile's start and the
        # columns left in its slot are multiples of it), so the stores can be vectors.
        dst0 = dst0 // DST_MULTIPLE * DST_MULTIPLE
        left = (dst_end - dst0).to(tl.int32) // DST_MULTIPLE * DST_MULTIPLE
        out = q_ptr + dst0 + (cols.to(tl.int64)[None, :] * stride_q + rows[:, None])
        tl.store(out, scaled.to(q_ptr.dtype.element_ty),
                 mask=(rows < left)[:, None] & col_mask[None, :])


def quantize_columns_t(t, ends, data_ends, data, fp8_dtype, power_of_two, group_scale,
                       align, stride_q=None, width=None, dst_multiple=1, sums=None, shifts=None,
                       num_rows=None, row_factors=None, unit_scale=False,
                       config: TiledConfig = TILED_CONFIG):
    """Group ``g``'s row ``r`` lands at ``data_flat[c * stride_q + data_ends[g-1] + r -
    start_g]``, followed by zeros up to ``round_up(size_g, align)`` columns; columns from
    ``data_ends[-1]`` to ``width`` are zeros (``stride_q``/``width`` default to
    ``data``'s 2-D row stride and width). ``dst_multiple``: 16 when every ``data_ends``
    entry is a multiple of 16 (the transposed stores are then 16-byte vectors). ``sums``:
    a ``(G, C)`` float32 tensor that receives the per-group column sums of ``t`` (computed
    by the column-amax pass; needs ``group_scale=None``). ``shifts``: a
    :class:`~grouped_linear.kernels.quantize.common.PieceShifts`; ``t`` is then the first of the
    pieces and ``num_rows`` their total rows. ``row_factors``: ``(M,)`` float32 multipliers
    of the rows (not with ``shifts``); ``sums`` stay those of ``t``. ``unit_scale``: ``t``
    holds FP8 codes that are moved unchanged (no factors returned: ``None``). ``config``: the
    launch shape. Returns the ``(G, C)`` float32 dequantization factors, written by the
    quantizing kernel itself."""
    M, C = t.shape
    M = M if num_rows is None else num_rows
    shift_args = (shifts.shifts, True, shifts.multiple) if shifts is not None else (t, False, 1)
    stride_q = data.stride(0) if stride_q is None else stride_q
    width = data.shape[1] if width is None else width
    G = ends.shape[0]
    factors = row_factors.float().contiguous() if row_factors is not None else ends
    block_r, block_c, warps, sub_tiles = TiledConfig(*config)
    block_s = max(2, next_power_of_2(G + 1))
    # tiles cover the groups' padded columns and the tail: min(width, that) columns at most;
    # the G + 1 extra programs leave room for the slots' partial tiles (and for one program
    # per group writing the group's factors)
    covered = min(width, M + (align - 1) * G + 16)
    grid = (cdiv(covered, block_r) + G + 1, cdiv(C, block_c))
    inv = None if unit_scale else torch.empty(G, C, device=t.device, dtype=torch.float32)
    if unit_scale:
        scaling, scale = "unit", ends
    elif group_scale is None:
        scaling = "amax"
        scale = torch.zeros(G, C, device=t.device, dtype=torch.float32)  # the column maxima
        amax_grid = (cdiv(M, block_r * sub_tiles) + G + 1, grid[1])
        partial = torch.empty(amax_grid[0], C, device=t.device, dtype=torch.float32) \
            if sums is not None else scale
        _group_column_amax_kernel[amax_grid](
            t, ends, scale, partial, shift_args[0], factors, M, C, G, t.stride(0),
            SUMS=sums is not None, PIECES=shift_args[1], FACTORS=row_factors is not None,
            SHIFT_MULTIPLE=shift_args[2], BLOCK_R=block_r,
            SUB_TILES=sub_tiles, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=warps)
        if sums is not None:
            _reduce_group_sums_kernel[(G, cdiv(C, 256))](
                partial, ends, sums, C, G, ROWS_PER_TILE=block_r * sub_tiles,
                BLOCK_C=256, BLOCK_S=block_s)
    else:
        scaling = "group"
        scale = group_scale if group_scale.dtype == torch.float32 and group_scale.is_contiguous() \
            else group_scale.float().contiguous()
    if (shifts is None and stride_q == data.stride(0) and width == data.shape[1]
            and transposed_gluon.supported(t, data, align, G)):  # sm90: tiles staged by TMA
        transposed_gluon.write_columns_t(t, ends, data, scaling, scale, inv,
                                         factors if row_factors is not None else None,
                                         fp8_dtype, power_of_two)
        return inv
    _quantize_columns_t_tiled_kernel[grid](
        t, ends, data_ends, scale, inv if inv is not None else scale, data, shift_args[0],
        factors, C, G, t.stride(0), stride_q, width, FP8_MAX=torch.finfo(fp8_dtype).max,
        POW2=power_of_two, SCALING=scaling, PIECES=shift_args[1],
        FACTORS=row_factors is not None, SHIFT_MULTIPLE=shift_args[2], ALIGN=align,
        DST_MULTIPLE=16 if dst_multiple % 16 == 0 and block_r % 16 == 0 else 1, BLOCK_R=block_r,
        BLOCK_C=block_c, BLOCK_S=block_s, num_warps=warps,
    )
    return inv


def quantize_group_columns_t(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                             power_of_two: bool, group_scale: torch.Tensor | None = None,
                             align: int = 1, column_sums: torch.Tensor | None = None,
                             row_factors: torch.Tensor | None = None,
                             data_ends: torch.Tensor | None = None,
                             config: TiledConfig = TILED_CONFIG
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The wgrad operand: ``(M, C)`` -> FP8 transposed, scaled per (group, column) along
    the group's rows (or per group with ``group_scale`` ``(G,)`` float32).

    Returns ``(data, inv, data_ends)``. With ``align=1``: ``data`` ``(C, M)``,
    ``data_ends`` is ``ends`` and columns past ``ends[-1]`` are 0. With
    ``align > 1``: every group starts at a multiple of ``align`` columns, zero-padded
    up to the next (``data_ends`` = :func:`~grouped_linear.kernels.ends.aligned_ends`),
    ``data`` has ``M + (align - 1) * G`` columns rounded up to a multiple of 16 (FP8
    GEMMs need 16-element rows), those past ``data_ends[-1]`` unspecified. On GPUs
    the row stride is a multiple of 16. ``inv`` is ``(G, C)``.

    ``column_sums``: an optional ``(G, C)`` float32 tensor filled with the per-group column
    sums of ``t`` (a bias gradient), from the same read of ``t`` where the kernels allow
    it, else by :func:`grouped_linear.kernels.bias.bias_grad`.

    ``row_factors``: an optional ``(M,)`` float tensor; what is quantized is then ``t`` with
    row ``m`` multiplied by ``row_factors[m]`` (:func:`fold_row_factors`; the column sums
    stay those of ``t`` itself). The weight gradient folds the forward's per-token factors
    of ``x`` into ``dy`` this way.

    ``data_ends``: the aligned group ends when the caller already has them (from an
    earlier call with the same ``ends`` and ``align``). ``config``: the launch shape.
    """
    M, C = t.shape
    G = ends.shape[0]
    if data_ends is None:
        data_ends = ends if align == 1 else aligned_ends(ends, align)
    width = _aligned_width(M, G, align)
    kernels = use_triton(t) and t.stride(-1) == 1 and t.shape[0] > 0
    fused_sums = column_sums if kernels and group_scale is None else None
    if column_sums is not None and fused_sums is None:  # no column-amax pass to share
        column_sums.copy_(bias_grad(t, ends, torch.float32))
    if not kernels:
        if row_factors is not None:
            t = fold_row_factors(t, row_factors)
        data, inv = quantize_group_columns_t_reference(t, ends, fp8_dtype, power_of_two,
                                                       group_scale)
        if align > 1:
            data = _realign_columns(data, ends, data_ends, width)
        return data, inv, data_ends
    data = _transposed_buffer(C, width, t.device, fp8_dtype)
    inv = quantize_columns_t(t, ends, data_ends, data, fp8_dtype, power_of_two, group_scale,
                             align, dst_multiple=align, sums=fused_sums, row_factors=row_factors,
                             config=config)
    return finish(data, fp8_dtype), inv, data_ends


def transpose_group_columns(codes: torch.Tensor, ends: torch.Tensor, align: int = 1,
                            data_ends: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 codes ``(M, C)`` moved unchanged into the transposed layout of
    :func:`quantize_group_columns_t` with the same ``align`` (and ``data_ends``, computed
    when not given): ``(C, width)``, zeros in the alignment and tail columns. The wgrad
    operand of a tensor already quantized per token whose factors were moved onto the other
    operand; one launch on GPUs, no factors."""
    M, C = codes.shape
    G = ends.shape[0]
    if data_ends is None:
        data_ends = ends if align == 1 else aligned_ends(ends, align)
    if not (use_triton(codes) and codes.stride(-1) == 1 and M > 0):
        ones = torch.ones(G, device=codes.device)
        data, _ = quantize_group_columns_t_reference(codes, ends, codes.dtype, False, ones)
        return _realign_columns(data, ends, data_ends, _aligned_width(M, G, align)) \
            if align > 1 else data
    data = _transposed_buffer(C, _aligned_width(M, G, align), codes.device, codes.dtype)
    quantize_columns_t(codes, ends, data_ends, data, codes.dtype, False, None,
                       align, dst_multiple=align, unit_scale=True)
    return finish(data, codes.dtype)


def quantize_group_columns_t_pieces(pieces: list[torch.Tensor], fp8_dtype: torch.dtype,
                                    power_of_two: bool, group_scale: torch.Tensor | None = None,
                                    align: int = 16, width: int | None = None,
                                    ends: torch.Tensor | None = None,
                                    config: TiledConfig = TILED_CONFIG
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_group_columns_t` of ``torch.cat(pieces)`` with ``align`` (one group
    per piece) without the concatenation: each ``(m_g, C)`` piece is quantized straight into
    its aligned columns of one transposed FP8 buffer. Returns ``(data, inv)``: ``data``
    ``(C, width)`` (``width`` defaults to the one :func:`quantize_group_columns_t` uses),
    group ``g`` at columns from ``sum_{h<g} round_up(m_h, align)``, zero-padded to
    ``round_up(m_g, align)``; ``inv`` ``(G, C)``. ``ends``: the pieces' ``(G,)`` int32
    row ends already on the device, so nothing is copied from the host per call (a
    host-to-device copy waits for the queued GPU work). ``config``: the launch shape."""
    sizes = [piece.shape[0] for piece in pieces]
    G, C = len(pieces), pieces[0].shape[1]
    device = pieces[0].device
    rows = sum(sizes)
    if width is None:
        width = _aligned_width(rows, G, align)
    padded = [-(-size // align) * align for size in sizes]
    if ends is None:
        ends = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    if not use_triton(pieces[0]) or any(piece.stride(-1) != 1 for piece in pieces):
        data, inv, _ = quantize_group_columns_t(torch.cat(pieces), ends, fp8_dtype,
                                                power_of_two, group_scale, align, config=config)
        if data.shape[1] < width:
            data = torch.cat([data, data.new_zeros(C, width - data.shape[1])], dim=1)
        return data[:, :width], inv
    data = _transposed_buffer(C, width, device, fp8_dtype)
    shifts = piece_shifts(pieces) if rows else None
    if shifts is not None:  # one launch per pass over all the pieces
        data_ends = aligned_ends(ends, align) if align > 1 else ends
        inv = quantize_columns_t(
            shifts.base, ends, data_ends, data, fp8_dtype, power_of_two, group_scale, align,
            width=width, dst_multiple=align, shifts=shifts, num_rows=rows, config=config)
        return finish(data, fp8_dtype), inv
    group_sizes = torch.diff(ends.to(torch.int32), prepend=ends.new_zeros(1, dtype=torch.int32))
    padded_sizes = (group_sizes + (align - 1)) // align * align
    invs, start = [], 0
    for g, piece in enumerate(pieces):
        one_group, one_padded = group_sizes[g:g + 1], padded_sizes[g:g + 1]
        scale = group_scale[g:g + 1] if group_scale is not None else None
        if sizes[g] == 0:  # nothing to write; the factors of an empty group
            invs.append(quantize_group_columns_t_reference(piece, one_group, fp8_dtype,
                                                           power_of_two, scale)[1])
            continue
        # The piece's columns as a view: its group starts at column 0 of it.
        view = data[:, start:start + padded[g]]
        invs.append(quantize_columns_t(
            piece, one_group, one_padded, view, fp8_dtype, power_of_two, scale, align,
            stride_q=data.stride(0), width=padded[g],
            dst_multiple=align if start % 16 == 0 else 1, config=config))
        start += padded[g]
    if start < width:
        data[:, start:].zero_()
    return finish(data, fp8_dtype), torch.cat(invs)


def _realign_columns(data: torch.Tensor, ends: torch.Tensor, data_ends: torch.Tensor,
                     width: int) -> torch.Tensor:
    """Reference of the aligned layout: each group's columns moved to its aligned start."""
    out = torch.zeros(data.shape[0], width, dtype=data.dtype, device=data.device)
    row_ends, column_ends = ends.tolist(), data_ends.tolist()
    for g, end in enumerate(row_ends):
        start = row_ends[g - 1] if g else 0
        aligned_start = column_ends[g - 1] if g else 0
        out[:, aligned_start:aligned_start + end - start] = data[:, start:end]
    return out
