"""Device split sizes to clamped cumulative group ends, in one launch.

``ends[g] = min(M, sum(max(splits[i], 0) for i <= g))``: non-decreasing and
within ``[0, M]`` whatever the split values, so no kernel indexing with them
can leave the tensor. Never reads the splits back to the host. The ends are int32, or
int64 when ``M`` is past what int32 holds (:func:`ends_dtype`).
"""

import torch

from ._triton import kernel, next_power_of_2, tl, triton, use_triton

__all__ = ["ends_dtype", "group_starts", "group_sizes", "group_ends", "group_ends_reference",
           "aligned_ends", "aligned_ends_reference"]

# One program scans every group's size in registers; past this many groups (rare calls) torch's
# cumsum (a few launches, no host sync) instead of compiling a kernel per wider power of two.
_MAX_TRITON_GROUPS = 1024
_INT32_MAX = 2**31 - 1


def ends_dtype(num_rows: int) -> torch.dtype:
    """The dtype of cumulative group ends over ``num_rows`` rows: int32, int64 past int32."""
    return torch.int32 if num_rows <= _INT32_MAX else torch.int64


def group_starts(ends: torch.Tensor) -> torch.Tensor:
    """``(G,)`` cumulative group ends -> the groups' first rows (``ends`` shifted by one)."""
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def group_ends_reference(splits: torch.Tensor, num_rows: int) -> torch.Tensor:
    ends = splits.to(torch.int64).clamp(min=0).cumsum(0).clamp(max=num_rows)
    return ends.to(ends_dtype(num_rows))


@kernel
@triton.jit
def _group_ends_kernel(splits_ptr, ends_ptr, G, M, BLOCK_G: tl.constexpr):
    idx = tl.arange(0, BLOCK_G)
    mask = idx < G
    sizes = tl.maximum(tl.load(splits_ptr + idx, mask=mask, other=0).to(tl.int64), 0)
    ends = tl.minimum(tl.cumsum(sizes, axis=0), M)
    tl.store(ends_ptr + idx, ends.to(ends_ptr.dtype.element_ty), mask=mask)


def group_ends(splits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(G,)`` integer split sizes -> ``(G,)`` clamped cumulative ends (same device), of
    :func:`ends_dtype`."""
    G = splits.shape[0]
    if (not use_triton(splits) or G > _MAX_TRITON_GROUPS or G == 0
            or torch.compiler.is_compiling()):
        return group_ends_reference(splits, num_rows)
    ends = torch.empty(G, device=splits.device, dtype=ends_dtype(num_rows))
    _group_ends_kernel[(1,)](splits.contiguous(), ends, G, num_rows, BLOCK_G=next_power_of_2(G))
    return ends


def group_sizes(ends: torch.Tensor) -> torch.Tensor:
    """``(G,)`` cumulative group ends -> the ``(G,)`` group sizes, in ``ends``' dtype."""
    return torch.diff(ends, prepend=ends.new_zeros(1))


def aligned_ends_reference(ends: torch.Tensor, align: int) -> torch.Tensor:
    sizes = group_sizes(ends.to(torch.int64))
    return ((sizes + align - 1) // align * align).cumsum(0).to(torch.int32)


@kernel
@triton.jit
def _aligned_ends_kernel(ends_ptr, out_ptr, G, ALIGN: tl.constexpr, BLOCK_G: tl.constexpr):
    idx = tl.arange(0, BLOCK_G)
    mask = idx < G
    ends = tl.load(ends_ptr + idx, mask=mask, other=0).to(tl.int64)
    starts = tl.load(ends_ptr + idx - 1, mask=mask & (idx > 0), other=0).to(tl.int64)
    padded = (ends - starts + ALIGN - 1) // ALIGN * ALIGN
    tl.store(out_ptr + idx, tl.cumsum(padded, axis=0).to(tl.int32), mask=mask)


def aligned_ends(ends: torch.Tensor, align: int) -> torch.Tensor:
    """``(G,)`` cumulative group ends -> the ends once every group is rounded up to a
    multiple of ``align`` rows (int32, same device; at most ``(align - 1) * G`` more)."""
    G = ends.shape[0]
    if not use_triton(ends) or G > _MAX_TRITON_GROUPS or G == 0 or torch.compiler.is_compiling():
        return aligned_ends_reference(ends, align)
    out = torch.empty(G, device=ends.device, dtype=torch.int32)
    _aligned_ends_kernel[(1,)](ends, out, G, ALIGN=align, BLOCK_G=next_power_of_2(G))
    return out
