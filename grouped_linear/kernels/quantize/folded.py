"""Per-row FP8 quantization of ``t * factors[group of the row]``: the Float8Rowwise dgrad's
gradient operand.

The dgrad GEMM reuses the forward's FP8 weight, scaled per output channel ``n``; ``n`` is
the dgrad's reduced dimension, so the weight's factors cannot stay on the weight: they
multiply the output gradient's columns instead (row ``r`` of group ``g`` times
``factors[g]``), and the product is quantized per row as usual. One program walks a run of
consecutive rows, finds their groups from the group ends, keeps the group's factor row in
registers while the group stays the same, and reads each gradient row once (the whole row
is one block; a wider row is read twice, in blocks). The plain-PyTorch reference is
:func:`quantize_rows_folded_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._groups import row_group, row_groups
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .common import amax_to_scale, clamp_keeping_nan, finish, fp8_buffer, inverse
from .rows import quantize_rows_reference

__all__ = ["ColumnFactors", "quantize_rows_folded", "quantize_rows_folded_reference",
           "scale_columns", "scale_columns_reference"]

# Launch shape: (rows per program, columns per warp); rows up to MAX_BLOCK_C wide take the
# kernel. H200, dsv3_ep32_fc1's gradient (65536 x 4096): 0.213 ms for 16 rows on 4 warps
# (0.88 of copy; the plain rows kernel 0.192), 0.219-0.238 ms for 8-32 rows on 8 warps.
FOLDED_CONFIG = (16, 1024)
MAX_BLOCK_C = 16384
# Wider rows (Mixtral's fc1 gradient: 28672 columns) go in blocks of this many columns, read
# twice: the amax pass, then the scaling pass from L2.
WIDE_BLOCK_C = 8192


@dataclass(frozen=True)
class ColumnFactors:
    """Per-(group, column) factors for the rows of an ``(R, C)`` tensor: ``factors``
    ``(G, C)`` float32, ``ends`` ``(G,)`` the groups' cumulative row ends (rows after the
    last group count as the last group's) and ``num_rows`` ``R``."""

    factors: torch.Tensor
    ends: torch.Tensor
    num_rows: int

    @staticmethod
    def of_groups(factors: torch.Tensor, ends: torch.Tensor, num_rows: int) -> ColumnFactors:
        """The factors of the row groups ending at ``ends`` ``(G,)``."""
        return ColumnFactors(factors.float().contiguous(), ends, num_rows)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """``t * factors[group of each row]`` in float32."""
        groups = row_groups(self.ends, self.num_rows).clamp(max=self.factors.shape[0] - 1)
        return t.float() * self.factors.index_select(0, groups)


def quantize_rows_folded_reference(t: torch.Tensor, column_factors: ColumnFactors,
                                   fp8_dtype: torch.dtype, power_of_two: bool
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)`` of ``t * factors`` per row, and ``(R,)`` factors."""
    return quantize_rows_reference(column_factors.apply(t), fp8_dtype, power_of_two)


@triton.jit
def _folded_block(t_ptr, factors_ptr, row, group, cols, live, C, stride_t):
    """Columns ``cols`` of row ``row`` times its group's factors, in float32."""
    mask = (cols < C) & live
    values = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    return values * tl.load(factors_ptr + group * C + cols, mask=mask, other=0.0)


@kernel
@triton.jit
def _quantize_rows_folded_kernel(t_ptr, factors_ptr, ends_ptr, q_ptr, inv_ptr, R, C, G,
                                 stride_t, stride_q, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                                 ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                                 BLOCK_G: tl.constexpr, WIDE: tl.constexpr = False):
    """Rows ``[program * ROWS, program * ROWS + ROWS)``, each one block of ``BLOCK_C >= C``
    (``WIDE``: several blocks, read twice); the rows' groups are found from the ends, once
    for the whole run."""
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < C
    first = tl.program_id(0).to(tl.int64) * ROWS
    slots = tl.arange(0, ROWS)
    groups = tl.minimum(row_group(ends_ptr, first + slots, G, BLOCK_G), G - 1)
    held = tl.min(groups, axis=0)  # the run's first row's group (groups never decrease)
    factors = tl.load(factors_ptr + held * C + cols, mask=col_mask, other=0.0)
    for i in range(ROWS):
        row = first + i
        live = row < R
        group = tl.sum(tl.where(slots == i, groups, 0), axis=0)
        if WIDE:  # the row in blocks: its amax, then the blocks again (from L2), scaled
            amax = tl.zeros([BLOCK_C], tl.float32)
            for c0 in range(0, C, BLOCK_C):
                values = _folded_block(t_ptr, factors_ptr, row, group, c0 + cols, live, C,
                                       stride_t)
                amax = tl.maximum(amax, tl.abs(values))
            scale = amax_to_scale(tl.max(amax, axis=0), FP8_MAX, POW2)
            for c0 in range(0, C, BLOCK_C):
                values = _folded_block(t_ptr, factors_ptr, row, group, c0 + cols, live, C,
                                       stride_t)
                scaled = clamp_keeping_nan(values * scale, FP8_MAX)
                tl.store(q_ptr + row * stride_q + c0 + cols, scaled.to(q_ptr.dtype.element_ty),
                         mask=(c0 + cols < C) & live)
        else:
            if group != held:  # a group boundary inside the run: fetch its factors
                held = group
                factors = tl.load(factors_ptr + group * C + cols, mask=col_mask, other=0.0)
            mask = col_mask & live
            values = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
            values *= factors
            scale = amax_to_scale(tl.max(tl.abs(values), axis=0), FP8_MAX, POW2)
            scaled = clamp_keeping_nan(values * scale, FP8_MAX)
            tl.store(q_ptr + row * stride_q + cols, scaled.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(inv_ptr + row, inverse(scale), mask=live)


def quantize_rows_folded(t: torch.Tensor, column_factors: ColumnFactors, fp8_dtype: torch.dtype,
                         power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)``: row ``r`` of group ``g`` is ``t[r] * factors[g]``,
    scaled by its own amax; and the ``(R,)`` float32 dequantization factors. One read of
    ``t`` on GPUs for rows of up to ``MAX_BLOCK_C`` columns, two (the second mostly from
    L2) beyond."""
    R, C = t.shape
    factors = column_factors.factors
    if factors.dim() != 2 or factors.shape[1] != C or factors.shape[0] == 0:
        raise ValueError(f"column factors of shape {tuple(factors.shape)} do not fit rows of {C} "
                         "columns: expected (G, C) with G >= 1")
    if column_factors.num_rows != R:
        raise ValueError(f"column factors for num_rows={column_factors.num_rows} do not fit "
                         f"a tensor of {R} rows")
    if column_factors.ends.shape != (factors.shape[0],):
        raise ValueError(f"ends has shape {tuple(column_factors.ends.shape)}, expected "
                         f"({factors.shape[0]},): one row end per factor row")
    block_c = next_power_of_2(max(C, 16))
    if not use_triton(t) or t.stride(-1) != 1 or R == 0:
        return quantize_rows_folded_reference(t, column_factors, fp8_dtype, power_of_two)
    data = fp8_buffer((R, C), t.device, fp8_dtype)
    inv = torch.empty(R, device=t.device, dtype=torch.float32)
    rows, columns_per_warp = FOLDED_CONFIG
    wide = block_c > MAX_BLOCK_C
    if wide:
        block_c = WIDE_BLOCK_C
    warps = min(16, max(2, block_c // columns_per_warp))
    _quantize_rows_folded_kernel[(cdiv(R, rows),)](
        t, factors, column_factors.ends, data, inv, R, C, factors.shape[0], t.stride(0),
        data.stride(0), FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, ROWS=rows,
        BLOCK_C=block_c, BLOCK_G=min(256, next_power_of_2(factors.shape[0])), WIDE=wide,
        num_warps=warps,
    )
    return finish(data, fp8_dtype), inv


def scale_columns_reference(t: torch.Tensor, scale: torch.Tensor, group_rows: int,
                            fp8_dtype: torch.dtype) -> torch.Tensor:
    """``(R, C)`` -> FP8 of ``t * scale[r // group_rows]``, saturated (``scale`` ``(G, C)``)."""
    fp8_max = torch.finfo(fp8_dtype).max
    factors = scale.float().repeat_interleave(group_rows, dim=0)[:t.shape[0]]
    return (t.float() * factors).clamp(-fp8_max, fp8_max).to(fp8_dtype)


@kernel
@triton.jit
def _scale_columns_kernel(t_ptr, scale_ptr, q_ptr, R, C, GROUP_ROWS, FP8_MAX: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offsets = rows.to(tl.int64)[:, None] * C + cols[None, :]
    values = tl.load(t_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    groups = (rows // GROUP_ROWS).to(tl.int64)
    values *= tl.load(scale_ptr + groups[:, None] * C + cols[None, :], mask=mask, other=0.0)
    scaled = clamp_keeping_nan(values, FP8_MAX)
    tl.store(q_ptr + offsets, scaled.to(q_ptr.dtype.element_ty), mask=mask)


SCALE_COLUMNS_CONFIG = (16, 256, 4)  # rows, columns, warps per program


def scale_columns(t: torch.Tensor, scale: torch.Tensor, group_rows: int,
                  fp8_dtype: torch.dtype) -> torch.Tensor:
    """``(R, C)`` -> FP8 ``(R, C)``: row ``r`` times the column scales ``scale[r //
    group_rows]`` (``scale`` ``(G, C)`` float32), saturated: the FP8 codes of a weight stored
    input-major, ``(G * K, N)``, scaled per output channel. One read of ``t`` on GPUs."""
    R, C = t.shape
    if not use_triton(t) or not t.is_contiguous() or R == 0 or C == 0:
        return scale_columns_reference(t, scale, group_rows, fp8_dtype)
    data = fp8_buffer((R, C), t.device, fp8_dtype)
    block_r, block_c, warps = SCALE_COLUMNS_CONFIG
    _scale_columns_kernel[(cdiv(R, block_r), cdiv(C, block_c))](
        t, scale.float().contiguous(), data, R, C, group_rows,
        FP8_MAX=torch.finfo(fp8_dtype).max, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return finish(data, fp8_dtype)
