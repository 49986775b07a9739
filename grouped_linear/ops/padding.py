"""Pad every group of rows to a multiple of an alignment, and the inverse.

Both directions are one row relayout (:func:`grouped_linear.kernels.routing.relayout.relayout`):
every destination row is written once, from its partner source row or as zeros. The
backward of one direction is the other direction, so forward and backward are
deterministic (no scatter-add) and, with CUDA split tensors, free of host
synchronization.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grouped_linear.kernels.routing import relayout as relayout_kernels
from grouped_linear.ops.checks import MAX_ROWS, check_int, check_matrix
from grouped_linear.ops.splits import (
    check_split_kind,
    debug_checks_enabled,
    host_split_sizes,
    normalize_splits,
)

__all__ = ["pad_groups", "unpad_groups"]


# ---------------------------------------------------------------------------
# the relayout
# ---------------------------------------------------------------------------


class _Relayout(torch.autograd.Function):
    """Rows from one layout of the groups to the other; backward moves them back."""

    @staticmethod
    def forward(ctx, src, src_ends, dst_ends, num_dst_rows):  # type: ignore[override]
        ctx.save_for_backward(src_ends, dst_ends)
        ctx.num_src_rows = src.shape[0]
        return relayout_kernels.relayout(src, src_ends, dst_ends, num_dst_rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        src_ends, dst_ends = ctx.saved_tensors
        # Through the function itself, so double backward works too.
        grad_src = _Relayout.apply(grad.contiguous(), dst_ends, src_ends, ctx.num_src_rows)
        return grad_src, None, None, None


# ---------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------


def _num_groups(m_splits: object, name: str, device: torch.device) -> int:
    """The group count, once what the splits are has been checked (no value read)."""
    count = check_split_kind(m_splits, name, device)
    if count == 0:
        raise ValueError(f"{name} is empty: expected at least one group")
    return count


def _check_rows_bound(num_rows: int, num_groups: int, multiple: int) -> None:
    """Every size derived from ``multiple`` stays an int64: the padded rows, at most
    ``num_rows + num_groups * (multiple - 1)``, must fit a tensor dimension."""
    bound = num_rows + num_groups * (multiple - 1)
    if bound > MAX_ROWS:
        raise ValueError(
            f"multiple is {multiple}: padding {num_groups} groups of {num_rows} rows to it may "
            f"take up to {bound} rows, more than a tensor holds ({MAX_ROWS})"
        )


def _join_groups(
    x: Sequence[torch.Tensor], m_splits: Sequence[int] | torch.Tensor | None
) -> tuple[torch.Tensor, Sequence[int] | torch.Tensor, list[int]]:
    """Concatenate a list of per-group tensors and derive or check ``m_splits``."""
    if len(x) == 0:
        raise ValueError("x is an empty list: expected one 2-D tensor per group")
    for i, part in enumerate(x):
        check_matrix(part, f"x[{i}]")
        if part.shape[1] != x[0].shape[1]:
            raise ValueError(f"x[{i}] has {part.shape[1]} columns but x[0] has {x[0].shape[1]}")
        if part.dtype != x[0].dtype or part.device != x[0].device:
            raise ValueError(
                f"x[{i}] is {part.dtype} on {part.device} but x[0] is {x[0].dtype} on {x[0].device}"
            )
    sizes = [part.shape[0] for part in x]
    if m_splits is None:
        m_splits = sizes
    else:
        count = _num_groups(m_splits, "m_splits", x[0].device)
        if count != len(x):
            raise ValueError(f"m_splits has length {count} but x is a list of {len(x)} tensors")
    return torch.cat(list(x)), m_splits, sizes


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------


def pad_groups(
    x: torch.Tensor | Sequence[torch.Tensor],
    m_splits: Sequence[int] | torch.Tensor | None = None,
    multiple: int = 16,
) -> tuple[torch.Tensor, list[int] | torch.Tensor]:
    """Round every group of rows up to a multiple of ``multiple`` rows.

    Args:
        x: ``(M, H)`` tensor whose rows are split into ``G`` consecutive groups
            by ``m_splits``, or a list/tuple of ``G`` tensors ``(m_i, H)``
            (then ``m_splits`` may be omitted; if given it must agree).
        m_splits: ``G`` Python ints, or a 1-D integer tensor ``(G,)``.
        multiple: the alignment: an int >= 1 with ``M + G*(multiple-1)``
            within a tensor dimension (``2**63 - 1``).

    Returns:
        ``(xp, padded_splits)``. ``padded_splits[i]`` is ``m_i`` rounded up to a
        multiple of ``multiple`` (empty groups stay empty): a list of ints for a
        sequence ``m_splits``, an int64 tensor on ``m_splits``' device for a
        tensor. ``xp`` is ``(P, H)``: group ``i``'s rows followed by its zero
        padding rows, group after group. For host splits (sequence or CPU
        tensor, summing to ``M``) ``P = sum(padded_splits)``. For CUDA split
        tensors nothing synchronizes with the host: ``P = M + G*(multiple-1)``
        (an upper bound), every row past the data is zero, rows of ``x`` past
        ``sum(m_splits)`` are dropped, and ``padded_splits`` is computed from
        the ends clamped to ``[0, M]``.

    Differentiable in ``x``; forward and backward are deterministic gathers.
    """
    multiple = check_int("multiple", multiple)
    list_sizes: list[int] | None = None
    if isinstance(x, (list, tuple)):
        x, m_splits, list_sizes = _join_groups(x, m_splits)
    else:
        x = check_matrix(x, "x")
        if m_splits is None:
            raise ValueError("m_splits is None: it is required when x is a single tensor")
    num_groups = _num_groups(m_splits, "m_splits", x.device)
    num_rows = x.shape[0]
    splits = normalize_splits(m_splits, num_groups=num_groups, num_rows=num_rows, device=x.device)
    _check_rows_bound(num_rows, num_groups, multiple)
    if list_sizes is not None:
        given = splits.host_sizes
        if given is None and debug_checks_enabled():
            given = tuple(splits.sizes_list())
        if given is not None and list(given) != list_sizes:
            i = next(i for i, (a, b) in enumerate(zip(given, list_sizes, strict=True)) if a != b)
            raise ValueError(f"m_splits[{i}] is {given[i]} but x[{i}] has {list_sizes[i]} rows")

    in_ends = splits.ends.to(torch.int64)
    padded: list[int] | torch.Tensor
    if splits.host_sizes is not None:
        padded = [_round_up(size, multiple) for size in splits.host_sizes]
        out_rows = sum(padded)
        out_ends = torch.tensor(padded, dtype=torch.int64).cumsum(0)
        out_ends = out_ends.to(x.device, non_blocking=True)
        if isinstance(m_splits, torch.Tensor):
            padded = torch.tensor(padded, dtype=torch.int64, device=m_splits.device)
    else:
        sizes = (splits.ends - splits.starts()).to(torch.int64)
        padded = (sizes + (multiple - 1)) // multiple * multiple
        out_ends = padded.cumsum(0)
        out_rows = num_rows + num_groups * (multiple - 1)

    xp = _Relayout.apply(x, in_ends, out_ends, out_rows)
    return xp, padded


def unpad_groups(
    yp: torch.Tensor,
    m_splits: Sequence[int] | torch.Tensor,
    padded_splits: Sequence[int] | torch.Tensor,
    num_rows: int | None = None,
) -> torch.Tensor:
    """Drop the padding rows that :func:`pad_groups` added (its differentiable inverse).

    Args:
        yp: ``(P, H)`` tensor in the padded layout: ``G`` consecutive groups of
            ``padded_splits[i]`` rows each, the first ``m_splits[i]`` of which
            hold data.
        m_splits: the unpadded group sizes, ``G`` ints or a ``(G,)`` integer tensor.
        padded_splits: the padded group sizes, same kinds accepted. Host padded
            splits must sum to ``P`` and be at least ``m_splits``.
        num_rows: the output row count. Host ``m_splits`` must then sum to it.
            With CUDA ``m_splits`` giving it keeps the op free of host
            synchronization; without it the sum is read back (a sync).

    Returns:
        ``(N, H)`` with ``N = num_rows`` or ``sum(m_splits)``: group ``i``'s first
        ``m_splits[i]`` rows of ``yp``, group after group; rows past the data
        (CUDA splits summing to less than ``N``) are zero. With CUDA splits the
        ends are clamped to ``[0, N]`` and ``[0, P]``, so bad values never
        index out of bounds.

    Differentiable in ``yp`` (the padding rows get zero gradient).
    """
    yp = check_matrix(yp, "yp")
    # What the splits are, for both, before any value is read.
    num_groups = _num_groups(m_splits, "m_splits", yp.device)
    padded_groups = _num_groups(padded_splits, "padded_splits", yp.device)
    if padded_groups != num_groups:
        raise ValueError(
            f"padded_splits has length {padded_groups} but m_splits has length {num_groups}"
        )
    if num_rows is not None:
        num_rows = check_int("num_rows", num_rows, minimum=0, maximum=MAX_ROWS)
    sizes = host_split_sizes(m_splits, "m_splits")
    if sizes is not None:
        total = sum(sizes)
        if total > MAX_ROWS:
            raise ValueError(f"m_splits sums to {total}, more rows than a tensor holds "
                             f"({MAX_ROWS})")
        if num_rows is not None and num_rows != total:
            raise ValueError(f"num_rows is {num_rows} but m_splits sums to {total}")
        num_rows, m_splits = total, sizes
    elif num_rows is None:
        num_rows = int(m_splits.to(torch.int64).clamp(min=0).sum())  # host sync, documented

    splits = normalize_splits(m_splits, num_groups=num_groups, num_rows=num_rows, device=yp.device)
    padded = normalize_splits(
        padded_splits,
        num_groups=num_groups,
        num_rows=yp.shape[0],
        device=yp.device,
        name="padded_splits",
    )
    if splits.host_sizes is not None and padded.host_sizes is not None:
        for i, (size, pad) in enumerate(zip(splits.host_sizes, padded.host_sizes, strict=True)):
            if pad < size:
                raise ValueError(
                    f"padded_splits[{i}] is {pad}, smaller than m_splits[{i}] = {size}"
                )

    m_ends = splits.ends.to(torch.int64)
    p_ends = padded.ends.to(torch.int64)
    return _Relayout.apply(yp, p_ends, m_ends, num_rows)
