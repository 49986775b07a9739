"""FP8 grouped GEMMs in Triton: 128-block scales, any group size.

Operands are FP8 data with float32 dequantization factors (``1 / scale``):

* :func:`grouped_mm` (forward and dgrad): ``out[rows of g] = A[rows of g] @ B_g`` with
  ``A`` ``(M, R)`` and ``B_g`` ``(R, W)`` read through strides (the ``(G, N, K)`` weight
  serves as ``B_g = W_g^T`` in forward and as ``W_g`` in dgrad). ``a_inv`` ``(M, R/128)``
  (1x128 tiles of ``A``), ``b_inv`` one factor per 128x128 block of the weight, addressed
  through strides: each 128-deep step's partial product is rescaled before it is
  accumulated (fp32).

  Persistent over the (group, row tile, column tile) list, so skewed and empty groups
  cost nothing; rows past the last group are written as zeros.
* :func:`blockwise_wgrad`: ``dW_g = dy_g^T @ x_g`` with both operands scaled per (block of
  128 tokens of the group, column), blocks numbered across groups in order and stored
  token-contiguous, one whole zero-padded block each (the token-block layout): the
  GEMM reads whole blocks without masks along the tokens it reduces over. With
  ``group_scales`` the factors are per (group, column) (the rowwise recipes' wgrad
  operands quantized with 128-token group alignment), applied once after the reduction.

The references are float32 matmuls of the dequantized operands
(:func:`grouped_mm_reference`, :func:`blockwise_wgrad_reference`). On CPU (Triton's
interpreter) the FP8 data is passed as float32 holding the same values.
"""

from __future__ import annotations

import torch

from .._groups import group_rows, tile_list, tile_origin
from .._triton import cdiv, kernel, next_power_of_2, sm_count, tl, triton

__all__ = ["grouped_mm", "grouped_mm_reference", "blockwise_wgrad", "blockwise_wgrad_reference",
           "BLOCK"]

BLOCK = 128  # the scaling block: 1x128 token tiles, 128x128 weight blocks, 128x1 wgrad tiles
# K step of the forward/dgrad kernel (divides BLOCK): one dot per 128-deep scale block ran
# 635-759 TFLOP/s against 584-701 in 64-deep steps on the H200; no register spills on sm90
# (ptxas -v). The wgrad's token step on CPU (GPUs: the shapes below).
MM_BLOCK_K = 128
WGRAD_BLOCK_T = 64
# Launch shapes on GPUs: (rows per tile, warps, pipeline stages) of forward/dgrad and
# (warps, stages, tokens per step, N tile, K tile) of the blockwise wgrad; module-level so
# benchmarks/fp8_gemm.py can sweep them.
MM_CONFIG = (128, 8, 3)
WGRAD_CONFIG = (8, 3, 128, 128, 128)  # 429-559 against 402-521 TFLOP/s in 64-token steps
# The group-scaled wgrad (one factor per group and row, no per-block rescale): (warps,
# stages, tokens per step, N tile, K tile). Each 128-token step is added into float32 (see
# _dot); that holds a second accumulator, so the tile is 256 x 128 (N x K), not 128 x 256:
# on Mixtral fc1 / fc2 / DeepSeek-V3 fc1 / Qwen3 fc1 operands 867 / 802 / 870 / 698 TFLOP/s
# against 226 / 212 / 345 / 359 for 128 x 256 (which spills both accumulators).
GROUP_SCALED_WGRAD_CONFIG = (8, 3, 128, 256, 128)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PROMOTE: tl.constexpr = 0):
    """``acc + a @ b`` in float32 (``UPCAST``: FP8 values held as float32, interpreter).
    ``PROMOTE``: Hopper's FP8 MMAs add into their accumulator with about 14 bits kept; with
    ``PROMOTE = n`` the products of every ``n`` reduced elements are added to ``acc`` in
    full float32, so that a long reduction into one accumulator stays exact to float32
    (else the tensor cores' default: all of it in their own precision)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if PROMOTE:
        return tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
    return tl.dot(a, b, acc)


@triton.jit
def _load_k_tile(base, tile_offsets, mask, k_mask, EVEN_K: tl.constexpr):
    """One operand tile; ``EVEN_K``: the reduced dimension has no ragged end, so only the
    row/column mask applies (a load masked along both dimensions is not software-pipelined
    by Triton 3.6 on sm90)."""
    if EVEN_K:
        return tl.load(base + tile_offsets, mask=mask, other=0.0)
    return tl.load(base + tile_offsets, mask=mask & k_mask, other=0.0)


@kernel
@triton.jit
def _fp8_grouped_mm_kernel(a_ptr, a_inv_ptr, b_ptr, b_inv_ptr, out_ptr, sizes_ptr, M, W, R, G,
                           stride_am, stride_ai, stride_bg, stride_br, stride_bw, stride_big,
                           stride_bir, stride_biw, stride_om, UPCAST: tl.constexpr,
                           EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                           NUM_PROGRAMS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    gs, starts, ends, tile_begin, tile_end, total = tile_list(sizes_ptr, G, M, W, BLOCK_M,
                                                              BLOCK_N, BLOCK_G)
    for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end, W,
                                             BLOCK_M, BLOCK_N)
        col0 = col_tile * BLOCK_N
        # int64 scalar bases, int32 ends inside the tile: 64-bit pointer tensors live
        # across the K loop would not fit in registers (ptxas spills).
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_mask = rows < (end - row0).to(tl.int32)
        col_mask = cols < (W - col0).to(tl.int32)
        a_offsets = rows[:, None] * stride_am + ks[None, :]
        b_offsets = ks[:, None] * stride_br + cols[None, :] * stride_bw
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if g < G:
            a_base = a_ptr + row0.to(tl.int64) * stride_am
            b_base = b_ptr + g.to(tl.int64) * stride_bg + col0.to(tl.int64) * stride_bw
            # BLOCK_N == SCALE_BLOCK == the weight block; BLOCK_K divides it
            for kb in range(0, tl.cdiv(R, SCALE_BLOCK)):
                # the block's partial product in float32, rescaled once per block
                step = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(0, SCALE_BLOCK, BLOCK_K):
                    k0 = kb * SCALE_BLOCK + j
                    a = _load_k_tile(a_base + k0, a_offsets, row_mask[:, None],
                                     (k0 + ks < R)[None, :], EVEN_K)
                    b = _load_k_tile(b_base + k0 * stride_br, b_offsets, col_mask[None, :],
                                     (k0 + ks < R)[:, None], EVEN_K)
                    step = _dot(a, b, step, UPCAST)
                a_scale = tl.load(a_inv_ptr + (row0 + rows).to(tl.int64) * stride_ai + kb,
                                  mask=row_mask, other=0.0)
                b_scale = tl.load(b_inv_ptr + g.to(tl.int64) * stride_big + kb * stride_bir
                                  + col_tile * stride_biw)
                acc += step * (a_scale[:, None] * b_scale)
        out = out_ptr + (row0.to(tl.int64) * stride_om + col0) + (rows[:, None] * stride_om + cols[None, :])
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@kernel
@triton.jit
def _fp8_blockwise_wgrad_kernel(dy_ptr, dy_inv_ptr, x_ptr, x_inv_ptr, dw_ptr, sizes_ptr, M, N, K, G,
                                stride_dyn, stride_xk, stride_dyi, stride_xi, stride_dwg,
                                stride_dwn, UPCAST: tl.constexpr, GROUP_SCALES: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                                SCALE_BLOCK: tl.constexpr):
    """One (group, N tile, K tile) of ``dW_g = dy_g^T x_g`` from operands in the token-block
    layout (``(C, blocks * SCALE_BLOCK)``, block ``b`` at columns ``[b, b + 1) * SCALE_BLOCK``,
    zero past each group's end): whole blocks, no mask along the tokens. Each block's
    partial product (steps of ``BLOCK_T`` tokens) is rescaled once by its factors; with
    ``GROUP_SCALES`` the factors are per (group, column) (rowwise recipes: ``dy_inv``
    ``(G, N)``, ``x_inv`` ``(G, K)``), constant along the reduction, applied once at the end."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    g = pid // (n_tiles * k_tiles)
    n0 = ((pid // k_tiles) % n_tiles) * BLOCK_N
    k0 = (pid % k_tiles) * BLOCK_K
    offs_n = tl.arange(0, BLOCK_N)  # int32 ends inside the tile, int64 bases
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    n_mask = offs_n < N - n0
    k_mask = offs_k < K - k0
    gs, starts, ends = group_rows(sizes_ptr, G, M, BLOCK_G)
    blocks = tl.where(gs < G, (ends - starts + SCALE_BLOCK - 1) // SCALE_BLOCK, 0)
    first_block = tl.sum(tl.where(gs == g, tl.cumsum(blocks, axis=0) - blocks, 0), axis=0)
    n_blocks = tl.sum(tl.where(gs == g, blocks, 0), axis=0).to(tl.int32)
    dy_rows = dy_ptr + n0.to(tl.int64) * stride_dyn
    x_rows = x_ptr + k0.to(tl.int64) * stride_xk
    dy_offsets = offs_n[:, None] * stride_dyn + offs_t[None, :]  # (BLOCK_N, BLOCK_T)
    x_offsets = offs_t[:, None] + offs_k[None, :] * stride_xk  # (BLOCK_T, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GROUP_SCALES:
        for i in range(0, n_blocks):  # an int32 counter: Triton pipelines this loop
            t0 = (first_block + i).to(tl.int64) * SCALE_BLOCK
            for j in tl.static_range(0, SCALE_BLOCK, BLOCK_T):
                dy_t = tl.load(dy_rows + (t0 + j) + dy_offsets, mask=n_mask[:, None], other=0.0)
                x = tl.load(x_rows + (t0 + j) + x_offsets, mask=k_mask[None, :], other=0.0)
                acc = _dot(dy_t, x, acc, UPCAST, BLOCK_T)  # promoted every BLOCK_T tokens
        row = g.to(tl.int64)
        dy_scale = tl.load(dy_inv_ptr + (row * stride_dyi + n0) + offs_n, mask=n_mask, other=0.0)
        x_scale = tl.load(x_inv_ptr + (row * stride_xi + k0) + offs_k, mask=k_mask, other=0.0)
        acc = acc * (dy_scale[:, None] * x_scale[None, :])
    else:
        for i in range(0, n_blocks):  # an int32 counter: Triton pipelines this loop
            block = (first_block + i).to(tl.int64)
            t0 = block * SCALE_BLOCK
            step = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(0, SCALE_BLOCK, BLOCK_T):
                dy_t = tl.load(dy_rows + (t0 + j) + dy_offsets, mask=n_mask[:, None], other=0.0)
                x = tl.load(x_rows + (t0 + j) + x_offsets, mask=k_mask[None, :], other=0.0)
                step = _dot(dy_t, x, step, UPCAST)
            dy_scale = tl.load(dy_inv_ptr + (block * stride_dyi + n0) + offs_n, mask=n_mask,
                               other=0.0)
            x_scale = tl.load(x_inv_ptr + (block * stride_xi + k0) + offs_k, mask=k_mask,
                              other=0.0)
            acc += step * (dy_scale[:, None] * x_scale[None, :])
    dw = dw_ptr + (g.to(tl.int64) * stride_dwg + n0.to(tl.int64) * stride_dwn + k0) \
        + (offs_n[:, None] * stride_dwn + offs_k[None, :])
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _operand(t: torch.Tensor) -> torch.Tensor:
    """FP8 data as the kernels read it: float32 on CPU (the interpreter has no FP8)."""
    return t.float() if t.device.type == "cpu" else t


def grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, weight: torch.Tensor, w_inv: torch.Tensor,
               sizes: torch.Tensor, *, transpose_weight: bool,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 ``A`` ``(M, R)`` times each group's weight, ``(M, W)`` in ``out_dtype``.

    Args:
        a, a_inv: FP8 ``(M, R)``; factors ``(M, cdiv(R, 128))``.
        weight, w_inv: FP8 ``(G, N, K)``; factors ``(G, cdiv(N, 128), cdiv(K, 128))``.
        sizes: ``(G,)`` group sizes on the device (clamped in the kernel).
        transpose_weight: ``True`` for forward (``B_g = W_g^T``, ``R = K``, ``W = N``),
            ``False`` for dgrad (``B_g = W_g``, ``R = N``, ``W = K``).
    """
    M, R = a.shape
    G = weight.shape[0]
    width = weight.shape[1] if transpose_weight else weight.shape[2]
    out = torch.empty(M, width, device=a.device, dtype=out_dtype)
    if M == 0 or width == 0:
        return out
    a, weight = _operand(a), _operand(weight)
    if transpose_weight:  # B_g[r, w] = W_g[w, r]
        b_strides = (weight.stride(0), weight.stride(2), weight.stride(1))
        s_strides = (w_inv.stride(0), w_inv.stride(2), w_inv.stride(1))
    else:  # B_g[r, w] = W_g[r, w]
        b_strides = (weight.stride(0), weight.stride(1), weight.stride(2))
        s_strides = (w_inv.stride(0), w_inv.stride(1), w_inv.stride(2))
    block_m, warps, stages = (64, 4, 1) if a.device.type == "cpu" else MM_CONFIG
    upper_tiles = (cdiv(M, block_m) + G + 1) * cdiv(width, BLOCK)
    programs = max(1, min(sm_count(a.device), upper_tiles))
    a_inv = a_inv.contiguous()
    _fp8_grouped_mm_kernel[(programs,)](
        a, a_inv, weight, w_inv, out, sizes, M, width, R, G,
        a.stride(0), a_inv.stride(0), *b_strides, *s_strides, out.stride(0),
        UPCAST=a.device.type == "cpu", EVEN_K=R % BLOCK == 0,
        BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=MM_BLOCK_K, BLOCK_G=next_power_of_2(G + 1),
        NUM_PROGRAMS=programs, SCALE_BLOCK=BLOCK, num_warps=warps, num_stages=stages,
    )
    return out


def _spread(inv: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """One factor per 128 entries along ``dim`` -> one per entry (``size`` of them)."""
    return inv.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, size)


def grouped_mm_reference(a, a_inv, weight, w_inv, sizes, *, transpose_weight: bool,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`grouped_mm` in plain PyTorch: a float32 matmul of the dequantized operands."""
    a_f = a.float() * _spread(a_inv, 1, a.shape[1])
    w_factors = _spread(_spread(w_inv, 1, weight.shape[1]), 2, weight.shape[2])
    w_f = weight.float() * w_factors
    ends = sizes.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=a.shape[0]).tolist()
    width = weight.shape[1] if transpose_weight else weight.shape[2]
    out = a_f.new_zeros(a.shape[0], width)
    start = 0
    for g, end in enumerate(ends):
        b = w_f[g].t() if transpose_weight else w_f[g]
        out[start:end] = a_f[start:end] @ b
        start = end
    return out.to(out_dtype)


def blockwise_wgrad(dy_blocks: torch.Tensor, dy_inv: torch.Tensor, x_blocks: torch.Tensor,
                    x_inv: torch.Tensor, sizes: torch.Tensor, num_rows: int,
                    out_dtype: torch.dtype = torch.bfloat16, *,
                    group_scales: bool = False) -> torch.Tensor:
    """``(G, N, K)``: ``dW_g = dy_g^T @ x_g`` from FP8 operands in the token-block layout of
    :func:`grouped_linear.kernels.quantize.blocks.quantize_token_blocks` (``transpose=True``)
    or, with ``group_scales``, of
    :func:`grouped_linear.kernels.quantize.transposed.quantize_group_columns_t` with
    ``align=128`` (the same layout, one factor per group and row):

    Args:
        dy_blocks, x_blocks: ``(N, T)`` / ``(K, T)``, unit stride along ``T``; block ``b``
            (numbered group after group: ``sum_{h<g} cdiv(size_h, 128) + i`` for block ``i``
            of group ``g``) at columns ``[128 b, 128 b + 128)``, zeros past a group's end.
        dy_inv, x_inv: ``(blocks, N)`` / ``(blocks, K)`` float32 factors per block and row,
            or ``(G, N)`` / ``(G, K)`` per group and row with ``group_scales``.
        sizes: ``(G,)`` group sizes on the device, clamped to ``num_rows`` tokens in all.
    """
    N, K, G = dy_blocks.shape[0], x_blocks.shape[0], sizes.shape[0]
    dw = torch.empty(G, N, K, device=dy_blocks.device, dtype=out_dtype)
    if N == 0 or K == 0 or G == 0:
        return dw.zero_()
    for name, t in (("dy_blocks", dy_blocks), ("x_blocks", x_blocks)):
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"{name} must have unit stride along the tokens, got strides "
                             f"{tuple(t.stride())}")
    cpu = dy_blocks.device.type == "cpu"
    if cpu:
        warps, stages, block_t, block_n, block_k = 4, 1, WGRAD_BLOCK_T, 64, 64
    else:
        warps, stages, block_t, block_n, block_k = (GROUP_SCALED_WGRAD_CONFIG if group_scales
                                                    else WGRAD_CONFIG)
    grid = (G * cdiv(N, block_n) * cdiv(K, block_k),)
    dy_blocks, x_blocks = _operand(dy_blocks), _operand(x_blocks)
    _fp8_blockwise_wgrad_kernel[grid](
        dy_blocks, dy_inv, x_blocks, x_inv, dw, sizes, num_rows, N, K, G, dy_blocks.stride(0),
        x_blocks.stride(0), dy_inv.stride(0), x_inv.stride(0), dw.stride(0), dw.stride(1),
        UPCAST=cpu, GROUP_SCALES=group_scales, BLOCK_T=block_t, SCALE_BLOCK=BLOCK,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_G=next_power_of_2(G + 1), num_warps=warps, num_stages=stages,
    )
    return dw


def blockwise_wgrad_reference(dy_blocks, dy_inv, x_blocks, x_inv, sizes, num_rows,
                              out_dtype=torch.bfloat16, *, group_scales=False):
    ends = sizes.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=num_rows).tolist()
    out = torch.zeros(sizes.shape[0], dy_blocks.shape[0], x_blocks.shape[0],
                      dtype=torch.promote_types(dy_inv.dtype, torch.float32),
                      device=dy_blocks.device)  # float64 factors: a float64 reference
    start, block = 0, 0
    for g, end in enumerate(ends):
        for _ in range(start, end, BLOCK):
            cols = slice(block * BLOCK, (block + 1) * BLOCK)
            factor = g if group_scales else block
            dy_b = dy_blocks[:, cols].float() * dy_inv[factor][:, None]
            x_b = x_blocks[:, cols].float() * x_inv[factor][:, None]
            out[g] += dy_b @ x_b.t()
            block += 1
        start = end
    return out.to(out_dtype)
