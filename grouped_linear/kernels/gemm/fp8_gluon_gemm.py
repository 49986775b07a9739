"""Block-scaled FP8 grouped GEMMs for Hopper in Gluon (Triton's explicit-layout dialect).

The blockwise recipe rescales every 128-deep partial product before it joins the float32
accumulator (1x128 factors on the token side, one per 128x128 weight block). Triton's own
``tl.dot`` completes each partial product before the rescale, so the tensor cores sit idle
while it runs. Here the warp-group MMAs are issued asynchronously by hand: the MMA of block
``k + 1`` runs while block ``k``'s partial product is rescaled, operands arrive by TMA into a
ring of shared-memory stages, and each stage is refilled once the MMA that read it is done.

:func:`grouped_mm`: ``out[rows of g] = A[rows of g] @ B_g^T`` (forward: ``B = W``; dgrad:
``B = W^T`` as the recipe's transposed weight copy), persistent over the (group, row tile,
column tile) list of :mod:`grouped_linear.kernels.gemm.fp8_triton_gemm`; rows past the last
group are written as zeros. The weight gradient is
:mod:`grouped_linear.kernels.gemm.fp8_gluon_wgrad` (built from the pieces here).

Same contract, arguments and reference as :mod:`grouped_linear.kernels.gemm.fp8_triton_gemm`,
whose kernels serve CPU (the interpreter has no Gluon), other GPUs and operands TMA cannot
describe (:func:`supported`).

:func:`rowwise_mm`: the rowwise (and tensorwise) recipes' forward and dgrad with
:mod:`grouped_linear.kernels.gemm.fp8_torch_gemm`'s contract, on the bf16 kernel of
:mod:`grouped_linear.kernels.gemm.gluon_gemm` run on FP8 tiles: the whole reduction
accumulates in the tensor cores (as torch's with ``use_fast_accum=True``) and the row and
column factors scale the tile once, before the store.
"""

from __future__ import annotations

import torch

from .._gluon import (
    GL_DTYPES,
    HAS_GLUON,
    descriptor,
    gl,
    gluon,
    is_sm90,
    issue_mma,
    load_stage,
    operand_ring,
    program_tiles,
    release_ring,
    store_tile,
    tile_list,
    tile_origin,
    warpgroup_mma_wait,
    wgmma_layout,
)
from .._triton import cdiv, kernel, next_power_of_2, sm_count
from . import gluon_gemm

__all__ = ["supported", "grouped_mm", "MM_CONFIG", "BLOCK", "MAX_GROUPS", "ROWWISE_CONFIG",
           "rowwise_supported", "rowwise_mm"]

BLOCK = 128  # the scaling block, also every tile's depth and the weight-side tile width
# (rows per tile, warps, shared-memory stages): the tile is two warp groups of 64 rows;
# three 128 x 128 float32 register tiles (accumulator, partial in flight, partial being
# rescaled) take 192 of each thread's registers at 8 warps.
MM_CONFIG = (128, 8, 4)
# Blocks per compile-time unrolled run: the tensor cores wait for one rescale per run.
MM_UNROLL = 2
# Each program scans the groups' table (G + 1 slots) in registers: at most 4096 slots.
MAX_GROUPS = 4095
# The bf16 kernel's launch shape with 128-deep FP8 tiles: the same bytes per stage.
ROWWISE_CONFIG = gluon_gemm.MMConfig(128, 256, 128, 8, 3, group_m=8, tma_store=True)


@gluon.jit
def _issue_loads(a_desc, b_desc, a_row, b_row, k, bars, a_bufs, b_bufs, step,
                 STAGES: gl.constexpr, pred):
    """TMA both operand tiles of pipeline step ``step`` (rows ``a_row`` and ``b_row``,
    both at reduction offset ``k``) into its stage."""
    load_stage(a_desc, a_row, k, b_desc, b_row, k, bars, a_bufs, b_bufs, step, STAGES, pred)


@gluon.jit
def _mm_step(a_desc, b_desc, bars, a_bufs, b_bufs, step, into, kb, steps, k_blocks, a_row,
             b_row, next_a_row, next_b_row, a_inv_rows, row_mask, b_inv_tile, stride_bir,
             has_group, STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
    """Pipeline step ``step``, block ``kb`` of the tile at ``(a_row, b_row)``: refill the
    stage two steps back with the operands of step ``step + STAGES - 2`` (in this tile or
    the program's next one, at ``next_*``), start this block's MMA into ``into``'s
    registers, load its factors. Returns the MMA in flight and the factors."""
    ahead = kb + STAGES - 2
    in_tile = ahead < k_blocks
    _issue_loads(a_desc, b_desc, gl.where(in_tile, a_row, next_a_row),
                 gl.where(in_tile, b_row, next_b_row),
                 gl.where(in_tile, ahead, ahead - k_blocks) * BLOCK_K, bars, a_bufs, b_bufs,
                 step + STAGES - 2, STAGES, step + STAGES - 2 < steps)
    partial = issue_mma(bars, a_bufs, b_bufs, step, into, STAGES)
    return partial, _block_scale(a_inv_rows, row_mask, b_inv_tile, stride_bir, has_group, kb)


@gluon.jit
def _block_scale(a_inv_rows, row_mask, b_inv_tile, stride_bir, has_group, kb):
    """Block ``kb``'s factor per row: the row's 1x128 factor times the weight block's."""
    return gl.load(a_inv_rows + kb, mask=row_mask, other=0.0) \
        * gl.load(b_inv_tile + kb * stride_bir, mask=has_group, other=0.0)


@gluon.jit
def _tile_factors(a_inv_ptr, b_inv_ptr, rows, row0, end, g, col_tile, G, stride_ai,
                  stride_big, stride_biw):
    """Where a tile's factors are: its rows' (masked past the group's end) and its
    weight blocks' (none for the rows past the groups, ``g == G``)."""
    return (rows < (end - row0), a_inv_ptr + (row0 + rows).to(gl.int64) * stride_ai,
            b_inv_ptr + g.to(gl.int64) * stride_big + col_tile * stride_biw, g < G)


@gluon.jit
def _rescale_rows(acc, partial, scale, PENDING: gl.constexpr):
    """Wait until at most ``PENDING`` MMAs are in flight (``partial``'s is done); returns
    ``acc + partial * scale`` (per row) and the finished partial tile."""
    done = warpgroup_mma_wait(PENDING, deps=[partial])
    return acc + done * scale[:, None], done


@kernel
@gluon.jit
def _blockwise_mm_kernel(a_desc, b_desc, a_inv_ptr, b_inv_ptr, out_ptr, sizes_ptr, M, W, R,
                         G, stride_ai, stride_big, stride_biw, stride_bir, stride_om,
                         BLOCK_G: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                         STAGES: gl.constexpr, UNROLL: gl.constexpr,
                         num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    # every warp holds the whole table: lookups reduce within a warp, no shared memory
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [num_warps], [0])

    a_bufs, b_bufs, bars = operand_ring(a_desc, b_desc, STAGES)

    gs, starts, ends, tile_begin, tile_end, total = tile_list(
        sizes_ptr, G, M, W, BLOCK_M, BLOCK_N, BLOCK_G, table_layout)
    n_tiles = gl.cdiv(W, BLOCK_N)
    k_blocks = gl.cdiv(R, BLOCK_K)
    pid, my_tiles = program_tiles(total, NUM_PROGRAMS)
    steps = my_tiles * k_blocks

    # The producer runs STAGES - 2 steps ahead (the host guarantees that many blocks per
    # tile): a stage is refilled two steps after the MMA that read it was issued, by
    # which time that MMA has been waited for.
    LEAD: gl.constexpr = STAGES - 2
    g, end, row0, col_tile = tile_origin(pid, gs, starts, ends, tile_begin, tile_end,
                                         n_tiles, BLOCK_M)
    for p in gl.static_range(LEAD):
        _issue_loads(a_desc, b_desc, row0, g * W + col_tile * BLOCK_N, p * BLOCK_K, bars,
                     a_bufs, b_bufs, p, STAGES, p < steps)

    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    step = 0
    for t in range(0, my_tiles):
        tile = pid + t * NUM_PROGRAMS
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end,
                                             n_tiles, BLOCK_M)
        next_g, _next_end, next_row0, next_col_tile = tile_origin(
            tile + NUM_PROGRAMS, gs, starts, ends, tile_begin, tile_end, n_tiles, BLOCK_M)
        b_row = g * W + col_tile * BLOCK_N
        next_b_row = next_g * W + next_col_tile * BLOCK_N
        row_mask, a_inv_rows, b_inv_tile, has_group = _tile_factors(
            a_inv_ptr, b_inv_ptr, rows, row0, end, g, col_tile, G, stride_ai, stride_big,
            stride_biw)
        # Two partial products alternate: block kb + 1's MMA is issued before block kb's
        # partial is waited for and rescaled, in runs of UNROLL blocks unrolled at compile
        # time. No MMA is in flight across a loop's back edge: a loop-carried copy of an
        # in-flight accumulator makes ptxas serialize every MMA of the kernel.
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        free_a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        free_b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        k_unrolled = k_blocks // UNROLL * UNROLL
        for kb in range(0, k_unrolled, UNROLL):
            running, scale = _mm_step(
                a_desc, b_desc, bars, a_bufs, b_bufs, step, free_a, kb, steps, k_blocks,
                row0, b_row, next_row0, next_b_row, a_inv_rows, row_mask, b_inv_tile,
                stride_bir, has_group, STAGES, BLOCK_K)
            for j in gl.static_range(1, UNROLL):
                following, next_scale = _mm_step(
                    a_desc, b_desc, bars, a_bufs, b_bufs, step + j, free_b, kb + j, steps,
                    k_blocks, row0, b_row, next_row0, next_b_row, a_inv_rows, row_mask,
                    b_inv_tile, stride_bir, has_group, STAGES, BLOCK_K)
                acc, free_b = _rescale_rows(acc, running, scale, 1)
                running = following
                scale = next_scale
            acc, free_a = _rescale_rows(acc, running, scale, 0)
            step += UNROLL
        for kb in range(k_unrolled, k_blocks):  # the rest, one block at a time
            running, scale = _mm_step(
                a_desc, b_desc, bars, a_bufs, b_bufs, step, free_a, kb, steps, k_blocks,
                row0, b_row, next_row0, next_b_row, a_inv_rows, row_mask, b_inv_tile,
                stride_bir, has_group, STAGES, BLOCK_K)
            acc, free_a = _rescale_rows(acc, running, scale, 0)
            step += 1
        store_tile(out_ptr, acc, row0, end - row0, col_tile * BLOCK_N,
                   W - col_tile * BLOCK_N, stride_om, num_warps, BLOCK_M, BLOCK_N)

    release_ring(bars, STAGES)


def supported(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` takes these FP8 operands: CUDA sm90, both contiguous, rows
    whose byte strides TMA can describe (multiples of 16), tile coordinates within int32, at
    least as many 128-deep blocks as the pipeline loads ahead, at most :data:`MAX_GROUPS`
    groups (the group table lives in registers)."""
    return (HAS_GLUON and a.is_cuda and a.dim() == 2 and weight.dim() == 3
            and weight.shape[0] <= MAX_GROUPS
            and is_sm90(a.device.index or 0) and a.dtype in GL_DTYPES
            and weight.dtype in GL_DTYPES and a.is_contiguous() and weight.is_contiguous()
            and a.shape[1] % 16 == 0 and a.shape[1] == weight.shape[2]
            and cdiv(a.shape[1], BLOCK) >= MM_CONFIG[2] - 2
            and a.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and max(a.shape[0], weight.shape[0] * weight.shape[1]) < 2**31 - 2 * BLOCK)


def grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, weight: torch.Tensor, w_inv: torch.Tensor,
               sizes: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 ``a`` ``(M, R)`` (1x128 factors ``a_inv`` ``(M, cdiv(R, 128))``) times each group's
    ``weight`` ``(G, W, R)`` transposed (128x128 block factors ``w_inv``
    ``(G, cdiv(W, 128), cdiv(R, 128))``): ``(M, W)`` in ``out_dtype``. ``sizes``: ``(G,)`` on
    the device, clamped in the kernel. Needs :func:`supported` operands."""
    M, R = a.shape
    G, width = weight.shape[0], weight.shape[1]
    out = torch.empty(M, width, device=a.device, dtype=out_dtype)
    if M == 0 or width == 0:
        return out
    if R == 0 or G == 0:
        return out.zero_()
    block_m, warps, stages = MM_CONFIG
    a_desc = descriptor(a, block_m, BLOCK)
    b_desc = descriptor(weight.view(G * width, R), BLOCK, BLOCK)
    upper_tiles = (cdiv(M, block_m) + G + 1) * cdiv(width, BLOCK)
    programs = max(1, min(sm_count(a.device), upper_tiles))
    a_inv = a_inv.contiguous()
    _blockwise_mm_kernel[(programs,)](
        a_desc, b_desc, a_inv, w_inv, out, sizes, M, width, R, G, a_inv.stride(0),
        w_inv.stride(0), w_inv.stride(1), w_inv.stride(2), out.stride(0),
        BLOCK_G=max(32, next_power_of_2(G + 1)), NUM_PROGRAMS=programs, STAGES=stages,
        UNROLL=MM_UNROLL, num_warps=warps)
    return out


def rowwise_supported(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rowwise_mm` takes these operands: CUDA sm90, ``a`` E4M3 or E5M2 (the
    ``hybrid`` format's gradients), the weight E4M3, contiguous, 16-byte aligned rows (TMA),
    the reduction at least the pipeline's ``STAGES - 1`` tiles deep, row coordinates within
    int32, fewer than 1024 groups (each warp holds the group table in registers)."""
    block_k, stages = ROWWISE_CONFIG.block_k, ROWWISE_CONFIG.stages
    return (HAS_GLUON and a.is_cuda and a.dim() == 2 and weight.dim() == 3
            and weight.shape[0] < 1024
            and is_sm90(a.device.index or 0) and a.dtype in (torch.float8_e4m3fn,
                                                            torch.float8_e5m2)
            and weight.dtype == torch.float8_e4m3fn and a.is_contiguous()
            and weight.is_contiguous() and a.shape[1] == weight.shape[2]
            and a.shape[1] % 16 == 0 and cdiv(a.shape[1], block_k) >= stages - 1
            and a.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and max(a.shape[0], weight.shape[0] * weight.shape[1]) < 2**31 - 512)


def rowwise_mm(a: torch.Tensor, a_inv: torch.Tensor, weight: torch.Tensor, w_inv: torch.Tensor,
               ends: torch.Tensor, out_dtype: torch.dtype,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 ``a`` ``(M, R)`` with ``(M,)`` factors times each group's ``weight`` ``(G, W, R)``
    transposed with ``(G, W)`` factors (any stride along ``W``: a group's factor repeated
    is a stride of 0), plus ``bias`` ``(G, W)`` (added to the scaled float32 tile):
    ``(M, W)`` in ``out_dtype``, rows past ``ends[-1]`` zero. Forward: ``x`` and ``W``;
    dgrad: ``dy`` and the transposed weight copy. Needs :func:`rowwise_supported` operands."""
    out = torch.empty(a.shape[0], weight.shape[1], device=a.device, dtype=out_dtype)
    return gluon_gemm.launch(a, weight, ends, out, bias, factors=(a_inv.contiguous(), w_inv),
                             config=ROWWISE_CONFIG)
