"""FP8 grouped GEMMs in Triton: rowwise or 128-block scales, any group size.

Operands are FP8 data with float32 dequantization factors (``1 / scale``):

* :func:`grouped_mm` (forward and dgrad): ``out[rows of g] = A[rows of g] @ B_g`` with
  ``A`` ``(M, R)`` and ``B_g`` ``(R, W)`` read through strides (the ``(G, N, K)`` weight
  serves as ``B_g = W_g^T`` in forward and as ``W_g`` in dgrad). Scales:

  - ``"rowwise"``: ``a_inv`` ``(M,)``, ``b_inv`` ``(G, W)``: applied once, in the epilogue;
  - ``"blockwise"``: ``a_inv`` ``(M, R/128)`` (1x128 tiles of ``A``), ``b_inv`` one factor
    per 128x128 block of the weight, addressed through strides: each 128-deep step's
    partial product is rescaled before it is accumulated (fp32).

  Persistent over the (group, row tile, column tile) list, so skewed and empty groups
  cost nothing; rows past the last group are written as zeros.
* :func:`blockwise_wgrad`: ``dW_g = dy_g^T @ x_g`` with both operands scaled per (block of
  128 tokens of the group, column), blocks numbered across groups in order.

The references are float32 matmuls of the dequantized operands
(:func:`grouped_mm_reference`, :func:`blockwise_wgrad_reference`). On CPU (Triton's
interpreter) the FP8 data is passed as float32 holding the same values.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .triton_gemm import _group_rows, _program_count, _tile_list, _tile_origin

__all__ = ["grouped_mm", "grouped_mm_reference", "blockwise_wgrad", "blockwise_wgrad_reference",
           "BLOCK"]

BLOCK = 128  # the scaling block: 1x128 token tiles, 128x128 weight blocks, 128x1 wgrad tiles
# K steps of the forward/dgrad and the wgrad kernels (each divides BLOCK): with them the
# 128x128 tiles compile with (almost) no register spills on sm90
# (benchmarks/kernel_resources.py).
MM_BLOCK_K = 64
WGRAD_BLOCK_T = 64
# Launch shapes on GPUs: (rows per tile, warps, pipeline stages) of forward/dgrad and
# (warps, stages) of the wgrad; module-level so benchmarks/fp8_gemm.py can sweep them.
MM_CONFIG = (128, 8, 3)
WGRAD_CONFIG = (8, 3)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32 (``UPCAST``: FP8 values held as float32, interpreter)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _fp8_grouped_mm_kernel(a_ptr, a_inv_ptr, b_ptr, b_inv_ptr, out_ptr, sizes_ptr, M, W, R, G,
                           stride_am, stride_ai, stride_bg, stride_br, stride_bw, stride_big,
                           stride_bir, stride_biw, stride_om, BLOCKWISE: tl.constexpr,
                           UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                           NUM_PROGRAMS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    gs, starts, ends, tile_begin, tile_end, total = _tile_list(sizes_ptr, G, M, W, BLOCK_M,
                                                               BLOCK_N, BLOCK_G)
    for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
        g, end, row0, col_tile = _tile_origin(tile, gs, starts, ends, tile_begin, tile_end, W,
                                              BLOCK_M, BLOCK_N)
        col0 = col_tile * BLOCK_N
        # int64 scalar bases, int32 offsets inside the tile: 64-bit pointer tensors live
        # across the K loop would not fit in registers (ptxas spills; see NOTES.md).
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < (end - row0).to(tl.int32)
        col_mask = cols < (W - col0).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if g < G:
            a_base = a_ptr + row0.to(tl.int64) * stride_am
            b_base = b_ptr + g.to(tl.int64) * stride_bg + col0.to(tl.int64) * stride_bw
            for k0 in range(0, R, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < R
                a = tl.load(a_base + (rows[:, None] * stride_am + ks[None, :]),
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_base + (ks[:, None] * stride_br + cols[None, :] * stride_bw),
                            mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if BLOCKWISE:  # BLOCK_N == 128 == the weight block; BLOCK_K divides 128
                    kb = k0 // SCALE_BLOCK
                    a_scale = tl.load(a_inv_ptr + (row0 + rows).to(tl.int64) * stride_ai + kb,
                                      mask=row_mask, other=0.0)
                    b_scale = tl.load(b_inv_ptr + g.to(tl.int64) * stride_big + kb * stride_bir
                                      + col_tile * stride_biw)
                    step = _dot(a, b, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST)
                    acc += step * (a_scale[:, None] * b_scale)
                else:
                    acc = _dot(a, b, acc, UPCAST)
            if not BLOCKWISE:
                a_scale = tl.load(a_inv_ptr + row0.to(tl.int64) + rows, mask=row_mask, other=0.0)
                b_scale = tl.load(b_inv_ptr + g.to(tl.int64) * stride_big + (col0 + cols) * stride_biw,
                                  mask=col_mask, other=0.0)
                acc = acc * a_scale[:, None] * b_scale[None, :]
        out = out_ptr + (row0.to(tl.int64) * stride_om + col0) + (rows[:, None] * stride_om + cols[None, :])
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_blockwise_wgrad_kernel(dy_ptr, dy_inv_ptr, x_ptr, x_inv_ptr, dw_ptr, sizes_ptr, M, N, K, G,
                                stride_dym, stride_dyn, stride_xm, stride_xk, stride_dyi, stride_xi,
                                stride_dwg, stride_dwn, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_G: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """One (group, N tile, K tile): the group's tokens in steps of ``BLOCK_T`` (dividing
    the scaling block ``SCALE_BLOCK``), each step's partial product rescaled by the
    factors of its token block."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    g = pid // (n_tiles * k_tiles)
    n0 = ((pid // k_tiles) % n_tiles) * BLOCK_N
    k0 = (pid % k_tiles) * BLOCK_K
    offs_n = tl.arange(0, BLOCK_N)  # int32 offsets inside the tile, int64 bases
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    n_mask = offs_n < N - n0
    k_mask = offs_k < K - k0
    gs, starts, ends = _group_rows(sizes_ptr, G, M, BLOCK_G)
    blocks = tl.where(gs < G, (ends - starts + SCALE_BLOCK - 1) // SCALE_BLOCK, 0)
    first_block = tl.sum(tl.where(gs == g, tl.cumsum(blocks, axis=0) - blocks, 0), axis=0)
    start = tl.sum(tl.where(gs == g, starts, 0), axis=0)
    end = tl.sum(tl.where(gs == g, ends, 0), axis=0)
    dy_cols = dy_ptr + n0.to(tl.int64) * stride_dyn
    x_cols = x_ptr + k0.to(tl.int64) * stride_xk
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        block = first_block + (t0 - start) // SCALE_BLOCK
        t_mask = offs_t < (end - t0).to(tl.int32)
        dy_t = tl.load(dy_cols + t0 * stride_dym  # t0: int64 (from the group bounds)
                       + (offs_t[None, :] * stride_dym + offs_n[:, None] * stride_dyn),
                       mask=n_mask[:, None] & t_mask[None, :], other=0.0)
        x = tl.load(x_cols + t0 * stride_xm
                    + (offs_t[:, None] * stride_xm + offs_k[None, :] * stride_xk),
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        dy_scale = tl.load(dy_inv_ptr + (block.to(tl.int64) * stride_dyi + n0) + offs_n,
                           mask=n_mask, other=0.0)
        x_scale = tl.load(x_inv_ptr + (block.to(tl.int64) * stride_xi + k0) + offs_k,
                          mask=k_mask, other=0.0)
        step = _dot(dy_t, x, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), UPCAST)
        acc += step * (dy_scale[:, None] * x_scale[None, :])
    dw = dw_ptr + (g.to(tl.int64) * stride_dwg + n0.to(tl.int64) * stride_dwn + k0) \
        + (offs_n[:, None] * stride_dwn + offs_k[None, :])
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _operand(t: torch.Tensor) -> torch.Tensor:
    """FP8 data as the kernels read it: float32 on CPU (the interpreter has no FP8)."""
    return t.float() if t.device.type == "cpu" else t


def grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, weight: torch.Tensor, w_inv: torch.Tensor,
               sizes: torch.Tensor, *, transpose_weight: bool, scaling: str,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 ``A`` ``(M, R)`` times each group's weight, ``(M, W)`` in ``out_dtype``.

    Args:
        a, a_inv: FP8 ``(M, R)``; factors ``(M,)`` (rowwise) or ``(M, cdiv(R, 128))``.
        weight, w_inv: FP8 ``(G, N, K)``; factors ``(G, N)`` / ``(G, K)`` (rowwise: the
            output channels of this GEMM) or ``(G, cdiv(N, 128), cdiv(K, 128))``.
        sizes: ``(G,)`` group sizes on the device (clamped in the kernel).
        transpose_weight: ``True`` for forward (``B_g = W_g^T``, ``R = K``, ``W = N``),
            ``False`` for dgrad (``B_g = W_g``, ``R = N``, ``W = K``).
        scaling: ``"rowwise"`` or ``"blockwise"``.
    """
    if scaling not in ("rowwise", "blockwise"):
        raise ValueError(f"scaling={scaling!r} is not 'rowwise' or 'blockwise'")
    M, R = a.shape
    G = weight.shape[0]
    width = weight.shape[1] if transpose_weight else weight.shape[2]
    out = torch.empty(M, width, device=a.device, dtype=out_dtype)
    if M == 0 or width == 0:
        return out
    a, weight = _operand(a), _operand(weight)
    if transpose_weight:  # B_g[r, w] = W_g[w, r]
        b_strides = (weight.stride(0), weight.stride(2), weight.stride(1))
        s_strides = (w_inv.stride(0), w_inv.stride(2), w_inv.stride(1)) if scaling == "blockwise" \
            else (w_inv.stride(0), 0, w_inv.stride(1))
    else:  # B_g[r, w] = W_g[r, w]
        b_strides = (weight.stride(0), weight.stride(1), weight.stride(2))
        s_strides = (w_inv.stride(0), w_inv.stride(1), w_inv.stride(2)) if scaling == "blockwise" \
            else (w_inv.stride(0), 0, w_inv.stride(1))
    block_m, warps, stages = (64, 4, 1) if a.device.type == "cpu" else MM_CONFIG
    upper_tiles = (triton.cdiv(M, block_m) + G + 1) * triton.cdiv(width, BLOCK)
    programs = max(1, min(_program_count(a.device), upper_tiles))
    a_inv = a_inv.contiguous()
    _fp8_grouped_mm_kernel[(programs,)](
        a, a_inv, weight, w_inv, out, sizes, M, width, R, G,
        a.stride(0), a_inv.stride(0) if a_inv.dim() == 2 else 1, *b_strides, *s_strides,
        out.stride(0), BLOCKWISE=scaling == "blockwise", UPCAST=a.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=MM_BLOCK_K, BLOCK_G=triton.next_power_of_2(G + 1),
        NUM_PROGRAMS=programs, SCALE_BLOCK=BLOCK, num_warps=warps, num_stages=stages,
    )
    return out


def _spread(inv: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """One factor per 128 entries along ``dim`` -> one per entry (``size`` of them)."""
    return inv.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, size)


def grouped_mm_reference(a, a_inv, weight, w_inv, sizes, *, transpose_weight: bool, scaling: str,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if scaling == "blockwise":
        a_f = a.float() * _spread(a_inv, 1, a.shape[1])
        w_factors = _spread(_spread(w_inv, 1, weight.shape[1]), 2, weight.shape[2])
        w_f = weight.float() * w_factors
    else:
        a_f = a.float() * a_inv[:, None]
        w_f = weight.float() * (w_inv[:, :, None] if transpose_weight else w_inv[:, None, :])
    ends = sizes.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=a.shape[0]).tolist()
    width = weight.shape[1] if transpose_weight else weight.shape[2]
    out = a_f.new_zeros(a.shape[0], width)
    start = 0
    for g, end in enumerate(ends):
        b = w_f[g].t() if transpose_weight else w_f[g]
        out[start:end] = a_f[start:end] @ b
        start = end
    return out.to(out_dtype)


def blockwise_wgrad(dy: torch.Tensor, dy_inv: torch.Tensor, x: torch.Tensor, x_inv: torch.Tensor,
                    sizes: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(G, N, K)``: ``dW_g = dy_g^T @ x_g`` from FP8 ``dy`` ``(M, N)`` and ``x`` ``(M, K)``
    with factors ``(blocks, N)`` / ``(blocks, K)`` per 128-token block of each group
    (block ``i`` of group ``g`` is number ``sum_{h<g} cdiv(size_h, 128) + i``). Any
    strides: token-contiguous operands (``.t()`` of ``(C, M)`` data) are what FP8 tensor
    cores read without a transpose."""
    M, N = dy.shape
    K = x.shape[1]
    G = sizes.shape[0]
    dw = torch.empty(G, N, K, device=dy.device, dtype=out_dtype)
    if N == 0 or K == 0:
        return dw
    block_n = block_k = 64 if dy.device.type == "cpu" else 128
    warps, stages = (4, 1) if dy.device.type == "cpu" else WGRAD_CONFIG
    grid = (G * triton.cdiv(N, block_n) * triton.cdiv(K, block_k),)
    dy, x = _operand(dy), _operand(x)
    _fp8_blockwise_wgrad_kernel[grid](
        dy, dy_inv, x, x_inv, dw, sizes, M, N, K, G, *dy.stride(), *x.stride(),
        dy_inv.stride(0), x_inv.stride(0), dw.stride(0), dw.stride(1),
        UPCAST=dy.device.type == "cpu", BLOCK_T=WGRAD_BLOCK_T, SCALE_BLOCK=BLOCK,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_G=triton.next_power_of_2(G + 1), num_warps=warps, num_stages=stages,
    )
    return dw


def blockwise_wgrad_reference(dy, dy_inv, x, x_inv, sizes, out_dtype=torch.bfloat16):
    ends = sizes.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=dy.shape[0]).tolist()
    out = torch.zeros(sizes.shape[0], dy.shape[1], x.shape[1], dtype=torch.float32,
                      device=dy.device)
    start, block = 0, 0
    for g, end in enumerate(ends):
        for t0 in range(start, end, BLOCK):
            t1 = min(t0 + BLOCK, end)
            dy_b = dy[t0:t1].float() * dy_inv[block]
            x_b = x[t0:t1].float() * x_inv[block]
            out[g] += dy_b.t() @ x_b
            block += 1
        start = end
    return out.to(out_dtype)
