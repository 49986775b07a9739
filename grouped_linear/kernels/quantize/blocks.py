"""FP8 block-scaling quantization (DeepSeek-V3 style) in single-pass Triton kernels.

Each kernel program loads one scaling tile into registers, takes its amax, scales,
saturates, rounds and stores it: one read and one write of the data. Scales follow
:func:`grouped_linear.kernels.quantize.common.scale_from_amax` (``fp8_max / amax``, 1 for
all-zero tiles, optionally rounded down to a power of two); the returned ``inv``
factors are the float32 ``1 / scale`` of each tile.

* :func:`quantize_row_tiles`: ``(M, C)`` -> FP8 ``(M, C)`` with one scale per row and
  ``tile`` consecutive columns (1x128 tiles), ``inv`` ``(M, cdiv(C, tile))``. The
  activation-side operand of the forward GEMM (``x`` along ``K``) and of the dgrad GEMM
  (``dy`` along ``N``).
* :func:`quantize_weight_blocks`: ``(G, N, K)`` -> FP8 ``(G, N, K)`` with one scale per
  ``block x block`` tile, ``inv`` ``(G, cdiv(N, block), cdiv(K, block))``. The forward
  GEMM reads it as is and the dgrad GEMM reads the same blocks transposed: a square
  block has one scale for both orientations, so the weight is quantized once.
* :func:`quantize_token_blocks`: ``(M, C)`` with rows split into groups by ``(G,)``
  ``sizes`` -> FP8 ``(M, C)`` with one scale per (block of ``tile`` rows of one group,
  column), ``inv`` ``(cdiv(M, tile) + G, C)``. The weight-gradient GEMM's operands
  (``dy`` and ``x``), scaled along the tokens it reduces over; blocks never straddle a
  group boundary.

Each kernel has its plain-PyTorch reference beside it. Where Triton cannot run on the
tensor's device, or the tensor is empty, the reference runs instead.
"""

from __future__ import annotations

import torch

from .._groups import group_rows
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .common import (
    amax_to_scale,
    clamp_keeping_nan,
    finish,
    fp8_buffer,
    inverse,
    magnitudes,
    pad_to,
    saturate,
    scale_from_amax,
)

__all__ = ["quantize_row_tiles", "quantize_row_tiles_reference", "dequantize_row_tiles",
           "quantize_weight_blocks",
           "quantize_weight_blocks_reference", "quantize_token_blocks",
           "quantize_token_blocks_reference", "token_block_index", "token_block_columns",
           "num_token_blocks",
           "ROW_TILES_CONFIG", "WEIGHT_BLOCKS_CONFIG", "TOKEN_BLOCKS_CONFIG"]

# Launch shapes: (rows per program, warps) for row tiles, (warps,) for weight blocks,
# (columns per program, warps) for token blocks; the defaults of the quantizers' config=
# keywords (benchmarks/fp8_quantize.py times others).
ROW_TILES_CONFIG = (32, 4)
WEIGHT_BLOCKS_CONFIG = (8,)
TOKEN_BLOCKS_CONFIG = (64, 4)


# --------------------------------------------------------------------------- row tiles
def quantize_row_tiles_reference(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                                 tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` -> FP8 ``(M, C)`` and float32 ``(M, cdiv(C, tile))`` factors: one
    scale per row and block of ``tile`` columns (the last block may be partial)."""
    M, C = t.shape
    blocks = cdiv(C, tile)
    padded = pad_to(t.float(), 1, tile).view(M, blocks, tile)
    amax = magnitudes(padded).amax(dim=2) if padded.numel() else padded.new_zeros(M, blocks)
    scale = scale_from_amax(amax, fp8_dtype, power_of_two)
    data = saturate(padded, scale[:, :, None], fp8_dtype).view(M, blocks * tile)[:, :C]
    return data.contiguous(), 1.0 / scale


def dequantize_row_tiles(data: torch.Tensor, inv: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """float32 ``data[m, c] * inv[m, c // tile]``: the inverse of :func:`quantize_row_tiles`."""
    M, C = data.shape
    tiles = pad_to(data.float(), 1, tile).view(M, cdiv(C, tile), tile)
    return (tiles * inv[:, :, None]).view(M, tiles.shape[1] * tile)[:, :C]


@kernel
@triton.jit
def _quantize_row_tiles_kernel(t_ptr, q_ptr, inv_ptr, M, C, stride_tm, stride_tc, n_blocks,
                               FP8_MAX: tl.constexpr, POW2: tl.constexpr, TILE: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows ``[pid0 * BLOCK_R, +BLOCK_R)`` x columns ``[pid1 * TILE, +TILE)``: one scale per
    row, ``inv[row, pid1]``; ``q`` is contiguous ``(M, C)``, ``BLOCK_T >= TILE``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    block = tl.program_id(1)
    offs = tl.arange(0, BLOCK_T)
    cols = block * TILE + offs
    row_mask = rows < M
    mask = row_mask[:, None] & ((offs < TILE) & (cols < C))[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[None, :]
    values = tl.load(t_ptr + rows64 * stride_tm + cols64 * stride_tc, mask=mask,
                     other=0.0).to(tl.float32)
    scale = amax_to_scale(tl.max(tl.abs(values), axis=1), FP8_MAX, POW2)
    scaled = clamp_keeping_nan(values * scale[:, None], FP8_MAX)
    tl.store(q_ptr + rows64 * C + cols64, scaled.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_ptr + rows.to(tl.int64) * n_blocks + block, inverse(scale), mask=row_mask)


def quantize_row_tiles(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                       tile: int = 128, *, config: tuple[int, int] = ROW_TILES_CONFIG
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` (any float dtype, any strides) -> contiguous FP8 ``(M, C)`` and float32
    ``(M, cdiv(C, tile))`` factors: ``t[m, c] ~= data[m, c] * inv[m, c // tile]``.
    ``config``: the launch shape (rows per program, warps)."""
    if not use_triton(t) or t.numel() == 0:
        return quantize_row_tiles_reference(t, fp8_dtype, power_of_two, tile)
    M, C = t.shape
    blocks = cdiv(C, tile)
    data = fp8_buffer((M, C), t.device, fp8_dtype)
    inv = torch.empty(M, blocks, device=t.device, dtype=torch.float32)
    block_r, warps = config
    _quantize_row_tiles_kernel[(cdiv(M, block_r), blocks)](
        t, data, inv, M, C, t.stride(0), t.stride(1), blocks,
        FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, TILE=tile, BLOCK_R=block_r,
        BLOCK_T=next_power_of_2(tile), num_warps=warps,
    )
    return finish(data, fp8_dtype), inv


# --------------------------------------------------------------------------- weight blocks
def quantize_weight_blocks_reference(weight: torch.Tensor, fp8_dtype: torch.dtype,
                                     power_of_two: bool, block: int = 128
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, N, K)`` -> FP8 ``(G, N, K)`` and float32 ``(G, cdiv(N, block), cdiv(K, block))``
    factors: one scale per ``block x block`` tile of each expert (edge tiles partial)."""
    G, N, K = weight.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    padded = pad_to(pad_to(weight.float(), 1, block), 2, block)
    tiles = padded.view(G, nb, block, kb, block)
    amax = magnitudes(tiles).amax(dim=(2, 4)) if tiles.numel() else tiles.new_zeros(G, nb, kb)
    scale = scale_from_amax(amax, fp8_dtype, power_of_two)
    data = saturate(tiles, scale[:, :, None, :, None], fp8_dtype)
    return data.view(G, nb * block, kb * block)[:, :N, :K].contiguous(), 1.0 / scale


@kernel
@triton.jit
def _quantize_weight_blocks_kernel(w_ptr, q_ptr, inv_ptr, N, K, stride_wg, stride_wn, stride_wk,
                                   FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                                   BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """Expert ``pid0``, rows ``[pid1 * BLOCK, +BLOCK)`` of ``N`` x columns
    ``[pid2 * BLOCK, +BLOCK)`` of ``K``: one scale, ``inv[pid0, pid1, pid2]``; ``q`` is
    contiguous ``(G, N, K)``, ``BLOCK_P >= BLOCK``."""
    g = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    offs = tl.arange(0, BLOCK_P)
    ns = nb * BLOCK + offs
    ks = kb * BLOCK + offs
    mask = ((offs < BLOCK) & (ns < N))[:, None] & ((offs < BLOCK) & (ks < K))[None, :]
    ns64 = ns.to(tl.int64)[:, None]
    ks64 = ks.to(tl.int64)[None, :]
    values = tl.load(w_ptr + g * stride_wg + ns64 * stride_wn + ks64 * stride_wk, mask=mask,
                     other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(values), axis=1), axis=0)
    scale = amax_to_scale(amax, FP8_MAX, POW2)
    scaled = clamp_keeping_nan(values * scale, FP8_MAX)
    tl.store(q_ptr + g * N * K + ns64 * K + ks64, scaled.to(q_ptr.dtype.element_ty), mask=mask)
    n_blocks = tl.num_programs(1)
    k_blocks = tl.num_programs(2)
    tl.store(inv_ptr + (g * n_blocks + nb) * k_blocks + kb, inverse(scale))


def quantize_weight_blocks(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                           block: int = 128, *,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None,
                           config: tuple[int] = WEIGHT_BLOCKS_CONFIG
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, N, K)`` (any float dtype, any strides) -> contiguous FP8 ``(G, N, K)`` and
    float32 ``(G, cdiv(N, block), cdiv(K, block))`` factors:
    ``w[g, n, k] ~= data[g, n, k] * inv[g, n // block, k // block]``, written into ``out``
    (such a pair, contiguous) if given. ``config``: the launch shape (``(warps,)``)."""
    if not use_triton(weight) or weight.numel() == 0 or (out is not None
                                                          and weight.device.type == "cpu"):
        result = quantize_weight_blocks_reference(weight, fp8_dtype, power_of_two, block)
        if out is None:
            return result
        out[0].copy_(result[0])
        out[1].copy_(result[1])
        return out
    G, N, K = weight.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    if out is not None:
        data, inv = out
    else:
        data = fp8_buffer((G, N, K), weight.device, fp8_dtype)
        inv = torch.empty(G, nb, kb, device=weight.device, dtype=torch.float32)
    (warps,) = config
    _quantize_weight_blocks_kernel[(G, nb, kb)](
        weight, data, inv, N, K, weight.stride(0), weight.stride(1), weight.stride(2),
        FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, BLOCK=block,
        BLOCK_P=next_power_of_2(block), num_warps=warps,
    )
    return finish(data, fp8_dtype), inv


# --------------------------------------------------------------------------- token blocks
def num_token_blocks(num_rows: int, num_groups: int, tile: int = 128) -> int:
    """Rows of the token blocks' ``inv``: ``cdiv(M, tile) + G``, an upper bound on the
    blocks of any split of ``M`` rows into ``G`` groups (whatever the sizes)."""
    return cdiv(num_rows, tile) + num_groups


def token_block_index(sizes: torch.Tensor, num_rows: int, tile: int = 128) -> torch.Tensor:
    """``(M,)`` int64: the global token block of each row, without a host sync.

    Group ``g`` holds rows ``[start_g, end_g)`` (negative sizes count as 0, ends clamped
    to ``M``); its block ``i`` is rows ``[start_g + tile * i, min(start_g + tile * (i + 1),
    end_g))`` with global index ``sum_{h<g} cdiv(end_h - start_h, tile) + i``. Rows past
    the last group get :func:`num_token_blocks` (one past the last ``inv`` row)."""
    G = sizes.shape[0]
    device = sizes.device
    sizes64 = sizes.to(torch.int64).clamp(min=0)
    ends = sizes64.cumsum(0).clamp(max=num_rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = (ends - starts + tile - 1) // tile
    first_block = counts.cumsum(0) - counts
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    groups = torch.searchsorted(ends, rows, right=True)  # G for rows past the last group
    padded_starts = torch.cat([starts, starts.new_zeros(1)])
    padded_first = torch.cat([first_block, first_block.new_zeros(1)])
    index = padded_first[groups] + (rows - padded_starts[groups]) // tile
    return torch.where(groups < G, index, num_token_blocks(num_rows, G, tile))


def quantize_token_blocks_reference(t: torch.Tensor, sizes: torch.Tensor, fp8_dtype: torch.dtype,
                                    power_of_two: bool, tile: int = 128
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` and ``(G,)`` group sizes -> FP8 ``(M, C)`` (rows past the last group 0)
    and float32 ``(cdiv(M, tile) + G, C)`` factors, one per (token block, column) as
    :func:`token_block_index` numbers the blocks; unused rows of ``inv`` are 1."""
    M, C = t.shape
    blocks = num_token_blocks(M, sizes.shape[0], tile)
    index = token_block_index(sizes.to(t.device), M, tile)
    amax = torch.zeros(blocks + 1, C, device=t.device, dtype=torch.float32)
    amax.scatter_reduce_(0, index[:, None].expand(M, C), magnitudes(t).float(), "amax")
    scale = scale_from_amax(amax[:blocks], fp8_dtype, power_of_two)
    per_row = torch.cat([scale, torch.ones_like(scale[:1])]).index_select(0, index)
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = (t.float() * per_row).clamp(-fp8_max, fp8_max)
    data = scaled.masked_fill((index == blocks)[:, None], 0.0).to(fp8_dtype)
    return data, 1.0 / scale


@kernel
@triton.jit
def _quantize_token_blocks_kernel(t_ptr, sizes_ptr, q_ptr, inv_ptr, M, C, G, stride_tm, stride_tc,
                                  stride_qm, stride_qc, FP8_MAX: tl.constexpr,
                                  POW2: tl.constexpr, TILE: tl.constexpr,
                                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                                  BLOCK_G: tl.constexpr, BLOCK_LAYOUT: tl.constexpr):
    """Global block ``pid0`` x columns ``[pid1 * BLOCK_C, +BLOCK_C)``.

    Blocks are numbered group after group, then the tail (rows past the last group,
    cut into ``TILE`` rows too), then unused ones: a group's block gets one scale per
    column; a tail block writes zeros and ``inv`` 1; an unused block only ``inv`` 1.
    ``q[m, c]`` is at ``q_ptr + m * stride_qm + c * stride_qc``, ``inv``
    ``(cdiv(M, TILE) + G, C)``, ``BLOCK_G > G``. ``BLOCK_LAYOUT``: block ``b``'s rows go to
    ``b * TILE + [0, TILE)`` instead, all ``TILE`` of them (zeros past the group's end)."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    gs, starts, ends = group_rows(sizes_ptr, G, M, BLOCK_G)  # slot G: the tail
    counts = (ends - starts + TILE - 1) // TILE
    block_end = tl.cumsum(counts, axis=0)
    owner = (block_end - counts <= b) & (b < block_end)
    start = tl.sum(tl.where(owner, starts, 0), axis=0)
    end = tl.sum(tl.where(owner, ends, 0), axis=0)  # 0 for unused blocks: no rows
    local = b - tl.sum(tl.where(owner, block_end - counts, 0), axis=0)
    in_group = tl.sum(tl.where(owner & (gs < G), 1, 0), axis=0) > 0
    offs = tl.arange(0, BLOCK_T)
    rows = start + local * TILE + offs
    row_mask = (offs < TILE) & (rows < end)
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[None, :]
    values = tl.load(t_ptr + rows64 * stride_tm + cols64 * stride_tc, mask=mask & in_group,
                     other=0.0).to(tl.float32)
    scale = amax_to_scale(tl.max(tl.abs(values), axis=0), FP8_MAX, POW2)  # 1 outside groups
    scaled = clamp_keeping_nan(values * scale[None, :], FP8_MAX)
    if BLOCK_LAYOUT:
        slots = (b.to(tl.int64) * TILE + offs)[:, None]
        tl.store(q_ptr + slots * stride_qm + cols64 * stride_qc, scaled.to(q_ptr.dtype.element_ty),
                 mask=(offs < TILE)[:, None] & col_mask[None, :])
    else:
        tl.store(q_ptr + rows64 * stride_qm + cols64 * stride_qc,
                 scaled.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_ptr + b.to(tl.int64) * C + cols, inverse(scale), mask=col_mask)


def quantize_token_blocks(t: torch.Tensor, sizes: torch.Tensor, fp8_dtype: torch.dtype,
                          power_of_two: bool, tile: int = 128, transpose: bool = False, *,
                          config: tuple[int, int] = TOKEN_BLOCKS_CONFIG
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` (any float dtype, any strides) with rows split into groups by ``sizes``
    (``(G,)`` integers on ``t``'s device, never read on the host) -> FP8 data and float32
    ``(cdiv(M, tile) + G, C)`` factors, ``t[m, c] ~= data[m, c] * inv[b, c]`` with ``b =
    token_block_index(sizes, M, tile)[m]`` for rows of a group; unused rows of ``inv`` are 1.

    * ``transpose=False``: data ``(M, C)``, rows past the last group 0;
    * ``transpose=True``: the token-block layout the weight-gradient GEMM reads (it reduces
      over the tokens, which FP8 tensor cores want contiguous): data ``(C, (cdiv(M, tile)
      + G) * tile)``, block ``b`` at columns ``[b * tile, (b + 1) * tile)``, zeros past each
      group's end and in unused blocks (:func:`token_block_columns` maps rows to columns).

    ``config``: the launch shape (columns per program, warps).
    """
    M, C = t.shape
    G = sizes.shape[0]
    blocks = num_token_blocks(M, G, tile)
    if not use_triton(t) or t.numel() == 0:
        data, inv = quantize_token_blocks_reference(t, sizes, fp8_dtype, power_of_two, tile)
        if not transpose:
            return data, inv
        blocked = torch.zeros(C, blocks * tile, device=t.device, dtype=torch.float32)
        columns = token_block_columns(sizes.to(t.device), M, tile)
        used = columns >= 0
        blocked[:, columns[used]] = data[used].float().t()
        return blocked.to(fp8_dtype), inv
    sizes = sizes.to(t.device).contiguous()  # no-ops for sizes already on the device
    data = fp8_buffer((C, blocks * tile) if transpose else (M, C), t.device, fp8_dtype)
    stride_qm, stride_qc = (data.stride(1), data.stride(0)) if transpose else data.stride()
    inv = torch.empty(blocks, C, device=t.device, dtype=torch.float32)
    block_c, warps = config
    _quantize_token_blocks_kernel[(blocks, cdiv(C, block_c))](
        t, sizes, data, inv, M, C, G, t.stride(0), t.stride(1), stride_qm, stride_qc,
        FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, TILE=tile,
        BLOCK_T=next_power_of_2(tile), BLOCK_C=block_c,
        BLOCK_G=max(2, next_power_of_2(G + 1)), BLOCK_LAYOUT=transpose, num_warps=warps,
    )
    return finish(data, fp8_dtype), inv


def token_block_columns(sizes: torch.Tensor, num_rows: int, tile: int = 128) -> torch.Tensor:
    """``(M,)`` int64: the column of each row in the token-block layout
    (``quantize_token_blocks(transpose=True)``), -1 for rows past the last group."""
    index = token_block_index(sizes, num_rows, tile)
    sizes64 = sizes.to(torch.int64).clamp(min=0)
    ends = sizes64.cumsum(0).clamp(max=num_rows)
    rows = torch.arange(num_rows, device=sizes.device, dtype=torch.int64)
    groups = torch.searchsorted(ends, rows, right=True)
    starts = torch.cat([ends.new_zeros(1), ends])  # slot G: rows past the last group
    within = (rows - starts[groups]) % tile
    return torch.where(groups < sizes.shape[0], index * tile + within, -1)
