"""Expert parallelism: send permuted tokens to the ranks that own their experts, and back.

Experts are numbered globally; rank ``r`` of an ``ep``-rank group owns experts
``[r * E_local, (r + 1) * E_local)``. ``dispatch`` takes the tokens grouped by
global expert (``gl.permute``'s layout) with their per-expert counts, exchanges the
counts with one ``all_to_all_single`` on the device, reads the send and receive
sizes back in ONE host sync (``all_to_all_single`` needs them on the host), moves
the rows with a second ``all_to_all_single`` and regroups them by local expert.
``combine`` is the exact inverse. Both are differentiable (the all-to-alls are
``torch.distributed.nn.functional``'s) and deterministic (gathers only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from ..ops.chunks import sort_chunks_by_index

__all__ = ["DispatchPlan", "dispatch", "combine"]


@dataclass(frozen=True)
class DispatchPlan:
    """What ``combine`` needs to undo a ``dispatch``.

    Attributes:
        send_sizes: rows sent to each rank (host ints).
        recv_sizes: rows received from each rank (host ints).
        chunk_sizes: ``(ep * E_local,)`` rows of each received chunk, in the order they
            arrive (source rank by source rank, local expert by local expert).
        order: ``(ep * E_local,)`` the chunks in local-expert order (chunk ``r * E_local + e``
            at position ``e * ep + r``), as :func:`~grouped_linear.sort_chunks_by_index`
            takes it.
        num_rows: rows of the permuted input (``gl.permute`` may add a zero tail).
        group: the process group.
    """

    send_sizes: list[int]
    recv_sizes: list[int]
    chunk_sizes: torch.Tensor
    order: torch.Tensor
    num_rows: int
    group: object | None


# What a rank's counts may be wrong by, sent with them so that every rank raises together.
_NEGATIVE, _PAST_ROWS = 1, 2


def _flaws(flags: int) -> str:
    return " and ".join(what for bit, what in ((_NEGATIVE, "a negative count"),
                                               (_PAST_ROWS, "a sum past its rows of x_perm"))
                        if flags & bit)


def dispatch(x_perm: torch.Tensor, counts: torch.Tensor, group: object | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Move the rows of every expert to the rank that owns it.

    Args:
        x_perm: ``(rows, H)`` tokens grouped by global expert (rows past
            ``counts.sum()`` are ignored).
        counts: ``(E,)`` integer rows per global expert, on ``x_perm``'s device.
        group: the expert-parallel process group (default: the world).

    Returns:
        ``(x_local, local_counts, plan)``: this rank's rows grouped by local expert
        (sources in rank order within an expert), ``(E_local,)`` int64 counts, and
        the plan for :func:`combine`.

    Errors: the type, dtype, shape and device of the arguments are checked before any
    communication (a rank that raises there leaves its peers waiting in the count
    exchange, as any collective would). The values of ``counts`` are checked after it:
    every rank sends, with its counts, whether they hold a negative count or sum past
    its rows of ``x_perm``, so when one rank's counts are bad every rank raises a
    ValueError (that rank naming its counts, the others naming that rank) before any
    row moves, and none is left waiting in the row exchange.
    """
    if not isinstance(x_perm, torch.Tensor):
        raise TypeError(f"x_perm is {type(x_perm).__name__}: expected a (rows, hidden) tensor")
    if x_perm.dim() != 2:
        raise ValueError(f"x_perm is {tuple(x_perm.shape)}: expected a (rows, hidden) tensor")
    if (not isinstance(counts, torch.Tensor) or counts.dtype.is_floating_point
            or counts.dtype in (torch.bool, torch.complex64, torch.complex128)):
        raise TypeError(f"counts must be an integer tensor, got {counts!r}")
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts has shape {tuple(counts.shape)}: expected (num_experts,)")
    if counts.device != x_perm.device:
        raise ValueError(f"counts is on {counts.device} but x_perm is on {x_perm.device}")
    ep = dist.get_world_size(group)
    num_experts = counts.numel()
    if num_experts % ep:
        raise ValueError(f"counts has {num_experts} experts, not divisible by the {ep} ranks")
    local = num_experts // ep
    counts = counts.to(torch.int64).contiguous()
    # Each destination gets this rank's counts of its experts and this rank's flags, on the
    # device (no host read before the exchange).
    flags = ((counts < 0).any().to(torch.int64) * _NEGATIVE
             + (counts.sum() > x_perm.shape[0]).to(torch.int64) * _PAST_ROWS)
    send = torch.cat([counts.view(ep, local), flags.expand(ep, 1)], dim=1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [src, local expert | flags]
    recv_counts = recv[:, :local].reshape(-1)
    sizes = torch.stack([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1),
                         recv[:, local]])
    send_sizes, recv_sizes, peer_flags = sizes.tolist()  # the one host sync
    rank = dist.get_rank(group)
    if peer_flags[rank] & _NEGATIVE:
        raise ValueError(f"counts holds a negative count ({int(counts.min())}): {counts.tolist()}")
    if peer_flags[rank] & _PAST_ROWS:
        raise ValueError(f"counts sums to {int(counts.sum())}, more than the {x_perm.shape[0]} "
                         "rows of x_perm")
    bad = [(src, flaw) for src, flaw in enumerate(peer_flags) if flaw]
    if bad:
        raise ValueError("counts of rank " + ", rank ".join(f"{src} hold {_flaws(flaw)}"
                                                           for src, flaw in bad)
                         + ": that rank raises too, so no rows are exchanged")
    received = x_perm.new_empty(sum(recv_sizes), x_perm.shape[1])
    received = all_to_all_single(received, x_perm[: sum(send_sizes)].contiguous(),
                                 output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                 group=group)
    # The received chunks arrive source rank by source rank: one gather regroups them by
    # local expert.
    order = torch.arange(ep * local, device=counts.device).view(ep, local).t().reshape(-1)
    plan = DispatchPlan(send_sizes, recv_sizes, recv_counts, order, x_perm.shape[0], group)
    by_expert = sort_chunks_by_index(received, recv_counts, order)
    return by_expert, recv_counts.view(ep, local).sum(0), plan


def combine(y_local: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Send the expert outputs back: the inverse of :func:`dispatch`, ``(rows, H)`` in the
    permuted layout of the sending rank (zero rows past what it sent).

    ``y_local`` must have one row per row ``dispatch`` returned, on its device (checked before
    any communication, so a rank that fails here alone leaves its peers in the exchange)."""
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan is {type(plan).__name__}: expected the DispatchPlan of dispatch")
    if not isinstance(y_local, torch.Tensor):
        raise TypeError(f"y_local is {type(y_local).__name__}: expected a (rows, hidden) tensor")
    if y_local.device != plan.order.device:
        raise ValueError(f"y_local is on {y_local.device} but the plan is on {plan.order.device}")
    received = sum(plan.recv_sizes)
    if y_local.dim() != 2 or y_local.shape[0] != received:
        raise ValueError(f"y_local is {tuple(y_local.shape)}: expected ({received}, "
                         "hidden), a row per row dispatch returned")
    # The chunks back in arrival order: the inverse permutation of the chunks.
    back = sort_chunks_by_index(y_local, plan.chunk_sizes.index_select(0, plan.order),
                                torch.argsort(plan.order))
    returned = y_local.new_empty(sum(plan.send_sizes), y_local.shape[1])
    returned = all_to_all_single(returned, back.contiguous(), output_split_sizes=plan.send_sizes,
                                 input_split_sizes=plan.recv_sizes, group=plan.group)
    tail = plan.num_rows - returned.shape[0]
    if tail:
        returned = torch.cat([returned, returned.new_zeros(tail, returned.shape[1])])
    return returned
