"""bf16/fp16 grouped weight gradient for Hopper in Gluon, with the bias gradient beside it.

``grad_w[g] = dy[rows of g]^T @ x[rows of g]`` ``(G, N, K)`` and, optionally,
``grad_b[g] = sum of dy[rows of g]`` ``(G, N)``: the bias gradient comes from the same
shared-memory tiles of ``dy`` as one more, narrow MMA against a tile of ones
(``dy^T @ 1``, 8 columns wide), so it costs no pass over ``dy`` of its own.

One tile per (group, ``N`` tile, ``K`` tile), persistent programs walking them in order,
their loads running ``STAGES - 1`` steps ahead across tile boundaries (a tile of a group of
a few hundred rows is a few steps: refilling the pipeline per tile made it 1.11-1.35x
slower at 32-256 rows per group, H100). Both operands arrive by TMA as they lie in
memory, ``dy`` ``(M, N)`` and ``x`` ``(M, K)`` row-major (the MMA reads the ``dy`` tile
transposed and the ``x`` tile row-major); a tile starts at its group's first row, so only
the group's last block holds rows of the next group: the MMA warps zero those rows of both
tiles in shared memory before its MMA. Whole output tiles leave by TMA while the next
tile's MMAs run (the tiles at the ``N`` edge, whose rows would spill into the next
group's, with a row mask). Groups are given by ``ends``, the non-decreasing cumulative row
ends within ``[0, M]`` (:func:`grouped_linear.kernels.ends.group_ends`); an empty group's
tiles take one step of zeroed rows and store zeros.

Tiles are walked in bands of ``band_n`` ``N`` tiles (each band's tiles of one ``K``
column in a row, then the next column), so that programs running at the same time share
the ``x`` tiles they read (the same order as the FP8 weight gradient's).
The reference is :func:`wgrad_reference`. The ``grouped`` backend takes it on Hopper
(:mod:`grouped_linear.ops.steps`): on the bench shapes it ran at 1.00-1.03x torch's
weight-gradient GEMM alone and 0.99-1.05x torch's GEMM plus its bias reduction pass
(``benchmarks/bf16_gemms.py``; docs/design.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._gluon import (
    HAS_GLUON,
    band_tile,
    descriptor,
    fence_async_shared,
    gl,
    gluon,
    is_sm90,
    load_stage,
    mbarrier,
    operand_ring,
    program_tiles,
    release_ring,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .._triton import PlanCache, kernel, sm_count
from .gluon_gemm import DTYPES

__all__ = ["WgradConfig", "WGRAD_CONFIG", "BIAS_DTYPES", "supported", "wgrad", "wgrad_reference"]


class WgradConfig(NamedTuple):
    """Launch shape: ``N`` rows and ``K`` columns per output tile, rows of ``dy``/``x``
    per pipeline step, warps, shared-memory stages, and ``N`` tiles per band of the tile
    order (the FP8 wgrad's ``GROUP_N``; 1: each ``N`` tile's ``K`` tiles in a row)."""

    block_n: int
    block_k: int
    block_t: int
    warps: int
    stages: int
    band_n: int = 1


# Two warp groups of 64 output rows, a 64 x 256 float32 accumulator each; a stage is a
# 64 x 128 tile of dy and a 64 x 256 tile of x (48 KB); the 64 KB output tile besides.
# Bands of 8 N tiles: 1.00-1.03x torch's GEMM on the bench shapes, against 0.87-1.03x
# with one N tile's K tiles in a row. A float32 output (for an fp32 main_grad) goes from the
# accumulator registers straight to memory: its 128 KB tile would not fit beside the stages.
WGRAD_CONFIG = WgradConfig(128, 256, 64, 8, 3, band_n=8)
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLANS = PlanCache()  # launch plans by geometry (as the GEMM's: Triton's binder is slow)


@gluon.jit
def _zero_rows_from(tile, first_zero_row, BLOCK_T: gl.constexpr, num_warps: gl.constexpr):
    """Rows ``first_zero_row..`` of an operand tile in shared memory set to zero."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    values = tile.load(layout)
    rows = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, layout))
    tile.store(gl.where((rows < first_zero_row)[:, None], values, gl.zeros_like(values)))


@gluon.jit
def _tile_rows(tile, total, ends_ptr, n_tiles, k_tiles, BAND_N: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_T: gl.constexpr):
    """Tile ``tile`` of the ``total``: its group, first N and K, the group's rows
    ``start..end`` and its pipeline steps (one for an empty group: a block of zeros)."""
    g, n0, k0 = band_tile(tile, n_tiles, k_tiles, BAND_N, BLOCK_N, BLOCK_K)
    valid = tile < total
    end = gl.load(ends_ptr + g, mask=valid, other=0)
    start = gl.load(ends_ptr + g - 1, mask=valid & (g > 0), other=0)
    return g, n0, k0, start, end, gl.maximum(gl.cdiv(end - start, BLOCK_T), 1)


@gluon.jit
def _next_load(dy_desc, x_desc, dy_bufs, x_bufs, bars, ends_ptr, load_step, t, kb, n0, k0,
               start, blocks, pid, my_tiles, n_tiles, k_tiles, total, BAND_N: gl.constexpr,
               NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr):
    """The loads' cursor: TMA block ``kb`` of the program's ``t``-th tile into the stage of
    step ``load_step`` (none past the program's last tile), then move to the next block,
    across tile boundaries. Returns the cursor moved on."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    row = start + kb * BLOCK_T
    load_stage(dy_desc, row, n0, x_desc, row, k0, bars, dy_bufs, x_bufs, load_step, STAGES,
               t < my_tiles)
    kb += 1
    if kb == blocks:
        t += 1
        kb = kb * 0
        _g, n0, k0, start, _end, blocks = _tile_rows(
            pid + t * NUM_PROGRAMS, total, ends_ptr, n_tiles, k_tiles, BAND_N, BLOCK_N,
            BLOCK_K, BLOCK_T)
    return load_step + 1, t, kb, n0, k0, start, blocks


@gluon.jit
def _tile_products(dy_desc, x_desc, dy_bufs, x_bufs, bars, ones_tile, ends_ptr, start, end,
                   blocks, step, cursor, pid, my_tiles, n_tiles, k_tiles, total,
                   SUMS: gl.constexpr, mma_layout: gl.constexpr, bias_layout: gl.constexpr,
                   BAND_N: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr,
                   num_warps: gl.constexpr):
    """One output tile's products over its group's rows ``start..end`` in ``blocks``
    pipeline steps from ``step``: ``dy^T @ x`` and, with ``SUMS``, ``dy^T @ 1`` (the bias
    gradient, 8 equal columns), each step's stage refilled LEAD steps ahead by the loads'
    ``cursor``. Returns both accumulators, finished, the next step and the cursor."""
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    # MMAs per pipeline step, each its own group: the wait leaves this step's in flight
    IN_FLIGHT: gl.constexpr = 2 if SUMS else 1
    load_step, l_t, l_kb, l_n0, l_k0, l_start, l_blocks = cursor
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout=mma_layout)
    bias_acc = gl.zeros([BLOCK_N, 8], gl.float32, layout=bias_layout)
    for kb in range(0, blocks):
        stage = step % STAGES
        mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
        dy_tile = dy_bufs.index(stage)
        x_tile = x_bufs.index(stage)
        rows_left = end - start - kb * BLOCK_T
        if rows_left < BLOCK_T:
            # The group's last block holds the next group's rows (or rows past the groups,
            # whatever they hold; all of an empty group's one block): zero them in both
            # operands, not one, so that no inf or NaN there reaches a sum (0 * inf is NaN).
            _zero_rows_from(dy_tile, rows_left, BLOCK_T, num_warps)
            _zero_rows_from(x_tile, rows_left, BLOCK_T, num_warps)
            fence_async_shared()
        acc = warpgroup_mma(dy_tile.permute((1, 0)), x_tile, acc, is_async=True)
        if SUMS:
            bias_acc = warpgroup_mma(dy_tile.permute((1, 0)), ones_tile, bias_acc,
                                     is_async=True)
            acc, bias_acc = warpgroup_mma_wait(IN_FLIGHT, deps=[acc, bias_acc])
        else:
            acc = warpgroup_mma_wait(IN_FLIGHT, deps=[acc])
        load_step, l_t, l_kb, l_n0, l_k0, l_start, l_blocks = _next_load(
            dy_desc, x_desc, dy_bufs, x_bufs, bars, ends_ptr, load_step, l_t, l_kb, l_n0,
            l_k0, l_start, l_blocks, pid, my_tiles, n_tiles, k_tiles, total, BAND_N,
            NUM_PROGRAMS, STAGES)
        step += 1
    if SUMS:
        acc, bias_acc = warpgroup_mma_wait(0, deps=[acc, bias_acc])
    else:
        acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, bias_acc, step, (load_step, l_t, l_kb, l_n0, l_k0, l_start, l_blocks)


@kernel
@gluon.jit
def _wgrad_kernel(dy_desc, x_desc, out_desc, out_ptr, bias_grad_ptr, ends_ptr, N, K, G,
                  HAS_BIAS: gl.constexpr, BAND_N: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                  STAGES: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    LEAD: gl.constexpr = STAGES - 1
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_K, 16])
    bias_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 16])
    dy_bufs, x_bufs, bars = operand_ring(dy_desc, x_desc, STAGES)
    if TMA_STORE:
        out_tile = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape,
                                             out_desc.layout)
    if HAS_BIAS:
        ones_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1],
                                                     [1, 0])
        ones = gl.full([BLOCK_T, 8], 1.0, dy_desc.dtype, layout=ones_layout)
        ones_tile = gl.allocate_shared_memory(
            dy_desc.dtype, [BLOCK_T, 8],
            gl.NVMMASharedLayout.get_default_for([BLOCK_T, 8], dy_desc.dtype), ones)
        fence_async_shared()
    else:
        ones_tile = dy_bufs

    n_tiles = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    total = G * n_tiles * k_tiles
    pid, my_tiles = program_tiles(total, NUM_PROGRAMS)
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    cols_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, mma_layout))
    # The loads run LEAD pipeline steps ahead of the MMAs, across tile boundaries: a tile's
    # first blocks arrive while the previous tile's last MMAs and its store run. Step s +
    # LEAD refills the stage of step s - 1, whose MMA the wait in the loop has finished.
    _g, l_n0, l_k0, l_start, _end, l_blocks = _tile_rows(
        pid, total, ends_ptr, n_tiles, k_tiles, BAND_N, BLOCK_N, BLOCK_K, BLOCK_T)
    load_step = pid * 0  # the cursor's counters, as tensors from the start
    l_t = pid * 0
    l_kb = pid * 0
    for _p in gl.static_range(LEAD):
        load_step, l_t, l_kb, l_n0, l_k0, l_start, l_blocks = _next_load(
            dy_desc, x_desc, dy_bufs, x_bufs, bars, ends_ptr, load_step, l_t, l_kb, l_n0,
            l_k0, l_start, l_blocks, pid, my_tiles, n_tiles, k_tiles, total, BAND_N,
            NUM_PROGRAMS, STAGES)
    cursor = (load_step, l_t, l_kb, l_n0, l_k0, l_start, l_blocks)
    step = 0
    for t in range(0, my_tiles):
        g, n0, k0, start, end, blocks = _tile_rows(
            pid + t * NUM_PROGRAMS, total, ends_ptr, n_tiles, k_tiles, BAND_N, BLOCK_N,
            BLOCK_K, BLOCK_T)
        if HAS_BIAS and k0 == 0:  # the tiles at K offset 0 also sum dy: one narrow MMA more
            acc, bias_acc, step, cursor = _tile_products(
                dy_desc, x_desc, dy_bufs, x_bufs, bars, ones_tile, ends_ptr, start, end, blocks,
                step, cursor, pid, my_tiles, n_tiles, k_tiles, total, True, mma_layout,
                bias_layout, BAND_N, NUM_PROGRAMS, STAGES, num_warps)
        else:
            acc, bias_acc, step, cursor = _tile_products(
                dy_desc, x_desc, dy_bufs, x_bufs, bars, ones_tile, ends_ptr, start, end, blocks,
                step, cursor, pid, my_tiles, n_tiles, k_tiles, total, False, mma_layout,
                bias_layout, BAND_N, NUM_PROGRAMS, STAGES, num_warps)
        values = acc.to(out_ptr.dtype.element_ty)
        out_row = g * N + n0
        if TMA_STORE and n0 + BLOCK_N <= N:
            tma.store_wait(0)
            out_tile.store(values)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [out_row, k0], out_tile)
        else:
            mask = (rows_n < N - n0)[:, None] & (cols_k < K - k0)[None, :]
            ptrs = out_ptr + (out_row.to(gl.int64) * K + k0) \
                + (rows_n[:, None].to(gl.int64) * K + cols_k[None, :])
            gl.store(ptrs, values, mask=mask)
        if HAS_BIAS and k0 == 0:
            rows_b = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, bias_layout))
            sums = gl.sum(bias_acc, axis=1) * (1.0 / 8)  # 8 equal columns
            gl.store(bias_grad_ptr + (g.to(gl.int64) * N + n0) + rows_b,
                     sums.to(bias_grad_ptr.dtype.element_ty), mask=rows_b < N - n0)
    if TMA_STORE:
        tma.store_wait(0)
    release_ring(bars, STAGES)


def supported(grad_out: torch.Tensor, x: torch.Tensor, num_groups: int) -> bool:
    """Whether :func:`wgrad` takes these operands for ``num_groups`` groups: CUDA sm90,
    bf16 or fp16 alike, both contiguous 2-D with the same rows, widths whose byte strides
    TMA can describe (multiples of 16), TMA row coordinates within int32."""
    if not (HAS_GLUON and grad_out.is_cuda and x.is_cuda and grad_out.dim() == 2
            and x.dim() == 2):
        return False
    (M, N), K = grad_out.shape, x.shape[1]
    return (is_sm90(x.device.index or 0) and x.dtype in DTYPES
            and grad_out.dtype == x.dtype and x.shape[0] == M
            and grad_out.is_contiguous() and x.is_contiguous()
            and N % 8 == 0 and K % 8 == 0 and N > 0 and K > 0
            and grad_out.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
            and M < 2**31 - 512 and num_groups * N < 2**31 - 512)


def wgrad(grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, with_bias: bool, *,
          bias_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None,
          config: WgradConfig = WGRAD_CONFIG) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grad_out`` ``(M, N)``, ``x`` ``(M, K)``, ``ends`` ``(G,)`` cumulative group ends on
    the device -> ``grad_w`` ``(G, N, K)`` in ``out_dtype`` (``x``'s or float32; default
    ``x``'s) and, with ``with_bias``,
    ``grad_b`` ``(G, N)`` summed in float32 and stored in ``bias_dtype`` (one of
    :data:`BIAS_DTYPES`; rows past ``ends[-1]`` ignored, empty groups zero).
    Needs :func:`supported` operands."""
    if bias_dtype not in BIAS_DTYPES:
        raise ValueError(f"bias_dtype={bias_dtype} is not one of {BIAS_DTYPES}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype={out_dtype}: expected {x.dtype} or torch.float32")
    M, N = grad_out.shape
    K = x.shape[1]
    G = ends.shape[0]
    grad_w = x.new_empty(G, N, K, dtype=out_dtype)
    grad_b = grad_out.new_empty(G, N, dtype=bias_dtype) if with_bias else None
    if G == 0:
        return grad_w, grad_b
    config = WgradConfig(*config)
    dy_desc = descriptor(grad_out, config.block_t, config.block_n)
    x_desc = descriptor(x, config.block_t, config.block_k)
    out_desc = descriptor(grad_w.view(G * N, K), config.block_n, config.block_k)
    tiles = G * -(-N // config.block_n) * -(-K // config.block_k)
    programs = max(1, min(sm_count(x.device), tiles))
    bias_arg = grad_b if with_bias else grad_w
    args = (dy_desc, x_desc, out_desc, grad_w, bias_arg, ends, N, K, G)
    key = (N, K, G, config, with_bias, x.dtype, out_dtype, bias_arg.dtype, ends.dtype,
           x.device)
    if not _PLANS.try_launch(key, args):
        meta = dict(HAS_BIAS=with_bias, BAND_N=config.band_n, NUM_PROGRAMS=programs,
                    STAGES=config.stages, TMA_STORE=out_dtype != torch.float32,
                    num_warps=config.warps)
        _PLANS.keep(key, _wgrad_kernel.launch_planned((programs,), args, meta))
    return grad_w, grad_b


def wgrad_reference(grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor,
                    with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`wgrad` in plain PyTorch (float32 accumulation, float64 for float64)."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    G, N, K = ends.shape[0], grad_out.shape[1], x.shape[1]
    grad_w = torch.zeros(G, N, K, device=x.device, dtype=acc_dtype)
    grad_b = torch.zeros(G, N, device=x.device, dtype=acc_dtype)
    start = 0
    for g, end in enumerate(ends.tolist()):
        dy = grad_out[start:end].to(acc_dtype)
        grad_w[g] = dy.T @ x[start:end].to(acc_dtype)
        grad_b[g] = dy.sum(0)
        start = end
    return grad_w.to(x.dtype), (grad_b.to(torch.float32) if with_bias else None)
