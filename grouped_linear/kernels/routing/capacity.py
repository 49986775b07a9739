"""Per-expert capacity by priority: each expert keeps its ``capacity`` highest-priority slots.

:func:`drop_over_capacity` finds the slots of every expert from the routing map of the
slots themselves (one row per slot, grouped by expert), then counts, for each slot, the
slots of its expert that come before it (higher priority, or equal priority and a lower
slot): a slot is kept when fewer than ``capacity`` do. Each program compares a block of
rows with the rows of the groups it touches, so the work is the sum of the squared group
sizes, on the device, without a host sync. :func:`drop_over_capacity_reference` is the
plain-PyTorch version (two stable sorts).
"""

import torch

from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .routing_map import _ROUTING_MAX_EXPERTS, routing_map

__all__ = ["drop_over_capacity", "drop_over_capacity_reference"]

_ROWS = 64  # rows ranked per program
_PEERS = 64  # rows compared with them per step


def _valid_experts(topk_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    wide = topk_indices.to(torch.int64)
    return torch.where((wide >= 0) & (wide < num_experts), wide, -1)


def drop_over_capacity_reference(topk_indices: torch.Tensor, priority: torch.Tensor,
                                 num_experts: int, capacity: int) -> torch.Tensor:
    """Plain-PyTorch :func:`drop_over_capacity`: a stable sort by priority (descending), then
    a stable sort by expert, gives each slot's rank within its expert."""
    experts = _valid_experts(topk_indices, num_experts)
    flat = experts.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    _, by_priority = torch.sort(priority.reshape(-1), descending=True, stable=True)
    sorted_key, order = torch.sort(key.index_select(0, by_priority), stable=True)
    order = by_priority.index_select(0, order)
    position = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    group_start = torch.searchsorted(sorted_key, sorted_key)  # first place of each key
    rank = torch.empty_like(position).scatter_(0, order, position - group_start)
    return torch.where(rank.view_as(experts) < capacity, experts, -1)


@kernel
@triton.jit
def _drop_kernel(experts_ptr, priority_ptr, slot_ptr, counts_ptr, out_ptr, S, E, capacity,
                 ROWS: tl.constexpr, PEERS: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + rows, mask=rows < S, other=-1)
    held = slot >= 0
    expert = tl.load(experts_ptr + slot, mask=held, other=0).to(tl.int32)
    expert = tl.where(held, expert, 0)
    value = tl.load(priority_ptr + slot, mask=held, other=0.0).to(tl.float32)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
    ends = tl.cumsum(counts, axis=0)
    lo = tl.gather(ends - counts, expert, 0)  # the rows of this row's expert: [lo, hi)
    hi = tl.gather(ends, expert, 0)
    first = tl.min(tl.where(held, lo, S))
    last = tl.max(tl.where(held, hi, 0))
    ahead = tl.zeros([ROWS], dtype=tl.int32)
    for p0 in range(first, last, PEERS):
        peers = p0 + tl.arange(0, PEERS)
        peer_slot = tl.load(slot_ptr + peers, mask=peers < last, other=-1)
        peer_value = tl.load(priority_ptr + peer_slot, mask=peer_slot >= 0,
                             other=0.0).to(tl.float32)
        same = (peers[None, :] >= lo[:, None]) & (peers[None, :] < hi[:, None])
        before = (peer_value[None, :] > value[:, None]) | (
            (peer_value[None, :] == value[:, None]) & (peer_slot[None, :] < slot[:, None]))
        ahead += tl.sum((same & before).to(tl.int32), axis=1)
    tl.store(out_ptr + slot, tl.where(ahead < capacity, expert, -1).to(tl.int64), mask=held)


def drop_over_capacity(topk_indices: torch.Tensor, priority: torch.Tensor, num_experts: int,
                       capacity: int) -> torch.Tensor:
    """Each expert's slots beyond its ``capacity`` highest-``priority`` ones dropped.

    Args:
        topk_indices: ``(T, k)`` integer tensor: the expert of slot ``(t, j)``; values
            outside ``[0, num_experts)`` drop the slot.
        priority: ``(T, k)`` floating tensor; ties go to the lower slot (``t*k + j``).
        num_experts: ``E``; capacity: slots each expert keeps, ``>= 1``.

    Returns:
        ``(T, k)`` int64: the expert of every kept slot, ``-1`` for the others.
    """
    tokens, k = topk_indices.shape
    slots = tokens * k
    if (not use_triton(topk_indices) or num_experts > _ROUTING_MAX_EXPERTS or slots == 0
            or slots >= 2**31 or priority.dtype == torch.float64):
        return drop_over_capacity_reference(topk_indices, priority, num_experts, capacity)
    # The slots grouped by expert: the routing map of one-slot tokens names each row's slot.
    _, _, slot_of_row, counts = routing_map(topk_indices.reshape(slots, 1), num_experts, 1,
                                            slots)
    out = torch.full((tokens, k), -1, device=topk_indices.device, dtype=torch.int64)
    _drop_kernel[(cdiv(slots, _ROWS),)](
        topk_indices.contiguous(), priority.contiguous(), slot_of_row, counts, out, slots,
        num_experts, capacity, ROWS=_ROWS, PEERS=_PEERS,
        BLOCK_E=max(2, next_power_of_2(num_experts)), num_warps=4)
    return out
