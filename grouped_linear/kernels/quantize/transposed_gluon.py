"""The weight gradient's transposed FP8 operand for Hopper in Gluon, from tiles staged in
shared memory by TMA.

The FP8 weight gradient reads ``x`` and ``dy`` token-contiguous, each group starting on a
128-column boundary (:func:`grouped_linear.kernels.quantize.transposed.quantize_group_columns_t`
with ``align=128``): row ``r`` of group ``g`` at column ``aligned_start_g + r - start_g``,
zeros up to the group's next multiple of 128. Those columns are the groups' 128-token
blocks, numbered group after group, so a program takes one block of one group and 128
source columns: the ``(128, 128)`` tile arrives by TMA (zeros past the matrix), rows of the
next group are zeroed in registers, and each 32-column slice is read back with 16
consecutive tokens of one column per thread, scaled and stored as 16-byte vectors along the
tokens (the layout of :func:`grouped_linear.kernels.quantize.blocks_gluon._token_blocks`, 2.6
TB/s there on the H200). The Triton kernel of
:mod:`~grouped_linear.kernels.quantize.transposed` loads row-major tiles and leaves the
transposition to the compiler.

:func:`write_columns_t` is the second pass of
:func:`~grouped_linear.kernels.quantize.transposed.quantize_columns_t` for the operands
:func:`supported` accepts, bit for bit the Triton kernel's output: per (group, column)
scales derived from the column maxima, one scale per group, or FP8 codes moved unchanged;
rows optionally multiplied by per-row factors first. Its plain-PyTorch reference is
:func:`write_columns_t_reference`.
"""

from __future__ import annotations

import functools

import torch

from .._gluon import (
    GL_DTYPES,
    HAS_GLUON,
    TensorDescriptor,
    gl,
    gluon,
    is_sm90,
    load_tile,
    tile_list,
    tile_origin,
)
from .._triton import cdiv, kernel, next_power_of_2, tl
from .blocks_gluon import _scale
from .common import fold_row_factors, scale_from_amax

__all__ = ["TILE", "SLICE", "WARPS", "MAX_GROUPS", "SCALINGS", "supported", "write_columns_t",
           "write_columns_t_reference"]

TILE = 128  # tokens per block (the wgrad's group alignment) and source columns per program
SLICE = 32  # source columns read back from shared memory at a time
WARPS = 8  # 4 warps along the tokens, 2 along a slice's columns
MAX_GROUPS = 4095  # each program scans the groups' block table, G + 1 slots, in registers
SCALINGS = ("amax", "group", "unit")
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_NAN = gl.constexpr(tl.PropagateNan.ALL)  # min/max keep a NaN operand, as torch's clamp


@kernel
@gluon.jit
def _columns_t_kernel(t_desc, ends_ptr, scale_ptr, inv_ptr, q_ptr, factors_ptr, M, C, G,
                      stride_q, width, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                      SCALING: gl.constexpr, FACTORS: gl.constexpr, SLICE_: gl.constexpr,
                      BLOCK_G: gl.constexpr, num_warps: gl.constexpr):
    """Block ``pid0`` (of :func:`~grouped_linear.kernels._gluon.tile_list` over the groups
    of ``ends``, one column) x source columns ``[pid1 * TILE, +TILE)`` into ``q[c, pid0 *
    TILE + i]``; the programs past the groups' blocks write zeros there, up to column
    ``width``. Program ``pid0 < G`` also writes group ``pid0``'s factors ``inv[g, c] = 1 /
    scale`` (empty groups included; none for ``"unit"``)."""
    TILE_R: gl.constexpr = t_desc.block_type.shape[0]
    TILE_C: gl.constexpr = t_desc.block_type.shape[1]
    col_layout: gl.constexpr = gl.BlockedLayout([16, 1], [2, 16], [4, num_warps // 4], [0, 1])
    b = gl.program_id(0)
    col0 = gl.program_id(1) * TILE_C
    if SCALING != "unit":
        if b < G:  # as the Triton kernel: 1 / scale with the division it compiles to
            inv_cols = col0 + gl.arange(0, TILE_C, layout=gl.SliceLayout(0, col_layout))
            if SCALING == "group":
                inv_scale = gl.load(scale_ptr + b) + gl.zeros_like(inv_cols.to(gl.float32))
            else:
                inv_scale = _scale(gl.load(scale_ptr + b.to(gl.int64) * C + inv_cols,
                                           mask=inv_cols < C, other=0.0), FP8_MAX, POW2)
            gl.store(inv_ptr + b.to(gl.int64) * C + inv_cols, 1.0 / inv_scale,
                     mask=inv_cols < C)
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [num_warps], [0])
    gs, starts, ends, block_begin, block_end, _total = tile_list(
        ends_ptr, G, M, 1, TILE_R, 1, BLOCK_G, table_layout, True)
    group_blocks = gl.sum(gl.where(gs == G, block_begin, 0), axis=0)  # the groups' blocks
    tokens = gl.arange(0, TILE_R, layout=gl.SliceLayout(1, col_layout))
    dst = (b.to(gl.int64) * TILE_R + tokens)[:, None]
    if b < group_blocks:
        g, end, start, _col = tile_origin(b, gs, starts, ends, block_begin, block_end, 1,
                                          TILE_R)
        tile = load_tile(t_desc, start, col0)

        valid = tokens < end - start  # the rows of this group (the next group's after them)
        if FACTORS:  # rows of other groups get factor 0 (never read)
            factors = gl.load(factors_ptr + start + tokens, mask=valid, other=0.0)[:, None]
        for part in gl.static_range(TILE_C // SLICE_):
            cols = col0 + part * SLICE_ + gl.arange(0, SLICE_,
                                                    layout=gl.SliceLayout(0, col_layout))
            col_mask = cols < C
            values = tile.slice(part * SLICE_, SLICE_, dim=1).load(col_layout)
            if SCALING == "unit":  # FP8 codes in, the same codes out; zeros past the group
                bits = values.to(gl.int8, bitcast=True)
                codes = gl.where(valid[:, None], bits, gl.zeros_like(bits))
                codes = codes.to(q_ptr.dtype.element_ty, bitcast=True)
            else:
                values = gl.where(valid[:, None], values.to(gl.float32), 0.0)
                if FACTORS:  # saturated at float32's range, as the Triton kernel's fold
                    values = gl.minimum(gl.maximum(values * factors, -3.4028234663852886e38,
                                                   propagate_nan=_NAN),
                                        3.4028234663852886e38, propagate_nan=_NAN)
                if SCALING == "group":
                    scaled = values * gl.load(scale_ptr + g)
                else:
                    amax = gl.load(scale_ptr + g.to(gl.int64) * C + cols, mask=col_mask,
                                   other=0.0)
                    scaled = values * _scale(amax, FP8_MAX, POW2)[None, :]
                scaled = gl.minimum(gl.maximum(scaled, -FP8_MAX, propagate_nan=_NAN), FP8_MAX,
                                    propagate_nan=_NAN)
                codes = scaled.to(q_ptr.dtype.element_ty)
            gl.store(q_ptr + cols.to(gl.int64)[None, :] * stride_q + dst, codes,
                     mask=col_mask[None, :])
    else:  # columns past the last group, up to the layout's width: zeros
        zeros = gl.zeros([TILE_R, SLICE_], gl.int8, layout=col_layout)
        for part in gl.static_range(TILE_C // SLICE_):
            cols = col0 + part * SLICE_ + gl.arange(0, SLICE_,
                                                    layout=gl.SliceLayout(0, col_layout))
            gl.store(q_ptr + cols.to(gl.int64)[None, :] * stride_q + dst,
                     zeros.to(q_ptr.dtype.element_ty, bitcast=True),
                     mask=(cols < C)[None, :] & (dst < width))


def supported(t: torch.Tensor, data: torch.Tensor, align: int, num_groups: int) -> bool:
    """Whether :func:`write_columns_t` takes source ``t`` ``(M, C)`` into ``data`` with
    ``num_groups`` groups aligned to ``align`` columns: an sm90 GPU, ``align == TILE``, 1 to
    :data:`MAX_GROUPS` groups, ``t`` contiguous bf16, fp16 or FP8 with rows TMA can address,
    ``data`` a 2-D FP8 buffer whose rows and start allow 16-byte stores."""
    if not (HAS_GLUON and t.is_cuda and t.dim() == 2 and data.dim() == 2 and align == TILE
            and 0 < num_groups <= MAX_GROUPS):
        return False
    row_bytes = t.shape[1] * t.element_size()
    return (t.dtype in _SOURCE_DTYPES and is_sm90(t.device.index or 0) and t.is_contiguous()
            and row_bytes % 16 == 0 and t.data_ptr() % 16 == 0 and t.shape[0] > 0
            and t.shape[0] < 2**31 - 2 * TILE and data.dtype in GL_DTYPES
            and data.stride(1) == 1 and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0)


@functools.cache
def _tile_layout(dtype: torch.dtype):
    gl_dtype = GL_DTYPES.get(dtype) or {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl_dtype)


def write_columns_t(t: torch.Tensor, ends: torch.Tensor, data: torch.Tensor, scaling: str,
                    scale: torch.Tensor | None, inv: torch.Tensor | None,
                    factors: torch.Tensor | None, fp8_dtype: torch.dtype,
                    power_of_two: bool) -> None:
    """Writes ``t`` ``(M, C)`` (groups ending at ``ends``, ``(G,)`` int32 on the device)
    into ``data`` ``(C, width)`` FP8 (``width`` at least the aligned groups' columns, a
    multiple of 16), each group at its 128-aligned column with its padding zeros and zeros
    past the last group, and, unless ``scaling`` is ``"unit"``, the ``(G, C)`` factors into
    ``inv``. ``scaling``: ``"amax"`` (``scale`` the ``(G, C)`` float32 column maxima),
    ``"group"`` (``(G,)`` float32 scales) or ``"unit"`` (``t`` FP8 codes, copied).
    ``factors``: ``(M,)`` float32 row multipliers or ``None``; ``fp8_dtype``: the format
    scaled into. Needs :func:`supported` operands."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not one of {SCALINGS}")
    M, C = t.shape
    G = ends.shape[0]
    if G == 0 or C == 0:
        return
    descriptor = TensorDescriptor(t, [M, C], [C, 1], [TILE, TILE], _tile_layout(t.dtype))
    scale = scale if scale is not None else ends
    blocks = max(cdiv(M, TILE) + G + 1, cdiv(data.shape[1], TILE))  # groups' blocks, zeros
    _columns_t_kernel[(blocks, cdiv(C, TILE))](
        descriptor, ends, scale, inv if inv is not None else scale, data,
        factors if factors is not None else scale, M, C, G, data.stride(0), data.shape[1],
        FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, SCALING=scaling,
        FACTORS=factors is not None, SLICE_=SLICE, BLOCK_G=max(32, next_power_of_2(G + 1)), num_warps=WARPS)


def write_columns_t_reference(t: torch.Tensor, ends: torch.Tensor, data: torch.Tensor,
                              scaling: str, scale: torch.Tensor | None,
                              inv: torch.Tensor | None, factors: torch.Tensor | None,
                              fp8_dtype: torch.dtype, power_of_two: bool) -> None:
    """:func:`write_columns_t` in plain PyTorch, group by group (reads ``ends`` on the host;
    ``data`` FP8, or float32 for the scaled, saturated values before rounding)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not one of {SCALINGS}")
    M, C = t.shape
    out = torch.zeros(C, data.shape[1], dtype=torch.float32, device=t.device)
    start = column = 0
    for g, end in enumerate(ends.tolist()):
        rows = t[start:end].float()
        if scaling != "unit":
            if factors is not None:
                rows = fold_row_factors(rows, factors[start:end])
            if scaling == "group":
                group_scale = scale[g].float().expand(C)
            else:
                group_scale = scale_from_amax(scale[g], fp8_dtype, power_of_two)
            inv[g] = 1.0 / group_scale
            fp8_max = torch.finfo(fp8_dtype).max
            rows = (rows * group_scale).clamp(-fp8_max, fp8_max)
        out[:, column:column + end - start] = rows.T
        column += -(-(end - start) // TILE) * TILE
        start = end
    data.copy_(out if data.dtype == torch.float32 else out.to(data.dtype))
