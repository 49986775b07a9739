"""Per-group bias: the forward epilogue and the gradient's segment reduction.

Plain PyTorch, free of host syncs: rows find their group on the device with a
binary search over the ``(G,)`` cumulative ``offsets``.
"""

from __future__ import annotations

import torch

__all__ = ["row_groups", "bias_epilogue_", "bias_grad", "zero_tail_"]


def row_groups(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(M,)`` group of every row; ``G`` for rows past ``offsets[-1]``."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True)


def zero_tail_(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the rows of ``out`` past ``offsets[-1]``."""
    groups = row_groups(offsets, out.shape[0])
    return out.masked_fill_((groups == offsets.shape[0]).unsqueeze(1), 0)


def bias_epilogue_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    zero_tail: bool,
) -> torch.Tensor:
    """In place on ``out`` ``(M, N)``: add ``bias[g]`` ``(G, N)`` to the rows of group ``g``.

    With ``zero_tail``, rows past ``offsets[-1]`` (which the GEMM may have left
    unspecified) become zero and get no bias.
    """
    if bias is None:
        return zero_tail_(out, offsets) if zero_tail else out
    groups = row_groups(offsets, out.shape[0])
    padded_bias = torch.cat([bias.to(out.dtype), bias.new_zeros(1, bias.shape[1], dtype=out.dtype)])
    if zero_tail:
        out.masked_fill_((groups == offsets.shape[0]).unsqueeze(1), 0)
    return out.add_(padded_bias.index_select(0, groups))


def bias_grad(grad_out: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(M, N) -> (G, N)``: sum of ``grad_out`` over each group's rows, in ``dtype``.

    Accumulates in float32 (float64 for float64 input); deterministic; empty
    groups give zeros; rows past ``offsets[-1]`` are ignored.
    """
    acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    bounds = torch.cat([offsets.new_zeros(1), offsets]).to(torch.int64)
    sums = torch.segment_reduce(
        grad_out.to(acc_dtype).contiguous(), "sum", offsets=bounds, axis=0, unsafe=True
    )
    return sums.to(dtype)
