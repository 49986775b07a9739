"""Device split sizes to clamped cumulative group ends, in one launch.

``offsets[g] = min(M, sum(max(splits[i], 0) for i <= g))``: non-decreasing and
within ``[0, M]`` whatever the split values, so no kernel indexing with them
can leave the tensor. Never reads the splits back to the host.
"""

import torch

from ._triton import tl, triton, use_triton

__all__ = ["group_offsets", "group_offsets_reference"]

_MAX_TRITON_GROUPS = 8192


def group_offsets_reference(splits: torch.Tensor, num_rows: int) -> torch.Tensor:
    return splits.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=num_rows).to(torch.int32)


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
    _group_offsets_kernel[(1,)](splits, offsets, G, num_rows, BLOCK_G=triton.next_power_of_2(G))
    return offsets
