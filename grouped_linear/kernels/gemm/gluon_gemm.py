"""bf16/fp16 grouped GEMM for Hopper in Gluon, with the bias added in its epilogue.

torch's grouped GEMM takes no bias (2.11), so a biased layer on it pays one more pass over
the output. This kernel adds ``bias[g]`` to each tile of group ``g`` in registers, before
the store: the bias costs one ``(BLOCK_N,)`` load per output tile.

:func:`grouped_mm` computes ``out[rows of g] = a[rows of g] @ B_g`` for the layer's two
data GEMMs:

- forward: ``a = x`` ``(M, K)``, ``B_g = weight[g]^T`` (``weight`` ``(G, N, K)``, tiles
  read along ``K`` and handed to the MMA transposed), optional ``bias`` ``(G, N)``;
- dgrad (``transposed_weight=True``): ``a = dy`` ``(M, N)``, ``B_g = weight[g]``: tiles
  of ``weight[g]`` read as they lie (the MMA takes a row-major 16-bit right operand).

Persistent over the (group, row tile, column tile) list of
:mod:`grouped_linear.kernels.gemm.fp8_gluon_gemm` (whose table helper it shares), in bands of
row tiles for L2 reuse: operands arrive by TMA into a ring of shared-memory stages, filled
``STAGES - 1`` steps ahead and across tile boundaries; one MMA stays in flight while the
next stage's data is awaited. Whole tiles leave through shared memory by TMA while the
next tile's MMAs run; a group's last, partial tile is stored with a row mask (its other
rows are the next group's). Rows past the last group are written as zeros (their tiles
read the weight out of bounds, which TMA fills with zeros). The reference is
:func:`grouped_mm_reference` (a per-group matmul in float32); CPU, other GPUs and operands
TMA cannot describe use the callers' other paths (:func:`supported`).

The same kernel, given per-row factors of ``a`` and per-column factors of each group's
weight (:func:`launch`), runs FP8 operands with 32-deep MMA instructions and scales the
float32 accumulator in the epilogue: the rowwise FP8 GEMM of
:mod:`grouped_linear.kernels.gemm.fp8_gluon_gemm`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._gluon import (
    HAS_GLUON,
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
    tile_list,
    tile_origin,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .._triton import PlanCache, cdiv, kernel, next_power_of_2, sm_count
from ..ends import group_sizes

__all__ = ["MMConfig", "MM_CONFIG", "is_input_major", "supported", "grouped_mm", "launch",
           "grouped_mm_reference"]


class MMConfig(NamedTuple):
    """Launch shape: rows, columns and depth per tile, warps, shared-memory stages, row
    tiles per band of the tile order, and whether whole tiles leave by TMA (which takes a
    ``rows x columns`` output buffer of shared memory)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    tma_store: bool = False


# Two warp groups of 64 rows each hold a 64 x 256 float32 accumulator (128 registers a
# thread); three 48 KB stages and the 64 KB output tile fill the shared memory. Measured on
# the bench shapes (benchmarks/bf16_gluon_gemm.py): without the TMA store the epilogue
# stalled the tensor cores (4 stages: 0.83-1.01x torch's forward); with it 1.00-1.07x.
MM_CONFIG = MMConfig(128, 256, 64, 8, 3, group_m=8, tma_store=True)


@gluon.jit
def _load_step(a_desc, b_desc, a_row, g, col0, k, R, W, bars, a_bufs, b_bufs, step,
               STAGES: gl.constexpr, TRANSPOSED: gl.constexpr, pred):
    """TMA the operand tiles of pipeline step ``step`` (reduction offset ``k`` of the
    tile at rows ``a_row``, group ``g``, output columns ``col0``) into its stage."""
    if TRANSPOSED:  # weight[g] rows along the reduction
        load_stage(a_desc, a_row, k, b_desc, g * R + k, col0, bars, a_bufs, b_bufs, step,
                   STAGES, pred)
    else:  # weight[g] rows along the output columns
        load_stage(a_desc, a_row, k, b_desc, g * W + col0, k, bars, a_bufs, b_bufs, step,
                   STAGES, pred)


@gluon.jit
def _store_rows(out_ptr, values, rows, cols, row0, rows_left, col0, col_mask, stride_om):
    """Masked store of a tile from the MMA's registers (rows past ``rows_left`` belong
    to the next group's programs)."""
    mask = (rows < rows_left)[:, None] & col_mask[None, :]
    base = out_ptr + (row0.to(gl.int64) * stride_om + col0)
    gl.store(base + (rows[:, None].to(gl.int64) * stride_om + cols[None, :]), values,
             mask=mask)


@kernel
@gluon.jit
def _mm_kernel(a_desc, b_desc, out_desc, bias_ptr, out_ptr, ends_ptr, a_inv_ptr, b_inv_ptr,
               M, W, R, G, stride_bias, stride_om, stride_big, stride_biw,
               HAS_BIAS: gl.constexpr, TRANSPOSED: gl.constexpr, SCALED: gl.constexpr,
               TMA_STORE: gl.constexpr, GROUP_M: gl.constexpr,
               BLOCK_G: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr,
               num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1 if TRANSPOSED else 0]
    # SCALED: FP8 operands (32-deep MMA instructions), the accumulator scaled by a's
    # per-row and the group's per-column factors in the epilogue
    INSTR_K: gl.constexpr = 32 if SCALED else 16
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, INSTR_K])
    table_layout: gl.constexpr = gl.BlockedLayout([BLOCK_G // 32], [32], [num_warps], [0])

    a_bufs, b_bufs, bars = operand_ring(a_desc, b_desc, STAGES)
    if TMA_STORE:
        out_tile = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape,
                                             out_desc.layout)
    gs, starts, ends, tile_begin, tile_end, total = tile_list(
        ends_ptr, G, M, W, BLOCK_M, BLOCK_N, BLOCK_G, table_layout, True)
    n_tiles = gl.cdiv(W, BLOCK_N)
    k_blocks = gl.cdiv(R, BLOCK_K)
    pid, my_tiles = program_tiles(total, NUM_PROGRAMS)
    steps = my_tiles * k_blocks

    # Loads run LEAD steps ahead (the host guarantees that many blocks per tile): step
    # s + LEAD refills the stage of step s - 1, whose MMA the wait below has finished.
    LEAD: gl.constexpr = STAGES - 1
    g, end, row0, col_tile = tile_origin(pid, gs, starts, ends, tile_begin, tile_end,
                                         n_tiles, BLOCK_M, GROUP_M)
    for p in gl.static_range(LEAD):
        _load_step(a_desc, b_desc, row0, g, col_tile * BLOCK_N, p * BLOCK_K, R, W, bars,
                   a_bufs, b_bufs, p, STAGES, TRANSPOSED, p < steps)

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    step = 0
    for t in range(0, my_tiles):
        tile = pid + t * NUM_PROGRAMS
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end,
                                             n_tiles, BLOCK_M, GROUP_M)
        next_g, _next_end, next_row0, next_col_tile = tile_origin(
            tile + NUM_PROGRAMS, gs, starts, ends, tile_begin, tile_end, n_tiles, BLOCK_M,
            GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        for kb in range(0, k_blocks):
            stage = step % STAGES
            mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
            if TRANSPOSED:
                b_tile = b_bufs.index(stage)
            else:
                b_tile = b_bufs.index(stage).permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(stage), b_tile, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            ahead = kb + LEAD
            in_tile = ahead < k_blocks
            _load_step(a_desc, b_desc, gl.where(in_tile, row0, next_row0),
                       gl.where(in_tile, g, next_g),
                       gl.where(in_tile, col_tile, next_col_tile) * BLOCK_N,
                       gl.where(in_tile, ahead, ahead - k_blocks) * BLOCK_K, R, W, bars,
                       a_bufs, b_bufs, step + LEAD, STAGES, TRANSPOSED,
                       step + LEAD < steps)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        col0 = col_tile * BLOCK_N
        col_mask = cols < W - col0
        if SCALED:  # rows past the groups (g == G) get factor 0
            row_inv = gl.load(a_inv_ptr + (row0.to(gl.int64) + rows), mask=rows < end - row0,
                              other=0.0)
            col_inv = gl.load(b_inv_ptr + (g.to(gl.int64) * stride_big
                                           + (col0 + cols).to(gl.int64) * stride_biw),
                              mask=col_mask & (g < G), other=0.0)
            acc = acc * row_inv[:, None] * col_inv[None, :]
        if HAS_BIAS:
            bias = gl.load(bias_ptr + (g.to(gl.int64) * stride_bias + col0) + cols,
                           mask=col_mask & (g < G), other=0.0)
            acc = acc + bias.to(gl.float32)[None, :]
        values = acc.to(out_ptr.dtype.element_ty)
        if TMA_STORE:
            # A tile whose rows all belong to its group leaves by TMA (columns past W
            # are clipped) while the next tile's MMAs run; a group's last, partial
            # tile is stored with a row mask.
            if end - row0 >= BLOCK_M:
                tma.store_wait(0)  # the previous tile's copy has left the buffer
                out_tile.store(values)
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [row0, col0], out_tile)
            else:
                _store_rows(out_ptr, values, rows, cols, row0, end - row0, col0, col_mask,
                            stride_om)
        else:
            _store_rows(out_ptr, values, rows, cols, row0, end - row0, col0, col_mask,
                        stride_om)

    if TMA_STORE:
        tma.store_wait(0)
    release_ring(bars, STAGES)


DTYPES = (torch.bfloat16, torch.float16)  # the operand dtypes the bf16/fp16 kernels take
# Launch plans by geometry: a Gluon launch through Triton's binder took ~100 µs of host time
# on the H100 machine's host, more than the GPU time of a fine-grained layer's GEMM.
_PLANS = PlanCache()


def is_input_major(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``(G, N, K)`` is the transposed view of a contiguous ``(G, K, N)``
    tensor (a layer stored input-major, as some checkpoints keep their experts)."""
    return not weight.is_contiguous() and weight.transpose(1, 2).is_contiguous()


def _stored(weight: torch.Tensor, transposed_weight: bool) -> tuple[torch.Tensor, bool]:
    """The weight as the kernel reads it: a transposed view of a contiguous tensor is that
    tensor, read in the other mode (``a @ weight[g]^T`` of the view is ``a @ stored[g]``)."""
    if is_input_major(weight):
        return weight.transpose(1, 2), not transposed_weight
    return weight, transposed_weight


def supported(a: torch.Tensor, weight: torch.Tensor, transposed_weight: bool = False,
              config: MMConfig = MM_CONFIG) -> bool:
    """Whether :func:`grouped_mm` takes these operands: CUDA sm90, bf16 or fp16, ``a``
    contiguous, ``weight`` contiguous or the transposed view of a contiguous tensor, rows
    whose byte strides TMA can describe (multiples of 16), TMA row coordinates within
    int32, at least ``STAGES - 1`` blocks of reduction per tile, and where the weight is
    read along its rows (the dgrad of a contiguous weight) a reduction in whole blocks (a
    block never reads the next group's weight rows)."""
    if not (HAS_GLUON and a.is_cuda and a.dim() == 2 and weight.dim() == 3):
        return False
    weight, transposed_weight = _stored(weight, transposed_weight)
    config = MMConfig(*config)
    block_k, stages = config.block_k, config.stages
    reduction = a.shape[1]
    rows_per_group, row_length = weight.shape[1], weight.shape[2]
    return (is_sm90(a.device.index or 0) and a.dtype in DTYPES and weight.dtype == a.dtype
            and a.is_contiguous() and weight.is_contiguous()
            and reduction % 8 == 0 and row_length % 8 == 0
            and reduction == (rows_per_group if transposed_weight else row_length)
            and cdiv(reduction, block_k) >= stages - 1
            and (not transposed_weight or reduction % block_k == 0)
            and a.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and max(a.shape[0], weight.shape[0] * rows_per_group) < 2**31 - 512)


def grouped_mm(a: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
               bias: torch.Tensor | None = None, *, transposed_weight: bool = False,
               config: MMConfig = MM_CONFIG) -> torch.Tensor:
    """``a`` ``(M, R)`` times each group's weight: ``(M, W)`` in ``a``'s dtype.

    ``weight`` ``(G, N, K)``: forward ``R = K``, ``W = N`` (``a @ weight[g]^T``, plus
    ``bias`` ``(G, N)`` if given); with ``transposed_weight`` ``R = N``, ``W = K``
    (``a @ weight[g]``, the dgrad). ``ends``: ``(G,)`` non-decreasing cumulative group ends
    on the device (clamped to ``[0, M]`` in the kernel; rows past the last end come out
    zero). ``weight`` may be the ``transpose(1, 2)`` view of a contiguous ``(G, K, N)``
    tensor (a layer stored input-major): its tiles are then read in the other order, with
    no copy. Needs :func:`supported` operands; ``config``: the launch shape.
    """
    width = weight.shape[2] if transposed_weight else weight.shape[1]
    weight, transposed_weight = _stored(weight, transposed_weight)
    return launch(a, weight, ends, a.new_empty(a.shape[0], width), bias,
                  transposed_weight=transposed_weight, config=config)


def launch(a: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
           bias: torch.Tensor | None = None, factors: tuple[torch.Tensor, torch.Tensor]
           | None = None, *, transposed_weight: bool = False,
           config: MMConfig = MM_CONFIG) -> torch.Tensor:
    """Runs the kernel into ``out`` ``(M, W)`` for a contiguous ``weight`` (as it lies):
    :func:`grouped_mm`'s work, and with ``factors`` = ``(a_inv (M,), b_inv (G, W))`` (any
    strides along ``W``, 0 included) the FP8 product ``a_inv[m] * b_inv[g, w] * (a @ B_g)``
    (:mod:`grouped_linear.kernels.gemm.fp8_gluon_gemm`)."""
    M, R = a.shape
    G, width = weight.shape[0], out.shape[1]
    if M == 0 or width == 0:
        return out
    if G == 0:
        return out.zero_()
    config = MMConfig(*config)
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    a_desc = descriptor(a, block_m, block_k)
    tma_store = config.tma_store and width % 8 == 0 and out.data_ptr() % 16 == 0
    out_desc = descriptor(out, block_m, block_n) if tma_store else a_desc
    flat_weight = weight.view(G * weight.shape[1], weight.shape[2])
    if transposed_weight:
        b_desc = descriptor(flat_weight, block_k, block_n)
    else:
        b_desc = descriptor(flat_weight, block_n, block_k)
    upper_tiles = (cdiv(M, block_m) + G + 1) * cdiv(width, block_n)
    programs = max(1, min(sm_count(a.device), upper_tiles))
    has_bias = bias is not None
    if has_bias and bias.stride(-1) != 1:
        bias = bias.contiguous()
    a_inv, b_inv = factors if factors is not None else (out, out)  # unread without factors
    bias_arg = bias if has_bias else out
    args = (a_desc, b_desc, out_desc, bias_arg, out, ends, a_inv, b_inv, M, width, R, G,
            bias.stride(0) if has_bias else 0, out.stride(0), b_inv.stride(0), b_inv.stride(1))
    key = (args[8:], config, has_bias, transposed_weight, factors is not None, tma_store,
           a.dtype, weight.dtype, out.dtype, bias_arg.dtype, ends.dtype, a_inv.dtype,
           b_inv.dtype, a.device)
    if not _PLANS.try_launch(key, args):
        meta = dict(HAS_BIAS=has_bias, TRANSPOSED=transposed_weight,
                    SCALED=factors is not None, TMA_STORE=tma_store, GROUP_M=config.group_m,
                    BLOCK_G=max(32, next_power_of_2(G + 1)), NUM_PROGRAMS=programs,
                    STAGES=config.stages, num_warps=config.warps)
        _PLANS.keep(key, _mm_kernel.launch_planned((programs,), args, meta))
    return out


def grouped_mm_reference(a: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                         bias: torch.Tensor | None = None, *,
                         transposed_weight: bool = False) -> torch.Tensor:
    """:func:`grouped_mm` in plain PyTorch: a per-group matmul in float32 (float64 for
    float64 input), rows past the groups zero."""
    sizes = group_sizes(ends.to(torch.int64))
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    width = weight.shape[2] if transposed_weight else weight.shape[1]
    out = torch.zeros(a.shape[0], width, device=a.device, dtype=acc_dtype)
    start = 0
    for g, size in enumerate(sizes.tolist()):
        size = max(0, min(int(size), a.shape[0] - start))
        w = weight[g].to(acc_dtype)
        rows = a[start:start + size].to(acc_dtype) @ (w if transposed_weight else w.T)
        if bias is not None:
            rows += bias[g].to(acc_dtype)
        out[start:start + size] = rows
        start += size
    return out.to(a.dtype)
