"""Per-expert capacity by priority: each expert keeps its ``capacity`` highest-priority slots.

:func:`drop_over_capacity` groups the slots by expert (the routing map of the slots
themselves, one row per slot), then one program per expert over more than ``capacity``
slots finds the ``capacity``-th largest of their keys (priority, then the lower slot) by a
radix select: up to 16 passes over the group's keys, each a histogram of 4 bits, until the
digit chosen keeps all of its keys. At most 18 reads of each slot's key, on the device,
without a host sync (ranking the slots pairwise, its first form, read 0.21-0.40 of copy for
the whole permute on the layouts bench).
:func:`drop_over_capacity_reference` is the plain-PyTorch version (two stable sorts).
"""

import torch

from .._triton import kernel, next_power_of_2, tl, triton, use_triton
from .routing_map import _ROUTING_MAX_EXPERTS, routing_map

__all__ = ["drop_over_capacity", "drop_over_capacity_reference"]

_BLOCK = 2048  # rows per step of a program


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


@triton.jit
def _sort_key(value, slot):
    """uint64 keys in the order of the slots' ranks: higher priority first, then lower slot.
    High word: the float32 priority's bits made order-preserving as unsigned (``-0.0`` taken
    as ``+0.0``; every NaN, whatever its sign and payload, above ``+inf``, as ``torch.sort``
    ranks it); low word: ``2**32 - 1 - slot``."""
    bits = (value + 0.0).to(tl.uint32, bitcast=True)
    bits = tl.where(value != value, 0x7FFFFFFF, bits).to(tl.uint64)
    negative = bits >= 0x80000000
    ordered = tl.where(negative, 0xFFFFFFFF - bits, bits + 0x80000000)
    return (ordered << 32) | (0xFFFFFFFF - slot.to(tl.uint64))


@kernel
@triton.jit
def _drop_kernel(priority_ptr, slot_ptr, counts_ptr, keys_ptr, out_ptr, E, capacity,
                 BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program per expert, over its rows ``[start, start + n)`` of the slots grouped by
    expert. With more than ``capacity`` slots: each slot's key (scratch ``keys``), then the
    ``capacity``-th largest key by a radix select (passes of 4 bits, a histogram of the keys
    that share the bits chosen so far, until the chosen digit keeps all of its keys), and the
    slots whose key reaches it are kept."""
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
    start = tl.sum(tl.where(experts < e, counts, 0))
    n = tl.sum(tl.where(experts == e, counts, 0))
    lanes = tl.arange(0, BLOCK)
    threshold = tl.zeros([], dtype=tl.uint64)  # every key reaches it: all kept
    if n > capacity:
        for r0 in range(start, start + n, BLOCK):
            rows = r0 + lanes
            in_group = rows < start + n
            slot = tl.load(slot_ptr + rows, mask=in_group, other=0)
            value = tl.load(priority_ptr + slot, mask=in_group, other=0.0).to(tl.float32)
            tl.store(keys_ptr + rows, _sort_key(value, slot).to(tl.int64, bitcast=True),
                     mask=in_group)
        digits = tl.arange(0, 16)
        prefix = tl.zeros([], dtype=tl.uint64)
        chosen = tl.zeros([], dtype=tl.uint64)  # the bits of prefix fixed so far
        wanted = tl.zeros([], dtype=tl.int64) + capacity  # its rank among those sharing prefix
        found = tl.zeros([], dtype=tl.int32)
        for step in tl.static_range(16):
            if found == 0:
                shift = 60 - 4 * step
                hist = tl.zeros([16], dtype=tl.int32)
                for r0 in range(start, start + n, BLOCK):
                    rows = r0 + lanes
                    in_group = rows < start + n
                    keys = tl.load(keys_ptr + rows, mask=in_group,
                                   other=0).to(tl.uint64, bitcast=True)
                    match = in_group & ((keys & chosen) == prefix)
                    hist += tl.histogram(((keys >> shift) & 15).to(tl.int32), 16, mask=match)
                # the largest digit d whose keys, with those of larger digits, reach the rank
                above = tl.sum(hist) - tl.cumsum(hist, axis=0)  # keys with a larger digit
                reach = (above + hist) >= wanted
                d = tl.max(tl.where(reach, digits, -1))
                wanted -= tl.sum(tl.where(digits == d, above, 0)).to(tl.int64)
                prefix = prefix | (d.to(tl.uint64) << shift)
                chosen = chosen | (tl.full([], 15, tl.uint64) << shift)
                # every key of digit d kept: the prefix (lower bits zero) is a threshold
                found = (wanted == tl.sum(tl.where(digits == d, hist, 0))).to(tl.int32)
        threshold = prefix
    for r0 in range(start, start + n, BLOCK):
        rows = r0 + lanes
        in_group = rows < start + n
        slot = tl.load(slot_ptr + rows, mask=in_group, other=0)
        if n > capacity:
            keys = tl.load(keys_ptr + rows, mask=in_group, other=0).to(tl.uint64, bitcast=True)
            keep = keys >= threshold
        else:
            keep = in_group
        tl.store(out_ptr + slot, tl.where(keep, e, -1).to(tl.int64), mask=in_group)


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
    keys = torch.empty(slots, device=topk_indices.device, dtype=torch.int64)
    _drop_kernel[(num_experts,)](
        priority.contiguous(), slot_of_row, counts, keys, out, num_experts,
        min(capacity, slots), BLOCK=_BLOCK, BLOCK_E=max(2, next_power_of_2(num_experts)),
        num_warps=8)
    return out
