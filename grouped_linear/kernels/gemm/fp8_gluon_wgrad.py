"""The block-scaled FP8 weight gradient for Hopper in Gluon: ``dW_g = dy_g^T @ x_g``.

Both operands come in the token-block layout of
:func:`grouped_linear.kernels.quantize.blocks.quantize_token_blocks` (``transpose=True``):
128-token blocks of each group, one factor per (block, column) on each side, so every
block's partial product is rescaled by an outer product of the two factor rows. One program
per SM walks the (group, N tile, K tile) list. A loader warp of its own (warp
specialization) keeps a ring of shared-memory stages full by TMA, across tile boundaries,
each stage holding a block's two operand tiles and their two 128-float factor rows; the 8
MMA warps keep two warp-group MMAs in flight as :mod:`grouped_linear.kernels.gemm.fp8_gluon_gemm`
does, and hand a stage back once its MMA is waited for and its factors read. (One program
per tile instead ran 0-9% slower on the 8-group shapes and 16-21% slower at 16 and 128
groups on the H200: each tile paid its own pipeline fill and an unhidden store.)

Same contract, arguments and reference as
:func:`grouped_linear.kernels.gemm.fp8_triton_gemm.blockwise_wgrad`, whose kernel serves CPU,
other GPUs and operands TMA cannot describe (:func:`wgrad_supported`). With
``group_scales`` (the rowwise recipes' operands: one factor per group and row) no factor
travels through the ring: each block's product is added unscaled, which keeps the exact
float32 sum, and the tile is scaled by its group's factors before the store.
"""

from __future__ import annotations

import functools

import torch

from .._gluon import (
    GL_DTYPES,
    HAS_GLUON,
    TensorDescriptor,
    add,
    band_tile,
    descriptor,
    gl,
    gluon,
    is_sm90,
    issue_mma,
    mbarrier,
    operand_ring,
    program_tiles,
    release_ring,
    release_stage,
    store_tile,
    tma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from .._triton import cdiv, kernel, next_power_of_2, sm_count
from .fp8_gluon_gemm import BLOCK, MAX_GROUPS, MM_UNROLL

__all__ = ["wgrad_supported", "blockwise_wgrad", "WGRAD_CONFIG"]

# (tile rows and columns, warps, shared-memory stages) of the MMA warps
WGRAD_CONFIG = (128, 8, 4)
# N tiles per run of the wgrad's program order: 650-680 against 610-640 TFLOP/s one N tile
# at a time on the 8-group shapes (H200)
WGRAD_GROUP_N = 8
# The wgrad runs its 8 MMA warps beside one TMA warp (a warp group of 4 for the register
# file): 12 warps at 168 registers fill the 64K registers of an SM; the MMA warps then take
# 240 each and the loader's warp group 24.
WGRAD_MAXNREG = 168


@gluon.jit
def _issue_wgrad_loads(dy_desc, x_desc, dy_inv_desc, x_inv_desc, n0, k0, block, bars,
                       dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, step, STAGES: gl.constexpr,
                       GROUP_SCALES: gl.constexpr):
    """TMA token block ``block``'s operand tiles and their factors (a 128-float row of
    each, zero past the matrix's edge; none with ``GROUP_SCALES``) into step ``step``'s
    stage."""
    stage = step % STAGES
    bar = bars.index(stage)
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[1]
    if GROUP_SCALES:
        mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes
                        + dy_inv_desc.block_type.nbytes + x_inv_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(dy_desc, [n0, block * BLOCK_T], bar, dy_bufs.index(stage))
    tma.async_copy_global_to_shared(x_desc, [k0, block * BLOCK_T], bar, x_bufs.index(stage))
    if not GROUP_SCALES:
        tma.async_copy_global_to_shared(dy_inv_desc, [block, n0], bar,
                                        dy_inv_bufs.index(stage))
        tma.async_copy_global_to_shared(x_inv_desc, [block, k0], bar, x_inv_bufs.index(stage))


@gluon.jit
def _rescale_outer(acc, partial, dy_inv_bufs, x_inv_bufs, step, STAGES: gl.constexpr,
                   PENDING: gl.constexpr, GROUP_SCALES: gl.constexpr):
    """As :func:`_rescale_rows` with step ``step``'s factors per row and per column, read
    from its stage (the column factors after the wait: they take 32 registers a thread);
    with ``GROUP_SCALES`` the partial product joins unscaled (the tile is scaled once, at
    its store)."""
    if GROUP_SCALES:
        done = warpgroup_mma_wait(PENDING, deps=[partial])
        return acc + done, done
    layout: gl.constexpr = acc.type.layout
    stage = step % STAGES
    dy_scale = dy_inv_bufs.index(stage).reshape([acc.shape[0]]).load(gl.SliceLayout(1, layout))
    done = warpgroup_mma_wait(PENDING, deps=[partial])
    x_scale = x_inv_bufs.index(stage).reshape([acc.shape[1]]).load(gl.SliceLayout(0, layout))
    return acc + done * dy_scale[:, None] * x_scale[None, :], done


@gluon.jit
def _load_tile(dy_desc, x_desc, dy_inv_desc, x_inv_desc, dy_bufs, x_bufs, dy_inv_bufs,
               x_inv_bufs, ready, empty, step0, n0, k0, first_block, n_blocks,
               GROUP_SCALES: gl.constexpr):
    """Loader: one tile's token blocks ``first_block + i`` into the stages of steps
    ``step0 + i``, each once the MMA warps have released it."""
    STAGES: gl.constexpr = dy_bufs.type.shape[0]
    for i in range(n_blocks):
        step = step0 + i
        mbarrier.wait(empty.index(step % STAGES), ((step // STAGES) & 1) ^ 1)
        _issue_wgrad_loads(dy_desc, x_desc, dy_inv_desc, x_inv_desc, n0, k0, first_block + i,
                           ready, dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, step, STAGES,
                           GROUP_SCALES)


@gluon.jit
def _tile_product(dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, ready, empty, step0, n_blocks,
                  UNROLL: gl.constexpr, layout: gl.constexpr, GROUP_SCALES: gl.constexpr):
    """The product over one tile's ``n_blocks`` token blocks (pipeline steps ``step0 +
    i``), pairs of MMAs in flight, each stage released once done with."""
    STAGES: gl.constexpr = dy_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = dy_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = x_bufs.type.shape[1]
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout=layout)
    free_a = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout=layout)
    free_b = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout=layout)
    unrolled = n_blocks // UNROLL * UNROLL
    for i in range(0, unrolled, UNROLL):
        running = issue_mma(ready, dy_bufs, x_bufs, step0 + i, free_a, STAGES)
        for j in gl.static_range(1, UNROLL):
            following = issue_mma(ready, dy_bufs, x_bufs, step0 + i + j, free_b, STAGES)
            acc, free_b = _rescale_outer(acc, running, dy_inv_bufs, x_inv_bufs,
                                         step0 + i + j - 1, STAGES, 1, GROUP_SCALES)
            release_stage(empty, step0 + i + j - 1, STAGES)
            running = following
        acc, free_a = _rescale_outer(acc, running, dy_inv_bufs, x_inv_bufs,
                                     step0 + i + UNROLL - 1, STAGES, 0, GROUP_SCALES)
        release_stage(empty, step0 + i + UNROLL - 1, STAGES)
    for i in range(unrolled, n_blocks):
        running = issue_mma(ready, dy_bufs, x_bufs, step0 + i, free_a, STAGES)
        acc, free_a = _rescale_outer(acc, running, dy_inv_bufs, x_inv_bufs, step0 + i,
                                     STAGES, 0, GROUP_SCALES)
        release_stage(empty, step0 + i, STAGES)
    return acc


@gluon.jit
def _group_blocks(sizes_ptr, G, M, BLOCK_T: gl.constexpr, BLOCK_G: gl.constexpr,
                  layout: gl.constexpr):
    """Per-group vectors: each group's first global token block and its block count."""
    gs = gl.arange(0, BLOCK_G, layout=layout)
    sizes = gl.maximum(gl.load(sizes_ptr + gs, mask=gs < G, other=0).to(gl.int64), 0)
    inclusive = gl.associative_scan(sizes, 0, add)
    ends = gl.minimum(inclusive, M)
    starts = gl.minimum(inclusive - sizes, M)
    blocks = ((ends - starts + BLOCK_T - 1) // BLOCK_T).to(gl.int32)
    return gs, gl.associative_scan(blocks, 0, add) - blocks, blocks


@gluon.jit
def _tile_schedule(sizes_ptr, M, N, K, G, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, BLOCK_G: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                   layout: gl.constexpr):
    """What both partitions know of the program's tiles: the per-group block table
    (:func:`_group_blocks`), the tile grid and this program's id and tile count."""
    gs, firsts, blocks = _group_blocks(sizes_ptr, G, M, BLOCK_T, BLOCK_G, layout)
    n_tiles = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    pid, my_tiles = program_tiles(G * n_tiles * k_tiles, NUM_PROGRAMS)
    return gs, firsts, blocks, n_tiles, k_tiles, pid, my_tiles


@gluon.jit
def _program_tile(t, pid, gs, firsts, blocks, n_tiles, k_tiles, GROUP_N: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    """The program's ``t``-th tile: its group, first N and K, and the group's first token
    block and block count."""
    g, n0, k0 = band_tile(pid + t * NUM_PROGRAMS, n_tiles, k_tiles, GROUP_N, BLOCK_N,
                          BLOCK_K)
    first_block = gl.sum(gl.where(gs == g, firsts, 0), axis=0)
    n_blocks = gl.sum(gl.where(gs == g, blocks, 0), axis=0)
    return g, n0, k0, first_block, n_blocks


@gluon.jit
def _wgrad_loader(dy_desc, x_desc, dy_inv_desc, x_inv_desc, dy_bufs, x_bufs, dy_inv_bufs,
                  x_inv_bufs, ready, empty, sizes_ptr, M, N, K, G, BLOCK_G: gl.constexpr,
                  GROUP_N: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                  GROUP_SCALES: gl.constexpr):
    """Loader partition (one warp): the program's tiles in order, the ring filled across
    tile boundaries (a stage refilled once the MMA warps release it)."""
    BLOCK_N: gl.constexpr = dy_desc.block_type.shape[0]
    BLOCK_T: gl.constexpr = dy_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [1], [0])
    gs, firsts, blocks, n_tiles, k_tiles, pid, my_tiles = _tile_schedule(
        sizes_ptr, M, N, K, G, BLOCK_T, BLOCK_N, BLOCK_K, BLOCK_G, NUM_PROGRAMS,
        table_layout)
    step = 0
    for t in range(0, my_tiles):
        _g, n0, k0, first_block, n_blocks = _program_tile(
            t, pid, gs, firsts, blocks, n_tiles, k_tiles, GROUP_N, BLOCK_N, BLOCK_K,
            NUM_PROGRAMS)
        _load_tile(dy_desc, x_desc, dy_inv_desc, x_inv_desc, dy_bufs, x_bufs, dy_inv_bufs,
                   x_inv_bufs, ready, empty, step, n0, k0, first_block, n_blocks,
                   GROUP_SCALES)
        step += n_blocks


@gluon.jit
def _wgrad_tiles(dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, ready, empty, dw_ptr, sizes_ptr,
                 dy_inv_ptr, x_inv_ptr, M, N, K, G, stride_dwg, stride_dwn, stride_dyi,
                 stride_xi, BLOCK_G: gl.constexpr, GROUP_N: gl.constexpr,
                 NUM_PROGRAMS: gl.constexpr, UNROLL: gl.constexpr, GROUP_SCALES: gl.constexpr,
                 num_warps: gl.constexpr):
    """MMA partition: each tile's product, then its store (the loader meanwhile fills the
    ring with the next tile's blocks); with ``GROUP_SCALES`` the tile times its group's
    factors per row of ``dy`` and per row of ``x`` first."""
    BLOCK_N: gl.constexpr = dy_bufs.type.shape[1]
    BLOCK_T: gl.constexpr = dy_bufs.type.shape[2]
    BLOCK_K: gl.constexpr = x_bufs.type.shape[1]
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_N, BLOCK_K, num_warps)
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [num_warps], [0])
    gs, firsts, blocks, n_tiles, k_tiles, pid, my_tiles = _tile_schedule(
        sizes_ptr, M, N, K, G, BLOCK_T, BLOCK_N, BLOCK_K, BLOCK_G, NUM_PROGRAMS,
        table_layout)
    step = 0
    for t in range(0, my_tiles):
        g, n0, k0, _first_block, n_blocks = _program_tile(
            t, pid, gs, firsts, blocks, n_tiles, k_tiles, GROUP_N, BLOCK_N, BLOCK_K,
            NUM_PROGRAMS)
        acc = _tile_product(dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, ready, empty, step,
                            n_blocks, UNROLL, mma_layout, GROUP_SCALES)
        if GROUP_SCALES:
            ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
            ks = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, mma_layout))
            dy_scale = gl.load(dy_inv_ptr + g.to(gl.int64) * stride_dyi + ns, mask=ns < N,
                               other=0.0)
            x_scale = gl.load(x_inv_ptr + g.to(gl.int64) * stride_xi + ks, mask=ks < K,
                              other=0.0)
            acc = acc * dy_scale[:, None] * x_scale[None, :]
        store_tile(dw_ptr + g.to(gl.int64) * stride_dwg, acc, n0, N - n0, k0, K - k0,
                   stride_dwn, num_warps, BLOCK_N, BLOCK_K)
        step += n_blocks


@kernel
@gluon.jit
def _blockwise_wgrad_kernel(dy_desc, x_desc, dy_inv_desc, x_inv_desc, dw_ptr, sizes_ptr,
                            dy_inv_ptr, x_inv_ptr, M, N, K, G, stride_dwg, stride_dwn,
                            stride_dyi, stride_xi, BLOCK_G: gl.constexpr,
                            STAGES: gl.constexpr, UNROLL: gl.constexpr,
                            GROUP_N: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                            GROUP_SCALES: gl.constexpr, num_warps: gl.constexpr):
    """Tiles ``pid, pid + NUM_PROGRAMS, ...`` of the (group, N tile, K tile) list of ``dW_g
    = dy_g^T x_g``, each over its group's token blocks (whole 128-token blocks, zero past
    the group's end: no masks along the tokens). Factors per (block, row) by TMA through
    the ring, or with ``GROUP_SCALES`` per (group, row) at ``dy_inv_ptr`` / ``x_inv_ptr``."""
    dy_bufs, x_bufs, ready = operand_ring(dy_desc, x_desc, STAGES)
    dy_inv_bufs, x_inv_bufs, empty = operand_ring(dy_inv_desc, x_inv_desc, STAGES)
    gl.warp_specialize([
        (_wgrad_tiles, (dy_bufs, x_bufs, dy_inv_bufs, x_inv_bufs, ready, empty, dw_ptr,
                        sizes_ptr, dy_inv_ptr, x_inv_ptr, M, N, K, G, stride_dwg, stride_dwn,
                        stride_dyi, stride_xi, BLOCK_G, GROUP_N, NUM_PROGRAMS, UNROLL,
                        GROUP_SCALES, num_warps)),
        (_wgrad_loader, (dy_desc, x_desc, dy_inv_desc, x_inv_desc, dy_bufs, x_bufs,
                         dy_inv_bufs, x_inv_bufs, ready, empty, sizes_ptr, M, N, K, G,
                         BLOCK_G, GROUP_N, NUM_PROGRAMS, GROUP_SCALES)),
    ], [1], [24])
    release_ring(ready, STAGES)
    release_ring(empty, STAGES)


def wgrad_supported(dy_blocks: torch.Tensor, dy_inv: torch.Tensor, x_blocks: torch.Tensor,
                    x_inv: torch.Tensor, num_groups: int) -> bool:
    """Whether :func:`blockwise_wgrad` takes these token-block operands and factors of
    ``num_groups`` groups (as :func:`~grouped_linear.kernels.gemm.fp8_gluon_gemm.supported`:
    sm90, unit stride along the tokens, 16-byte aligned rows, at most
    :data:`~grouped_linear.kernels.gemm.fp8_gluon_gemm.MAX_GROUPS` groups, whose table each
    program holds in registers; float32 factor rows that TMA can address too)."""
    return (HAS_GLUON and num_groups <= MAX_GROUPS and dy_blocks.is_cuda
            and is_sm90(dy_blocks.device.index or 0)
            and dy_blocks.dtype in GL_DTYPES and x_blocks.dtype in GL_DTYPES
            and dy_blocks.shape[1] == x_blocks.shape[1] < 2**31 - 2 * BLOCK
            and all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 16 == 0
                    and t.data_ptr() % 16 == 0 for t in (dy_blocks, x_blocks))
            and all(inv.dtype == torch.float32 and inv.dim() == 2 and inv.stride(1) == 1
                    and inv.stride(0) % 4 == 0 and inv.data_ptr() % 16 == 0
                    and inv.shape[1] == data.shape[0]
                    for inv, data in ((dy_inv, dy_blocks), (x_inv, x_blocks))))


@functools.cache
def _factor_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _factor_descriptor(inv: torch.Tensor):
    """One 128-float row of a token block's factors per TMA copy."""
    return TensorDescriptor(inv, list(inv.shape), list(inv.stride()), [1, BLOCK],
                            _factor_layout())


def blockwise_wgrad(dy_blocks: torch.Tensor, dy_inv: torch.Tensor, x_blocks: torch.Tensor,
                    x_inv: torch.Tensor, sizes: torch.Tensor, num_rows: int,
                    out_dtype: torch.dtype = torch.bfloat16, *,
                    group_scales: bool = False) -> torch.Tensor:
    """``(G, N, K)``: ``dW_g = dy_g^T @ x_g``; arguments as
    :func:`grouped_linear.kernels.gemm.fp8_triton_gemm.blockwise_wgrad` (per-block factors,
    or per-group ones with ``group_scales``: each block's product then joins the float32
    sum unscaled and the tile is scaled once). Needs :func:`wgrad_supported` operands."""
    N, K, G = dy_blocks.shape[0], x_blocks.shape[0], sizes.shape[0]
    dw = torch.empty(G, N, K, device=dy_blocks.device, dtype=out_dtype)
    if N == 0 or K == 0 or G == 0 or dy_blocks.shape[1] == 0:
        return dw.zero_()
    tile, warps, stages = WGRAD_CONFIG
    tiles = G * cdiv(N, tile) * cdiv(K, tile)
    programs = min(sm_count(dw.device), tiles)
    _blockwise_wgrad_kernel[(programs,)](
        descriptor(dy_blocks, tile, BLOCK), descriptor(x_blocks, tile, BLOCK),
        _factor_descriptor(dy_inv), _factor_descriptor(x_inv), dw, sizes, dy_inv, x_inv,
        num_rows, N, K, G, dw.stride(0), dw.stride(1), dy_inv.stride(0), x_inv.stride(0),
        BLOCK_G=max(32, next_power_of_2(G)), STAGES=stages, UNROLL=MM_UNROLL,
        GROUP_N=WGRAD_GROUP_N, NUM_PROGRAMS=programs, GROUP_SCALES=group_scales,
        num_warps=warps, maxnreg=WGRAD_MAXNREG)
    return dw
