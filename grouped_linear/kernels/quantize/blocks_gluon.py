"""Both block layouts of one grouped operand from one read, for Hopper in Gluon.

The blockwise recipe needs ``x`` (and ``dy``) twice: in 1x128 row tiles for the forward
(dgrad) GEMM and in 128-token blocks per column, token-contiguous, for the weight gradient.
:mod:`grouped_linear.kernels.quantize.blocks` writes them in two passes, each reading the
bf16 operand (6 bytes moved per element in all). A Triton kernel doing both from one read
must hold a 128 x 128 tile in registers for its two reductions (one per row, one per
column) and ran at half the bandwidth (too few programs per SM). Here the tile goes to
shared memory by TMA and both reductions read it from there in 32-wide slices, so a
program holds little in registers: 4 bytes moved per element.

:func:`quantize_row_tiles_and_token_blocks` takes the operands :func:`supported` accepts
and returns what the two passes of :mod:`grouped_linear.kernels.quantize.blocks` return
(:func:`~grouped_linear.kernels.quantize.blocks.quantize_row_tiles` of ``t`` with the rows
past the last group zeroed, and
:func:`~grouped_linear.kernels.quantize.blocks.quantize_token_blocks` in the token-block
layout), bit for bit for finite inputs (a NaN stays NaN here; the passes' clamp turns it
into the format's largest negative value).
"""

from __future__ import annotations

import functools

import torch

from .._gluon import HAS_GLUON, TensorDescriptor, gl, gluon, is_sm90, load_tile, tile_list, tile_origin
from .._triton import cdiv, kernel, next_power_of_2
from . import blocks as qb

__all__ = ["supported", "quantize_row_tiles_and_token_blocks", "TILE", "SLICE",
           "WARPS", "MAX_GROUPS"]

TILE = 128  # the recipe's block: rows of a token block, columns of a row tile
SLICE = 32  # rows (row tiles) or columns (token blocks) read from shared memory at a time
# A multiple of 4 (the token-block pass puts 4 warps along the tokens). H200: 8 warps (64
# registers) level with 4 (80) on the 8-group shapes, 6-11% faster at 16 and 128 groups.
WARPS = 8
# Each program scans the groups' table (G + 1 slots) in registers: at most 4096 slots.
MAX_GROUPS = 4095


@gluon.jit
def _scale(amax, FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """As :func:`grouped_linear.kernels.quantize.common.amax_to_scale` (bit for bit)."""
    scale = gl.where(amax > 0, gl.div_rn(FP8_MAX, gl.maximum(amax, 1e-30)), 1.0)
    scale = gl.minimum(scale, 3.4028234663852886e38)
    if POW2:
        scale = ((scale.to(gl.int32, bitcast=True) >> 23) << 23).to(gl.float32, bitcast=True)
    return scale


@gluon.jit
def _to_fp8(values, scale, dtype: gl.constexpr):
    """``values * scale`` in FP8: the conversion saturates at the format's largest finite
    value, which is where :func:`grouped_linear.kernels.quantize.blocks`'s explicit
    clamp puts it too (bit for bit for finite inputs; a NaN stays NaN here)."""
    return (values * scale).to(dtype)


@gluon.jit
def _row_tiles(tile, rq_ptr, rinv_ptr, start, rows_here, valid_rows, col0, C,
               FP8_MAX: gl.constexpr, POW2: gl.constexpr, SLICE_: gl.constexpr,
               MASKED: gl.constexpr, num_warps: gl.constexpr):
    """The tile's rows in 1 x TILE row tiles: 16-byte vectors of one row per thread, a
    row's columns in 16 threads. Rows ``[rows_here, TILE)`` belong to the next group and
    are not stored; with ``MASKED`` rows ``[valid_rows, rows_here)`` are stored as zeros
    (factor 1): the blocks of the rows past the groups."""
    TILE_R: gl.constexpr = tile.type.shape[0]
    TILE_C: gl.constexpr = tile.type.shape[1]
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    cols = col0 + gl.arange(0, TILE_C, layout=gl.SliceLayout(0, row_layout))
    for part in gl.static_range(TILE_R // SLICE_):
        local = part * SLICE_ + gl.arange(0, SLICE_, layout=gl.SliceLayout(1, row_layout))
        values = tile.slice(part * SLICE_, SLICE_, dim=0).load(row_layout).to(gl.float32)
        if MASKED:
            values = gl.where((local < valid_rows)[:, None], values, 0.0)
        scale = _scale(gl.max(gl.abs(values), axis=1), FP8_MAX, POW2)
        rows = (start + local).to(gl.int64)
        row_mask = local < rows_here
        gl.store(rq_ptr + rows[:, None] * C + cols[None, :],
                 _to_fp8(values, scale[:, None], rq_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cols < C)[None, :])
        gl.store(rinv_ptr + rows * gl.num_programs(1) + gl.program_id(1), gl.div_rn(1.0, scale),
                 mask=row_mask)


@gluon.jit
def _token_blocks(tile, q_ptr, inv_ptr, b, valid_rows, col0, C, stride_q,
                  FP8_MAX: gl.constexpr, POW2: gl.constexpr, SLICE_: gl.constexpr,
                  MASKED: gl.constexpr, num_warps: gl.constexpr):
    """The tile as token block ``b``: per column, the amax over the block's rows (with
    ``MASKED``, rows from ``valid_rows`` on count as zeros), 16 consecutive tokens of one
    column per thread (16-byte stores) into ``q[c, b * TILE + i]``. A warp's load reads
    2 rows 16 apart (they share banks under the tile's swizzle: 2-way conflicts) and 16
    columns; 4 warps cover the 128 rows, more warps split the columns. H200: 2.6 TB/s
    against 2.0 with 1 row per load (no conflicts, but 16-byte pieces of 32 columns per
    store) and 2.35 with 8 (8-way conflicts)."""
    TILE_R: gl.constexpr = tile.type.shape[0]
    TILE_C: gl.constexpr = tile.type.shape[1]
    col_layout: gl.constexpr = gl.BlockedLayout([16, 1], [2, 16], [4, num_warps // 4], [0, 1])
    tokens = gl.arange(0, TILE_R, layout=gl.SliceLayout(1, col_layout))
    slots = (b.to(gl.int64) * TILE_R + tokens)[:, None]
    for part in gl.static_range(TILE_C // SLICE_):
        cols = col0 + part * SLICE_ + gl.arange(0, SLICE_, layout=gl.SliceLayout(0, col_layout))
        values = tile.slice(part * SLICE_, SLICE_, dim=1).load(col_layout).to(gl.float32)
        if MASKED:
            values = gl.where((tokens < valid_rows)[:, None], values, 0.0)
        scale = _scale(gl.max(gl.abs(values), axis=0), FP8_MAX, POW2)
        col_mask = cols < C
        gl.store(q_ptr + cols.to(gl.int64)[None, :] * stride_q + slots,
                 _to_fp8(values, scale[None, :], q_ptr.dtype.element_ty),
                 mask=col_mask[None, :])
        gl.store(inv_ptr + b.to(gl.int64) * C + cols, gl.div_rn(1.0, scale), mask=col_mask)


@kernel
@gluon.jit
def _quantize_both_kernel(t_desc, sizes_ptr, rq_ptr, rinv_ptr, q_ptr, inv_ptr, M, C, G,
                          stride_q, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                          SLICE_: gl.constexpr, BLOCK_G: gl.constexpr,
                          num_warps: gl.constexpr):
    """Token block ``pid0`` x columns ``[pid1 * TILE, +TILE)``: the bf16 tile by TMA into
    shared memory (zeros past the matrix), then

    * :func:`_row_tiles`: each row's amax over the tile's columns, the row tile into
      contiguous ``rq`` ``(M, C)`` and ``rinv[row, pid1]`` (zeros and 1 for the tail's
      rows; rows past the block, which belong to the next group, untouched);
    * :func:`_token_blocks`: each column's amax over the block's rows, the block into
      ``q`` (``q[c, b * TILE + i]``, ``stride_q`` per column: zeros past the block's rows
      and in blocks outside the groups) and ``inv[b, c]`` (1 outside the groups).

    Only a group's last block (and the tail's) masks values: the others take the
    unmasked code."""
    TILE_R: gl.constexpr = t_desc.block_type.shape[0]
    TILE_C: gl.constexpr = t_desc.block_type.shape[1]
    b = gl.program_id(0)
    col0 = gl.program_id(1) * TILE_C
    # token blocks are the row tiles of a one-column grouped output: groups' blocks, then
    # the tail's (slot G), then unused ones (no owner: no rows)
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [num_warps], [0])
    gs, starts, ends, block_begin, block_end, _total = tile_list(
        sizes_ptr, G, M, 1, TILE_R, 1, BLOCK_G, table_layout)
    g, end, start, _col = tile_origin(b, gs, starts, ends, block_begin, block_end, 1,
                                      TILE_R)
    valid_rows = gl.where(g < G, end - start, 0)  # rows whose values count

    tile = load_tile(t_desc, start, col0)

    if valid_rows < TILE_R:
        _row_tiles(tile, rq_ptr, rinv_ptr, start, end - start, valid_rows, col0, C,
                   FP8_MAX, POW2, SLICE_, True, num_warps)
        _token_blocks(tile, q_ptr, inv_ptr, b, valid_rows, col0, C, stride_q, FP8_MAX,
                      POW2, SLICE_, True, num_warps)
    else:
        _row_tiles(tile, rq_ptr, rinv_ptr, start, end - start, valid_rows, col0, C,
                   FP8_MAX, POW2, SLICE_, False, num_warps)
        _token_blocks(tile, q_ptr, inv_ptr, b, valid_rows, col0, C, stride_q, FP8_MAX,
                      POW2, SLICE_, False, num_warps)


def supported(t: torch.Tensor, num_groups: int) -> bool:
    """Whether :func:`quantize_row_tiles_and_token_blocks` takes ``t`` of ``num_groups``
    groups: a contiguous bf16 ``(M, C)`` on an sm90 GPU with rows TMA can address (``C`` a
    multiple of 8), at most :data:`MAX_GROUPS` groups (the group table lives in registers)."""
    return (HAS_GLUON and num_groups <= MAX_GROUPS and t.is_cuda and t.dim() == 2
            and t.dtype == torch.bfloat16
            and is_sm90(t.device.index or 0) and t.is_contiguous() and t.shape[1] % 8 == 0
            and t.data_ptr() % 16 == 0 and t.shape[0] < 2**31 - 2 * TILE)


@functools.cache
def _tile_layout():
    return gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl.bfloat16)


def quantize_row_tiles_and_token_blocks(t: torch.Tensor, sizes: torch.Tensor,
                                        fp8_dtype: torch.dtype, power_of_two: bool):
    """``((row_data, row_inv), (block_data, block_inv))``: the two block layouts of a
    :func:`supported` ``t`` (see above) from one read of it (``sizes``: ``(G,)`` integers on
    ``t``'s device, never read on the host)."""
    M, C = t.shape
    G = sizes.shape[0]
    blocks = qb.num_token_blocks(M, G, TILE)
    block_data = torch.empty(C, blocks * TILE, device=t.device, dtype=fp8_dtype)
    block_inv = torch.empty(blocks, C, device=t.device, dtype=torch.float32)
    row_data = torch.empty(M, C, device=t.device, dtype=fp8_dtype)
    row_inv = torch.empty(M, cdiv(C, TILE), device=t.device, dtype=torch.float32)
    if M == 0 or C == 0:
        block_data.zero_()
        block_inv.fill_(1.0)
        return (row_data, row_inv), (block_data, block_inv)
    descriptor = TensorDescriptor(t, [M, C], [C, 1], [TILE, TILE], _tile_layout())
    _quantize_both_kernel[(blocks, cdiv(C, TILE))](
        descriptor, sizes.contiguous(), row_data, row_inv, block_data, block_inv, M, C, G,
        block_data.stride(0), FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two,
        SLICE_=SLICE, BLOCK_G=max(32, next_power_of_2(G + 1)), num_warps=WARPS)
    return (row_data, row_inv), (block_data, block_inv)
