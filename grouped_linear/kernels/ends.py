"""Device split sizes to clamped cumulative group ends, in one launch.

``offsets[g] = min(M, sum(max(splits[i], 0) for i <= g))``: non-decreasing and
within ``[0, M]`` whatever the split values, so no kernel indexing with them
can leave the tensor. Never reads the splits back to the host.
"""

import torch

from ._triton import kernel, next_power_of_2, tl, triton, use_triton

__all__ = ["group_starts", "group_offsets", "group_offsets_reference", "aligned_offsets",
           "aligned_offsets_reference"]

_MAX_TRITON_GROUPS = 8192


def group_starts(ends: torch.Tensor) -> torch.Tensor:
    """``(G,)`` cumulative group ends -> the groups' first rows (``ends`` shifted by one)."""
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def group_offsets_reference(splits: torch.Tensor, num_rows: int) -> torch.Tensor:
    return splits.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=num_rows).to(torch.int32)


@kernel
@triton.jit
def _group_offsets_kernel(splits_ptr, offsets_ptr, G, M, BLOCK_G: tl.constexpr):
    idx = tl.arange(0, BLOCK_G)
    mask = idx < G
    sizes = tl.maximum(tl.load(splits_ptr + idx, mask=mask, other=0).to(tl.int64), 0)
    ends = tl.minimum(tl.cumsum(sizes, axis=0), M)
    tl.store(offsets_ptr + idx, ends.to(tl.int32), mask=mask)


def group_offsets(splits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(G,)`` integer split sizes -> ``(G,)`` int32 clamped cumulative ends (same device)."""
    G = splits.shape[0]
    if (not use_triton(splits) or G > _MAX_TRITON_GROUPS or G == 0
            or torch.compiler.is_compiling()):
        return group_offsets_reference(splits, num_rows)
    offsets = torch.empty(G, device=splits.device, dtype=torch.int32)
    _group_offsets_kernel[(1,)](splits.contiguous(), offsets, G, num_rows, BLOCK_G=next_power_of_2(G))
    return offsets


def aligned_offsets_reference(offsets: torch.Tensor, align: int) -> torch.Tensor:
    sizes = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64))
    return ((sizes + align - 1) // align * align).cumsum(0).to(torch.int32)


@kernel
@triton.jit
def _aligned_offsets_kernel(ends_ptr, out_ptr, G, ALIGN: tl.constexpr, BLOCK_G: tl.constexpr):
    idx = tl.arange(0, BLOCK_G)
    mask = idx < G
    ends = tl.load(ends_ptr + idx, mask=mask, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + idx - 1, mask=mask & (idx > 0), other=0).to(tl.int64)
    padded = (ends - starts + ALIGN - 1) // ALIGN * ALIGN
    tl.store(out_ptr + idx, tl.cumsum(padded, axis=0).to(tl.int32), mask=mask)


def aligned_offsets(offsets: torch.Tensor, align: int) -> torch.Tensor:
    """``(G,)`` cumulative group ends -> the ends once every group is rounded up to a
    multiple of ``align`` rows (int32, same device; at most ``(align - 1) * G`` more)."""
    G = offsets.shape[0]
    if not use_triton(offsets) or G > _MAX_TRITON_GROUPS or G == 0 or torch.compiler.is_compiling():
        return aligned_offsets_reference(offsets, align)
    out = torch.empty(G, device=offsets.device, dtype=torch.int32)
    _aligned_offsets_kernel[(1,)](offsets, out, G, ALIGN=align, BLOCK_G=next_power_of_2(G))
    return out
