"""The weighted k-way combine of routed rows (unpermute's forward, permute's backward) and the
per-slot dot products of its weights' gradient, each in one pass without a host sync; the
combine can also keep the rows it reads as FP8 tiles, which the dots then read.
"""

import torch

from .._triton import cdiv, kernel, next_power_of_2, tl, triton
from ..quantize.blocks import dequantize_row_tiles, quantize_row_tiles_reference
from ..quantize.common import amax_to_scale, finish, fp8_buffer, inverse
from .rows import (
    _rows_kernel_ok,
    gather_rows_reference,
    next_slot_table,
    slot_options,
    slot_row,
    slot_table,
    weighted_dtype,
)

__all__ = ["combine_rows", "combine_rows_reference", "combine_rows_keeping_fp8", "slot_dots",
           "slot_dots_reference", "COMBINE_CONFIG", "SLOT_DOTS_CONFIG", "FP8_TILE"]

# Launch shape (tokens per program, columns per program, warps) of combine_rows: the default
# of its config= keyword; the layouts bench times it, benchmarks/layout_kernels.py others.
COMBINE_CONFIG = (2, 2048, 4)
# Launch shape (tokens per program, columns per step, warps) of slot_dots (the gradient of
# unpermute's weights). H200 sweep at hidden 4096 (65536 / 131072 slots): (8, 256, 4) 0.91 /
# 0.96 of copy, (1, 1024, 4) 0.90 / 0.96, the first guess (4, 1024, 4) 0.79 / 0.90.
SLOT_DOTS_CONFIG = (8, 256, 4)
# Columns per factor of the rows combine_rows_keeping_fp8 keeps in FP8.
FP8_TILE = 128


def combine_rows_reference(src: torch.Tensor, row_map: torch.Tensor,
                           weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[row_map[t, j]]`` in float32 (float64 where either
    input is), over the slots whose row lies inside ``src``; output in ``src``'s dtype."""
    tokens, k = row_map.shape
    rows = gather_rows_reference(src, row_map.reshape(-1)).view(tokens, k, *src.shape[1:])
    if weights is None and src.dtype in _SUMMED_AS_IS:
        return rows.sum(dim=1)  # torch sums 16-bit floats in float32, rounding once
    acc = weighted_dtype(src, weights)
    rows = rows.to(acc)
    if weights is not None:
        valid = (row_map >= 0) & (row_map < src.shape[0])
        weights = weights.to(acc).masked_fill(~valid, 0)
        rows = rows * weights.view(tokens, k, *([1] * (src.dim() - 1)))
    return rows.sum(dim=1).to(src.dtype)


_SUMMED_AS_IS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@triton.jit
def _add_slot(acc, src_ptr, weights_ptr, codes_ptr, factors_ptr, row, valid, slot, cols, col_mask,
              R_src, H, stride_src, stride_factors, HAS_WEIGHTS: tl.constexpr,
              KEEP: tl.constexpr, FP8_MAX: tl.constexpr, TILE: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    values = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :],
                     mask=valid[:, None] & col_mask, other=0.0).to(tl.float32)
    if KEEP:
        tiles = tl.reshape(values, [BLOCK_T, BLOCK_H // TILE, TILE])
        scale = amax_to_scale(tl.max(tl.abs(tiles), axis=2), FP8_MAX, False)
        codes = tl.reshape(tl.clamp(tiles * scale[:, :, None], -FP8_MAX, FP8_MAX),
                           [BLOCK_T, BLOCK_H])
        tl.store(codes_ptr + row[:, None] * stride_src + cols[None, :],
                 codes.to(codes_ptr.dtype.element_ty), mask=valid[:, None] & col_mask)
        tile = tl.program_id(1) * (BLOCK_H // TILE) + tl.arange(0, BLOCK_H // TILE)
        tl.store(factors_ptr + row[:, None] * stride_factors + tile[None, :], inverse(scale),
                 mask=valid[:, None] & (tile * TILE < H)[None, :])
    if HAS_WEIGHTS:
        weight = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        values = values * weight[:, None]
    return acc + values


@kernel
@triton.jit
def _combine_rows_kernel(src_ptr, dst_ptr, map_ptr, weights_ptr, codes_ptr, factors_ptr, T, K,
                         R_src, H, stride_src, stride_dst, stride_factors,
                         HAS_WEIGHTS: tl.constexpr, KEEP: tl.constexpr, FP8_MAX: tl.constexpr,
                         TILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         SPARSE: tl.constexpr, K_CHUNK: tl.constexpr):
    """``KEEP``: also each routed row's FP8 codes (row-major like ``src``) and the float32
    factor of each of its ``TILE``-column tiles, from the same read. ``SPARSE`` (many slots
    per token, most unused, as a routing map's): the block's slots are loaded a chunk at a
    time and a slot no token of the block uses is skipped; otherwise every slot is read in a loop
    without branches (a branch per slot made the top-k combine 9-19 % slower, H200)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    token_mask = tokens < T
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    table = slot_table(map_ptr, tokens, token_mask, 0, K, SPARSE, K_CHUNK)
    for j in range(0, K):  # fixed slot order: deterministic
        slot = tokens.to(tl.int64) * K + j
        table = next_slot_table(table, map_ptr, tokens, token_mask, j, K, SPARSE, K_CHUNK)
        row = slot_row(map_ptr, table, tokens, token_mask, j, K, SPARSE, K_CHUNK)
        valid = (row >= 0) & (row < R_src)
        if SPARSE:  # a slot no token of the block uses costs a branch only
            used = tl.max(valid.to(tl.int32), axis=0) > 0
        else:
            used = True
        if used:
            acc = _add_slot(acc, src_ptr, weights_ptr, codes_ptr, factors_ptr, row, valid,
                            slot, cols, col_mask, R_src, H, stride_src, stride_factors,
                            HAS_WEIGHTS, KEEP, FP8_MAX, TILE, BLOCK_T, BLOCK_H)
    tl.store(dst_ptr + tokens.to(tl.int64)[:, None] * stride_dst + cols[None, :],
             acc.to(dst_ptr.dtype.element_ty), mask=token_mask[:, None] & col_mask)


def combine_rows(src: torch.Tensor, row_map: torch.Tensor,
                 weights: torch.Tensor | None, *,
                 config: tuple[int, int, int] = COMBINE_CONFIG) -> torch.Tensor:
    """``(R_src, H)`` -> ``(T, H)``: ``sum_j weights[t, j] * src[row_map[t, j]]`` over the
    slots whose row lies in ``src``, accumulated in float32 in slot order. One read of
    the routed rows, one write. ``config``: the launch shape (tokens per program, columns
    per program, warps)."""
    if not _combine_kernel_ok(src, row_map, weights):
        return combine_rows_reference(src, row_map, weights)
    block_t, block_h, warps = config
    block_h = min(block_h, next_power_of_2(src.shape[1]))
    return _combine(src, row_map, weights, None, block_t, block_h, warps)[0]


def _combine_kernel_ok(src, row_map, weights) -> bool:
    return (_rows_kernel_ok(src) and row_map.numel() > 0 and src.shape[0] > 0
            and (weights is None or weights.dtype != torch.float64))


def _combine(src, row_map, weights, keep, block_t, block_h, warps):
    tokens, k = row_map.shape
    (R, H), cpu = src.shape, src.device.type == "cpu"
    # Triton 3.6's CPU interpreter rounds float32 -> bf16 and FP8 wrongly: there the kernel
    # writes float32 and torch rounds.
    out = torch.empty(tokens, H, device=src.device, dtype=torch.float32 if cpu else src.dtype)
    codes = factors = None
    if keep is not None:
        codes = fp8_buffer((R, H), src.device, keep)
        factors = torch.empty(R, cdiv(H, FP8_TILE), device=src.device, dtype=torch.float32)
    _combine_rows_kernel[(cdiv(tokens, block_t), cdiv(H, block_h))](
        src, out, row_map.contiguous(), weights.contiguous() if weights is not None else src,
        codes if codes is not None else out, factors if factors is not None else out,
        tokens, k, R, H, src.stride(0), out.stride(0),
        factors.stride(0) if factors is not None else 0, HAS_WEIGHTS=weights is not None,
        KEEP=keep is not None, FP8_MAX=torch.finfo(keep).max if keep is not None else 1.0,
        TILE=FP8_TILE, BLOCK_T=block_t, BLOCK_H=block_h, **slot_options(k), num_warps=warps)
    return out.to(src.dtype), (None if keep is None else finish(codes, keep)), factors


def combine_rows_keeping_fp8(src: torch.Tensor, row_map: torch.Tensor,
                             weights: torch.Tensor | None, fp8_dtype: torch.dtype
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`combine_rows`, and from the same read each routed row of ``src`` in FP8:
    ``codes`` ``(R_src, H)`` in ``fp8_dtype`` and ``factors`` ``(R_src, cdiv(H, 128))``
    float32, ``src[r, c] ~ codes[r, c] * factors[r, c // 128]`` (each 128-column tile
    scaled onto the format's range). Rows no slot holds are left unwritten in both."""
    if not _combine_kernel_ok(src, row_map, weights):
        out = combine_rows_reference(src, row_map, weights)
        return (out, *quantize_row_tiles_reference(src, fp8_dtype, False, FP8_TILE))
    block_t, block_h, warps = COMBINE_CONFIG  # whole tiles per program
    block_h = max(FP8_TILE, min(block_h, next_power_of_2(src.shape[1])))
    return _combine(src, row_map, weights, fp8_dtype, block_t, block_h, warps)


def slot_dots_reference(src: torch.Tensor, grad: torch.Tensor, row_map: torch.Tensor,
                        acc_dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch :func:`slot_dots`: a gather of the slots' rows, then products summed in
    ``acc_dtype``."""
    tokens, k = row_map.shape
    flat = row_map.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < src.shape[0])
    rows = gather_rows_reference(src, torch.where(valid, flat, -1)).view(tokens, k, src.shape[1])
    dots = (rows.to(acc_dtype) * grad.reshape(tokens, 1, src.shape[1]).to(acc_dtype)).sum(-1)
    return dots.masked_fill_(~valid.view(tokens, k), 0)


@kernel
@triton.jit
def _slot_dots_kernel(src_ptr, grad_ptr, map_ptr, out_ptr, factors_ptr, T, K, R_src, H,
                      stride_src, stride_grad, stride_factors, HAS_FACTORS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t, j] = sum_h src[row_map[t, j], h] * grad[t, h]`` in float32 for a block of
    tokens: each gradient row read once, each slot's row once (slots in order: deterministic).
    ``HAS_FACTORS``: ``src`` holds codes, each ``BLOCK_H``-column tile times its factor."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < T
    slot_ids = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_mask = (cols < H)[None, :]
        grad = tl.load(grad_ptr + tokens.to(tl.int64)[:, None] * stride_grad + cols[None, :],
                       mask=token_mask[:, None] & col_mask, other=0.0).to(tl.float32)
        for j in range(0, K):
            row = tl.load(map_ptr + tokens.to(tl.int64) * K + j, mask=token_mask,
                          other=-1).to(tl.int64)
            valid = (row >= 0) & (row < R_src)
            values = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :],
                             mask=valid[:, None] & col_mask, other=0.0).to(tl.float32)
            dot = tl.sum(values * grad, axis=1)
            if HAS_FACTORS:
                dot *= tl.load(factors_ptr + row * stride_factors + h0 // BLOCK_H, mask=valid,
                               other=0.0)
            acc += tl.where(slot_ids[None, :] == j, dot[:, None], 0.0)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * K + slot_ids[None, :], acc,
             mask=token_mask[:, None] & (slot_ids < K)[None, :])


def slot_dots(src: torch.Tensor, grad: torch.Tensor, row_map: torch.Tensor,
              acc_dtype: torch.dtype = torch.float32, *,
              factors: torch.Tensor | None = None,
              config: tuple[int, int, int] = SLOT_DOTS_CONFIG) -> torch.Tensor:
    """``(T, k)`` in ``acc_dtype``: ``sum_h src[row_map[t, j], h] * grad[t, h]`` for every
    slot, 0 where the slot's row lies outside ``src`` (``-1``: dropped). The gradient of
    ``unpermute``'s weights: one read of ``grad`` and of each slot's row, no gathered copy.
    ``src`` ``(R, H)``, ``grad`` ``(T, H)``; float32 accumulation runs in one kernel,
    ``float64`` in plain PyTorch. ``config``: the launch shape (tokens per program, columns
    per step, warps). ``factors``: ``src`` is FP8 codes with these 128-column tile factors
    (:func:`combine_rows_keeping_fp8`), the dots taken of their dequantized values."""
    tokens, k = row_map.shape
    if factors is not None and src.device.type == "cpu":
        src = src.float()  # the interpreter reads no FP8
    if (acc_dtype != torch.float32 or not _rows_kernel_ok(src) or grad.stride(-1) != 1
            or tokens == 0 or k == 0 or src.shape[0] == 0 or k > 64):
        if factors is not None:
            src = dequantize_row_tiles(src, factors, FP8_TILE)
        return slot_dots_reference(src, grad, row_map, acc_dtype)
    H = src.shape[1]
    out = torch.empty(tokens, k, device=src.device, dtype=torch.float32)
    block_k = next_power_of_2(k)
    block_t, block_h, warps = config
    _slot_dots_kernel[(cdiv(tokens, block_t),)](
        src, grad, row_map.contiguous(), out, factors if factors is not None else out, tokens,
        k, src.shape[0], H, src.stride(0), grad.stride(0),
        factors.stride(0) if factors is not None else 0, HAS_FACTORS=factors is not None,
        BLOCK_T=block_t, BLOCK_K=block_k,
        BLOCK_H=FP8_TILE if factors is not None else min(block_h, next_power_of_2(H)),
        num_warps=warps)
    return out
