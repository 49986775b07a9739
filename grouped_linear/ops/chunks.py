"""Reordering of consecutive row chunks (the received all-to-all chunks of expert parallelism,
rank-major, into expert-major order), with the rows' probabilities alongside.

The source row of every output row is computed on the rows' device from the chunk sizes and
order (cumulative sums and a sorted search, no host read of device tensors); the rows then
move in one gather, and the backward is the gather of the inverse permutation.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from grouped_linear.kernels.routing import rows as row_kernels
from grouped_linear.ops.checks import (
    check_matrix,
    check_operands,
    check_tensor,
    host_checks,
    is_bool,
)
from grouped_linear.ops.permutation import TRACEABLE
from grouped_linear.ops.splits import (
    SPLIT_DTYPES,
    check_split_kind,
    debug_checks_enabled,
    host_split_sizes,
)

__all__ = ["sort_chunks_by_index", "sort_chunks_by_index_reference"]

Chunks = Sequence[int] | torch.Tensor


def _source_rows(sizes: torch.Tensor, order: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(num_rows,)`` int64: the input row that each output row copies.

    ``sizes`` ``(C,)`` int64, non-negative and summing to at most ``num_rows``; ``order``
    ``(C,)`` int64 in ``[0, C)``. Output chunk ``i`` is input chunk ``order[i]``; rows past
    the output chunks copy themselves. Every entry lies in ``[0, num_rows)`` whatever
    ``order`` holds (a repeated chunk index gives a wrong map, never an out-of-bounds one).
    """
    rows = torch.arange(num_rows, device=sizes.device, dtype=torch.int64)
    count = sizes.shape[0]
    if count == 0:
        return rows
    starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes.index_select(0, order)
    out_ends = torch.cumsum(out_sizes, 0)
    position = torch.searchsorted(out_ends, rows, right=True)  # C: past the output chunks
    inside = position < count
    position = position.clamp(max=count - 1)
    offset = rows - (out_ends - out_sizes).index_select(0, position)
    source = starts.index_select(0, order.index_select(0, position)) + offset
    return torch.where(inside, source, rows)


class _SortChunks(torch.autograd.Function):
    """Gather the rows (and probabilities) by a source map; backward gathers by its inverse."""

    @staticmethod
    def forward(ctx, x, probs, source, out_sizes, inverse):  # type: ignore[override]
        ctx.save_for_backward(out_sizes, inverse)
        ctx.num_rows = x.shape[0]
        out = row_kernels.gather_rows(x, source)
        if probs is None:
            return out
        return out, probs.index_select(0, source)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_probs=None):  # type: ignore[override]
        out_sizes, inverse = ctx.saved_tensors
        # The output's chunks, put back in input order: the inverse permutation.
        source = _source_rows(out_sizes, inverse, ctx.num_rows)
        grad_x = grad_p = None
        if ctx.needs_input_grad[0]:
            grad_x = row_kernels.gather_rows(grad_out, source)
        if ctx.needs_input_grad[1] and grad_probs is not None:
            grad_p = grad_probs.index_select(0, source)
        return grad_x, grad_p, None, None, None


def _check_index_kind(sorted_index: object, device: torch.device) -> int:
    """The length of ``sorted_index`` once it is a list/tuple or a 1-D integer tensor on the
    CPU or on ``device``; nothing read."""
    if isinstance(sorted_index, (list, tuple)):
        return len(sorted_index)
    if not isinstance(sorted_index, torch.Tensor):
        raise TypeError(f"sorted_index is {type(sorted_index).__name__}: expected a list of ints "
                        "or an integer tensor")
    if sorted_index.dtype not in SPLIT_DTYPES:
        raise TypeError(f"sorted_index has dtype {sorted_index.dtype}: expected an integer tensor")
    if sorted_index.dim() != 1:
        raise ValueError(
            f"sorted_index has shape {tuple(sorted_index.shape)}: expected a 1-D tensor")
    if sorted_index.device.type != "cpu" and sorted_index.device != device:
        raise ValueError(f"sorted_index is on {sorted_index.device} but x is on {device}: "
                         "expected a tensor on the CPU or on x's device")
    return sorted_index.numel()


def _index_values(sorted_index: Sequence[object]) -> list[int]:
    """The entries of a list/tuple ``sorted_index`` as Python ints (booleans rejected)."""
    values = []
    for i, value in enumerate(sorted_index):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype in SPLIT_DTYPES:
            value = value.item()
        try:
            if is_bool(value):
                raise TypeError
            values.append(operator.index(value))
        except TypeError:
            raise TypeError(f"sorted_index[{i}] is {value!r} of type {type(value).__name__}: "
                            "expected an int") from None
    return values


def _check_permutation(values: list[int]) -> None:
    """ValueError naming the first entry that makes ``values`` no permutation of its range."""
    count = len(values)
    seen: dict[int, int] = {}
    for i, value in enumerate(values):
        if not 0 <= value < count:
            raise ValueError(f"sorted_index[{i}] is {value}: expected a permutation of "
                             f"range({count}) (one entry per chunk)")
        if value in seen:
            raise ValueError(f"sorted_index[{i}] is {value}, as is sorted_index[{seen[value]}]: "
                             f"expected a permutation of range({count})")
        seen[value] = i


def _check_sizes(sizes: list[int], num_rows: int) -> None:
    total = sum(sizes)
    if total > num_rows:
        raise ValueError(f"split_sizes sums to {total}, more than the {num_rows} rows of x")


def _on_device(values: Chunks, host_values: list[int] | None,
               device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: from the ints read on the host where they
    were (a copy of its own, so a later change to a pinned CPU tensor cannot race it)."""
    if host_values is None:
        return values.to(device=device, dtype=torch.int64)
    return torch.tensor(host_values, dtype=torch.int64).to(device, non_blocking=True)


def sort_chunks_by_index(
    x: torch.Tensor,
    split_sizes: Chunks,
    sorted_index: Chunks,
    probs: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reorder the consecutive row chunks of ``x``: output chunk ``i`` is input chunk
    ``sorted_index[i]`` (Transformer Engine's ``moe_sort_chunks_by_index``, and with
    ``probs`` its ``moe_sort_chunks_by_index_with_probs``).

    Args:
        x: ``(R, H)`` floating-point rows, ``C`` chunks of consecutive rows.
        split_sizes: the ``C`` chunk sizes: a list of ints, or a 1-D integer tensor on the CPU
            or on ``x``'s device.
        sorted_index: ``(C,)`` the input chunk of each output chunk, a permutation of
            ``range(C)``: a list of ints, or a 1-D integer tensor on the CPU or on ``x``'s
            device.
        probs: optional ``(R,)`` floating-point per-row values, reordered with the rows.

    Host values (lists, CPU tensors) are checked: sizes non-negative and summing to at most
    ``R``, ``sorted_index`` a permutation. Device tensors are never read back (nothing
    synchronizes with the host) unless ``GROUPED_LINEAR_DEBUG=1``, which checks them the same
    way; unchecked, negative sizes count as 0 and the chunks are cut at row ``R``, and an
    ``sorted_index`` that is no permutation gives wrong rows but no out-of-bounds access.

    Returns:
        ``(R, H)`` in ``x``'s dtype, and the ``(R,)`` reordered ``probs`` when given. Rows
        past ``sum(split_sizes)`` stay where they are (Transformer Engine leaves that case
        undefined: its chunks must cover ``x``).

    Differentiable in ``x`` and ``probs``: the backward gathers the output's gradient by
    the inverse permutation (deterministic).
    """
    x = check_matrix(x, "x")
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}: expected a floating-point tensor")
    if probs is not None:
        check_tensor("probs", probs, "a torch.Tensor or None")
    device = check_operands(x, [("probs", probs)])
    num_rows = x.shape[0]
    if probs is not None and tuple(probs.shape) != (num_rows,):
        raise ValueError(f"probs has shape {tuple(probs.shape)}: expected ({num_rows},), one "
                         "value per row of x")
    count = check_split_kind(split_sizes, "split_sizes", device)
    index_count = _check_index_kind(sorted_index, device)
    if index_count != count:
        raise ValueError(f"sorted_index has {index_count} entries but split_sizes has {count}: "
                         "expected one per chunk")

    # Values: lists always, CPU tensors unless torch.compile traces, device tensors only
    # with GROUPED_LINEAR_DEBUG=1 (a host sync).
    host_sizes = host_index = None
    if isinstance(split_sizes, (list, tuple)):
        host_sizes = host_split_sizes(split_sizes, "split_sizes")
    elif host_checks() and (split_sizes.device.type == "cpu" or debug_checks_enabled()):
        host_sizes = host_split_sizes(split_sizes.tolist(), "split_sizes")
    if host_sizes is not None:
        _check_sizes(host_sizes, num_rows)
    if isinstance(sorted_index, (list, tuple)):
        host_index = _index_values(sorted_index)
    elif host_checks() and (sorted_index.device.type == "cpu" or debug_checks_enabled()):
        host_index = sorted_index.tolist()
    if host_index is not None:
        _check_permutation(host_index)

    with torch.no_grad():
        sizes = _on_device(split_sizes, host_sizes, device)
        order = _on_device(sorted_index, host_index, device)
        # Unchecked device values made safe: sizes in [0, R], chunks cut at row R, indices
        # in [0, C). Checked values pass unchanged.
        ends = torch.cumsum(sizes.clamp(0, num_rows), 0).clamp(max=num_rows)
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        order = order.clamp(0, max(count - 1, 0))
        source = _source_rows(sizes, order, num_rows)
        out_sizes = sizes.index_select(0, order)
        inverse = torch.argsort(order, stable=True)
    return _SortChunks.apply(x, probs, source, out_sizes, inverse)


def sort_chunks_by_index_reference(
    x: torch.Tensor,
    split_sizes: Chunks,
    sorted_index: Chunks,
    probs: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch :func:`sort_chunks_by_index` for valid arguments (their values are read
    on the host): the chunks concatenated in ``sorted_index``'s order, then the rows past
    the chunks."""
    sizes = [int(size) for size in split_sizes]
    order = [int(index) for index in sorted_index]
    tail = x.shape[0] - sum(sizes)

    def reorder(t: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(t, [*sizes, tail])
        return torch.cat([*(chunks[i] for i in order), chunks[-1]])

    if probs is None:
        return reorder(x)
    return reorder(x), reorder(probs)


if not TRACEABLE:  # as permute: traced to zero input gradients before torch 2.13
    sort_chunks_by_index = torch.compiler.disable(sort_chunks_by_index)
