"""Gluon (Triton's explicit-layout dialect, Triton >= 3.5), when it is importable, and the
pieces the Hopper kernels share: TMA descriptors, the operand ring, the persistent tile
schedule.

Without Gluon the kernel modules still import: ``gluon.jit`` and
``gluon.constexpr_function`` become no-op decorators, :data:`HAS_GLUON` is ``False`` and
every ``supported`` check of a Gluon kernel says no.
"""

from __future__ import annotations

import functools

import torch

from ._triton import HAS_TRITON, Stub

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = HAS_TRITON
except ImportError:  # pragma: no cover - older Triton or none
    HAS_GLUON = False
    gluon = gl = Stub()
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None

__all__ = ["HAS_GLUON", "gluon", "gl", "fence_async_shared", "mbarrier", "tma", "warpgroup_mma",
           "warpgroup_mma_wait", "TensorDescriptor", "GL_DTYPES", "is_sm90", "descriptor",
           "add", "tile_list", "tile_origin", "band_tile", "program_tiles", "load_tile", "operand_ring",
           "stage_barriers", "release_ring", "load_stage", "issue_mma", "release_stage",
           "wgmma_layout", "store_tile"]

# The FP8 operand dtypes the Gluon kernels take, as Gluon's types.
GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5} \
    if HAS_GLUON else {}
# TMA layouts: the FP8 operands, the 16-bit ones of the bf16/fp16 kernels, float32 outputs.
_LAYOUT_DTYPES = {**GL_DTYPES, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                  torch.float32: gl.float32} \
    if HAS_GLUON else {}


@functools.cache
def is_sm90(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` is sm90 (Hopper), what the Gluon kernels target."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.cache
def _shared_layout(dtype: torch.dtype, rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], _LAYOUT_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of 2-D ``t`` in ``rows x cols`` tiles (the default swizzled layout).

    Built without ``TensorDescriptor``'s own validation (half of a launch's host time on a
    small step went to it; the tile shapes are the kernels' constants), checking what TMA
    needs of ``t``: a 16-byte aligned start, rows in whole 16 bytes, unit column stride, no
    empty dimension."""
    shape, strides = list(t.shape), list(t.stride())
    if (t.data_ptr() & 15 or strides[1] != 1 or (strides[0] * t.element_size()) & 15
            or not shape[0] or not shape[1]):
        raise ValueError(f"t (shape {tuple(shape)}, strides {tuple(strides)}, address "
                         f"{t.data_ptr():#x}) has no TMA descriptor")
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape = t, shape, strides, [rows, cols]
    desc.layout, desc.padding = _shared_layout(t.dtype, rows, cols), "zero"
    return desc


# --------------------------------------------------------------------------- tile schedule
@gluon.jit
def add(a, b):
    return a + b


@gluon.jit
def tile_list(sizes_ptr, G, M, W, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_G: gl.constexpr, layout: gl.constexpr, ENDS: gl.constexpr = False):
    """Per-slot vectors of the persistent schedule (slot ``G``: rows past the groups):
    group starts/ends (clamped to ``[0, M]``), each slot's first tile and tile end.
    ``sizes_ptr`` holds rows per group, or with ``ENDS`` non-decreasing cumulative ends."""
    gs = gl.arange(0, BLOCK_G, layout=layout)
    sizes = gl.load(sizes_ptr + gs, mask=gs < G, other=0).to(gl.int64)
    if ENDS:
        sizes -= gl.load(sizes_ptr + gs - 1, mask=(gs > 0) & (gs < G), other=0).to(gl.int64)
    sizes = gl.maximum(sizes, 0)
    inclusive = gl.associative_scan(sizes, 0, add)  # int64: any device sizes, clamped
    ends = gl.where(gs == G, M, gl.minimum(inclusive, M)).to(gl.int32)
    starts = gl.minimum(inclusive - sizes, M).to(gl.int32)
    tiles = ((ends - starts + BLOCK_M - 1) // BLOCK_M) * gl.cdiv(W, BLOCK_N)
    tile_end = gl.associative_scan(tiles, 0, add)
    return gs, starts, ends, tile_end - tiles, tile_end, gl.sum(tiles, axis=0)


@gluon.jit
def tile_origin(tile, gs, starts, ends, tile_begin, tile_end, n_tiles,
                BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr = 1):
    """Tile ``tile``'s group, the group's end row, its first row and column-tile index.
    Within a group, tiles run row-major, or with ``GROUP_M > 1`` in bands of ``GROUP_M``
    row tiles, down each column of the band first: the programs at work at one time
    share fewer operand tiles than row-major order makes them read (L2 reuse)."""
    owner = (tile_begin <= tile) & (tile < tile_end)
    g = gl.sum(gl.where(owner, gs, 0), axis=0)
    local = tile - gl.sum(gl.where(owner, tile_begin, 0), axis=0)
    if GROUP_M == 1:
        end = gl.sum(gl.where(owner, ends, 0), axis=0)
        row0 = gl.sum(gl.where(owner, starts, 0), axis=0) + (local // n_tiles) * BLOCK_M
        return g, end, row0, (local % n_tiles).to(gl.int32)
    start = gl.sum(gl.where(owner, starts, 0), axis=0)
    end = gl.sum(gl.where(owner, ends, 0), axis=0)
    row_tiles = gl.cdiv(end - start, BLOCK_M)
    band = GROUP_M * n_tiles
    first_row_tile = (local // band) * GROUP_M
    band_rows = gl.maximum(gl.minimum(row_tiles - first_row_tile, GROUP_M), 1)
    in_band = local % band
    row0 = start + (first_row_tile + in_band % band_rows) * BLOCK_M
    return g, end, row0, (in_band // band_rows).to(gl.int32)


@gluon.jit
def band_tile(tile, n_tiles, k_tiles, GROUP_N: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr):
    """Tile ``tile`` of a weight gradient's (group, N tile, K tile) list: its group and first
    N and K. Within a group, runs of GROUP_N N tiles sweep the K tiles together: the tiles
    running at once share their dy and x rows in L2."""
    g = tile // (n_tiles * k_tiles)
    local = tile % (n_tiles * k_tiles)
    run_n0 = local // (GROUP_N * k_tiles) * GROUP_N
    run_n = gl.minimum(n_tiles - run_n0, GROUP_N)
    in_run = local % (GROUP_N * k_tiles)
    return g, (run_n0 + in_run % run_n) * BLOCK_N, (in_run // run_n) * BLOCK_K


@gluon.jit
def program_tiles(total, NUM_PROGRAMS: gl.constexpr):
    """A persistent program's id and how many of the ``total`` tiles ``pid, pid +
    NUM_PROGRAMS, ...`` it takes."""
    pid = gl.program_id(0)
    return pid, gl.maximum(gl.cdiv(total - pid, NUM_PROGRAMS), 0).to(gl.int32)


# --------------------------------------------------------------------------- operand ring
@gluon.jit
def load_tile(desc, y, x):
    """One tile of ``desc`` at ``[y, x]`` by TMA into shared memory of its own, waited for
    (zeros where it reaches past the tensor)."""
    tile = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [y, x], bar, tile)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    return tile


@gluon.jit
def operand_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """``STAGES`` shared-memory stages for one tile of each operand, and their barriers."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    return a_bufs, b_bufs, stage_barriers(STAGES)


@gluon.jit
def stage_barriers(STAGES: gl.constexpr):
    """One initialized mbarrier per stage of a ring."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(bars.index(stage), count=1)
    return bars


@gluon.jit
def release_ring(bars, STAGES: gl.constexpr):
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(stage))


@gluon.jit
def load_stage(a_desc, a_y, a_x, b_desc, b_y, b_x, bars, a_bufs, b_bufs, step,
               STAGES: gl.constexpr, pred):
    """TMA one tile of each operand, at ``[a_y, a_x]`` and ``[b_y, b_x]``, into the
    stage of pipeline step ``step`` (its barrier expecting both)."""
    stage = step % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_y, a_x], bar, a_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(b_desc, [b_y, b_x], bar, b_bufs.index(stage), pred)


@gluon.jit
def issue_mma(bars, a_bufs, b_bufs, step, into, STAGES: gl.constexpr):
    """Wait for step ``step``'s operands; start its 128-deep product into the registers
    of ``into`` (a finished tile, overwritten: ``use_acc=False``). Writing those registers
    any other way while an MMA is in flight would make ptxas serialize the MMAs."""
    stage = step % STAGES
    mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), into,
                         use_acc=False, is_async=True)


@gluon.jit
def release_stage(empty, step, STAGES: gl.constexpr):
    """Hand step ``step``'s stage back to the loader (its MMA waited for; the fence
    orders the MMA warps' reads before the TMA writes that follow)."""
    fence_async_shared()
    mbarrier.arrive(empty.index(step % STAGES), count=1)


# --------------------------------------------------------------------------- epilogue
@gluon.constexpr_function
def wgmma_layout(BLOCK_M, BLOCK_N, num_warps):
    """Warp-group MMA accumulator layout: warps stacked along the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, BLOCK_N, 32])


@gluon.jit
def store_tile(out_ptr, acc, row0, rows_left, col0, cols_left, stride_om,
               num_warps: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Masked store of a float32 tile in the output dtype, 16-byte vectors per thread."""
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    values = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    base = out_ptr + (row0.to(gl.int64) * stride_om + col0)
    mask = (rows < rows_left)[:, None] & (cols < cols_left)[None, :]
    gl.store(base + (rows[:, None] * stride_om + cols[None, :]), values, mask=mask)
