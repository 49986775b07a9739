"""Batched transpose of 1-byte (FP8) matrices: ``(G, R, C)`` -> ``(G, C, R)``.

The FP8 weight's dgrad copy is the transpose of its forward copy (same values, same
per-output-channel factors: ``ops/fp8/scaled_mm.py`` folds those into the gradient), so it
costs one read and one write of a byte per weight instead of a second quantization from
the high-precision weight (two reads of two bytes and a write). The plain-PyTorch
reference is :func:`transpose_groups_reference`.
"""

from __future__ import annotations

import torch

from .._triton import cdiv, kernel, tl, triton, use_triton

__all__ = ["transpose_groups", "transpose_groups_reference"]

# Launch shape (tile rows, tile columns, warps): 128 x 128 bytes per program.
TRANSPOSE_CONFIG = (128, 128, 4)


def transpose_groups_reference(data: torch.Tensor) -> torch.Tensor:
    """``(G, R, C)`` -> contiguous ``(G, C, R)``."""
    return data.transpose(1, 2).contiguous()


@kernel
@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One ``BLOCK_R x BLOCK_C`` tile of group ``program_id(2)``; groups are contiguous
    ``R x C`` (source) and ``C x R`` (destination) matrices."""
    g = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    base = g * R * C
    tile = tl.load(src_ptr + base + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask)
    tl.store(dst_ptr + base + cols.to(tl.int64)[None, :] * R + rows[:, None], tile, mask=mask)


def transpose_groups(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(G, R, C)`` 1-byte tensor -> contiguous ``(G, C, R)`` of the same dtype (written into
    ``out``, such a tensor, if given), in one Triton pass on GPUs (the reference elsewhere,
    and for non-contiguous input)."""
    if data.dim() != 3 or data.element_size() != 1:
        raise ValueError(f"data has shape {tuple(data.shape)} and {data.element_size()}-byte "
                         "elements: expected a (G, R, C) tensor of 1-byte elements")
    G, R, C = data.shape
    if not use_triton(data) or not data.is_contiguous() or data.numel() == 0 or G > 65535:
        result = transpose_groups_reference(data)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(G, C, R, device=data.device, dtype=data.dtype)
    block_r, block_c, warps = TRANSPOSE_CONFIG
    # Byte views: the kernel only moves bytes (and the CPU interpreter has no FP8 loads).
    _transpose_kernel[(cdiv(R, block_r), cdiv(C, block_c), G)](
        data.view(torch.uint8), out.view(torch.uint8), R, C, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps,
    )
    return out
