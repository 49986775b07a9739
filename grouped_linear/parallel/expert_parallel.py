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

__all__ = ["DispatchPlan", "dispatch", "combine"]


@dataclass(frozen=True)
class DispatchPlan:
    """What ``combine`` needs to undo a ``dispatch``.

    Attributes:
        send_sizes: rows sent to each rank (host ints).
        recv_sizes: rows received from each rank (host ints).
        order: ``(R,)`` gather index that regroups the received rows by local expert.
        inverse: ``(R,)`` gather index that undoes ``order``.
        num_rows: rows of the permuted input (``gl.permute`` may add a zero tail).
        group: the process group.
    """

    send_sizes: list[int]
    recv_sizes: list[int]
    order: torch.Tensor
    inverse: torch.Tensor
    num_rows: int
    group: object | None


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
    """
    if not isinstance(x_perm, torch.Tensor) or x_perm.dim() != 2:
        shape = tuple(x_perm.shape) if isinstance(x_perm, torch.Tensor) else type(x_perm).__name__
        raise ValueError(f"x_perm is {shape}: expected a (rows, hidden) tensor")
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
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [src, local expert]
    sizes = torch.stack([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1),
                         counts.min().expand(ep)])
    send_sizes, recv_sizes, (smallest, *_) = sizes.tolist()  # the one host sync
    if smallest < 0:
        raise ValueError(f"counts holds a negative count ({smallest}): {counts.tolist()}")
    if sum(send_sizes) > x_perm.shape[0]:
        raise ValueError(f"counts sums to {sum(send_sizes)}, more than the {x_perm.shape[0]} "
                         "rows of x_perm")
    received = x_perm.new_empty(sum(recv_sizes), x_perm.shape[1])
    received = all_to_all_single(received, x_perm[: sum(send_sizes)].contiguous(),
                                 output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                 group=group)
    expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(
        recv_counts, output_size=received.shape[0])
    order = torch.sort(expert_of_row, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    plan = DispatchPlan(send_sizes, recv_sizes, order, inverse, x_perm.shape[0], group)
    return received.index_select(0, order), recv_counts.view(ep, local).sum(0), plan


def combine(y_local: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Send the expert outputs back: the inverse of :func:`dispatch`, ``(rows, H)`` in the
    permuted layout of the sending rank (zero rows past what it sent)."""
    back = y_local.index_select(0, plan.inverse)
    returned = y_local.new_empty(sum(plan.send_sizes), y_local.shape[1])
    returned = all_to_all_single(returned, back.contiguous(), output_split_sizes=plan.send_sizes,
                                 input_split_sizes=plan.recv_sizes, group=plan.group)
    tail = plan.num_rows - returned.shape[0]
    if tail:
        returned = torch.cat([returned, returned.new_zeros(tail, returned.shape[1])])
    return returned
