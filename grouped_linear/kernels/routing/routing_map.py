"""The routing map of a top-k expert choice, in one kernel launch (two with several programs).

:func:`routing_map` places the routed slots ``(t, j)`` of a ``(T, k)`` expert choice in the
expert-grouped layout that ``permute`` writes: experts in order, slots ascending within an
expert, each group padded to a multiple; it returns the padded group sizes, each slot's row,
each row's token and each expert's slot count, on the device, without a host sync.
:func:`routing_map_reference` is the plain-PyTorch version (a stable sort by expert).
"""

import torch

from .._triton import cdiv, kernel, next_power_of_2, sm_count, tl, triton, use_triton
from ..ends import group_starts
from .rows import scatter_pdl

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton or none
    gdc_launch_dependents = gdc_wait = None

__all__ = ["routing_map", "routing_map_reference"]


# --------------------------------------------------------------------------- routing map
# Slot ``s = t*k + j`` of a ``(T, k)`` expert choice goes to a row of the expert-grouped
# layout: experts in order, slots ascending within an expert, each group padded with
# unused rows to a multiple. The kernel splits the slots into contiguous chunks, one per
# program. Phase 1: each program counts its chunk per expert (a histogram) and stores the
# counts. Phase 2: from the totals of all chunks' counts (padded group starts) and the
# counts of the chunks before its own, a program knows where its first slot of every
# expert lands, then walks its chunk in blocks: a slot's rank among the block's slots of
# its expert comes from a cumulative sum of the one-hot (few experts) or from comparing
# the slots pairwise (many experts), and the block's histogram moves the starts on.
# With several programs the phases are two launches of the same kernel (the launch boundary
# orders them; a grid barrier inside one launch would need every program resident at once,
# which a kernel holding SMs on another stream, NCCL's, can deny); one program runs both in
# one launch. Phase 2 sums every chunk's counts itself, so nothing accumulates across
# programs: the work tensor needs no zero fill (one launch fewer per call).
_ROUTING_MAX_EXPERTS = 1024
_COUNT_BLOCK = 1024  # slots per histogram step (phase 1)
_ONE_HOT_TILE = 8192  # one-hot elements per block of slots (phase 2, few experts)
_ONE_HOT_MAX_EXPERTS = 32  # above this, ranks by pairwise comparison
_MIN_CHUNK = 256  # fewest slots per program
# int32 work tensor: BLOCK_E counts per chunk (written by phase 1, read by phase 2).


def _kept(counts: torch.Tensor, capacity: int | None, keep: int | None) -> torch.Tensor:
    """The slots each expert keeps of its ``counts`` (first ones in slot order): at most
    ``capacity``, then only the first ``keep`` of the expert-sorted order."""
    if capacity is not None:
        counts = counts.clamp(max=capacity)
    if keep is not None:
        counts = (keep - (counts.cumsum(0) - counts)).clamp(min=0).minimum(counts)
    return counts


def routing_map_reference(topk_indices: torch.Tensor, num_experts: int, multiple: int,
                          num_rows: int | None, *, capacity: int | None = None,
                          keep: int | None = None, group_rows: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`routing_map` (a stable sort by expert); ``num_rows=None`` sizes
    ``token_of_row`` exactly, ``sum(m_splits)`` (a host read)."""
    tokens, k = topk_indices.shape
    slots = tokens * k
    device = topk_indices.device
    if topk_indices.dtype == torch.bool:  # a routing map: slot (t, e) is expert e's
        columns = torch.arange(k, device=device, dtype=torch.int64)
        topk_indices = torch.where(topk_indices, columns, -1)
    flat = topk_indices.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(num_experts, device=device, dtype=torch.int64)
    ends = torch.searchsorted(sorted_key, experts, right=True)
    if (capacity is None and keep is None and group_rows is None and multiple == 1
            and (num_rows is None or num_rows <= slots)):
        return _unpadded(sorted_key, order, ends, tokens, k, num_experts, num_rows)
    starts = group_starts(ends)
    counts = _kept(ends - starts, capacity, keep)
    if group_rows is not None:
        m_splits = torch.full_like(counts, group_rows)
    else:
        m_splits = (counts + (multiple - 1)) // multiple * multiple
    p_ends = m_splits.cumsum(0)
    p_starts = p_ends - m_splits

    # The slot at sorted position p is the (p - starts[e])-th of its expert: kept among the
    # first counts[e], at row p_starts[e] + (p - starts[e]).
    position = torch.arange(slots, device=device, dtype=torch.int64)
    expert = sorted_key.clamp(max=num_experts - 1)
    rank = position - starts.index_select(0, expert)
    dest = p_starts.index_select(0, expert) + rank
    dest = torch.where((sorted_key < num_experts) & (rank < counts.index_select(0, expert)),
                       dest, -1)
    row_map = torch.empty_like(dest).scatter_(0, order, dest).view(tokens, k)

    # Each row finds its group and place in it; rows past a group's slots hold none.
    if num_rows is None:
        num_rows = int(p_ends[-1])
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    group = torch.searchsorted(p_ends, rows, right=True)
    clamped = group.clamp(max=num_experts - 1)
    local = rows - p_starts.index_select(0, clamped)
    held = (group < num_experts) & (local < counts.index_select(0, clamped))
    if slots == 0:
        return m_splits, row_map, torch.full_like(rows, -1), counts
    sorted_pos = (starts.index_select(0, clamped) + local).clamp(0, slots - 1)
    token_of_row = torch.where(held, order.index_select(0, sorted_pos) // k, -1)
    return m_splits, row_map, token_of_row, counts


def _unpadded(sorted_key: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, tokens: int,
              k: int, num_experts: int, num_rows: int | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`routing_map_reference` where every slot is kept and nothing is padded: the slot
    at sorted position ``p`` is row ``p`` (the dropped ones sort last), a third of the ops
    (the CPU's routing is host-bound on small steps)."""
    slots = sorted_key.shape[0]
    counts = ends - group_starts(ends)
    position = torch.arange(slots, device=sorted_key.device, dtype=torch.int64)
    dest = torch.where(sorted_key < num_experts, position, -1)
    row_map = torch.empty_like(dest).scatter_(0, order, dest).view(tokens, k)
    kept = ends[-1]  # rows holding a slot
    num_rows = int(kept) if num_rows is None else num_rows
    token_of_row = torch.where(position[:num_rows] < kept, order[:num_rows] // k, -1)
    return counts, row_map, token_of_row, counts.clone()  # two tensors, as elsewhere


@triton.jit
def _map_tile(map_ptr, tokens, experts, end, E):
    """``(tokens, experts)`` of a ``(T, E)`` routing map as bools, false past ``end`` / ``E``."""
    mask = (tokens < end)[:, None] & (experts < E)[None, :]
    return tl.load(map_ptr + tokens.to(tl.int64)[:, None] * E + experts[None, :], mask=mask,
                   other=0) != 0


@kernel
@triton.jit
def _routing_kernel(topk_ptr, row_map_ptr, token_ptr, splits_ptr, counts_ptr, work_ptr, S, K, E,
                    N, multiple, capacity, keep, group_rows, chunk, num_programs,
                    PHASE: tl.constexpr, BLOCK: tl.constexpr, MAP: tl.constexpr,
                    MAP_TOKENS: tl.constexpr,
                    RANK_BLOCK: tl.constexpr, ONE_HOT: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    # With PDL every phase lets the launch after it start at once (phase 2 after phase 1,
    # the scatter after phase 2); phase 2 then waits for phase 1's counts before reading them.
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK)
    begin = pid.to(tl.int64) * chunk
    end = tl.minimum(begin + chunk, S)
    chunk_counts_ptr = work_ptr  # (num_programs, BLOCK_E): each chunk's count per expert
    if PHASE != 2:
        hist = tl.zeros([BLOCK_E], dtype=tl.int32)
        if MAP:  # chunks of tokens: their map rows' column sums
            for t0 in range(begin, end, MAP_TOKENS):
                tokens = t0 + tl.arange(0, MAP_TOKENS)
                hit = _map_tile(topk_ptr, tokens, experts, end, E)
                hist += tl.sum(hit.to(tl.int32), axis=0)
        else:
            for s0 in range(begin, end, BLOCK):
                slots = s0 + lanes
                in_chunk = slots < end
                raw = tl.load(topk_ptr + slots, mask=in_chunk, other=0)
                routed = in_chunk & (raw >= 0) & (raw < E)
                hist += tl.histogram(tl.where(routed, raw.to(tl.int32), 0), BLOCK_E,
                                     mask=routed)
        if PHASE == 1:
            tl.store(chunk_counts_ptr + pid * BLOCK_E + experts, hist)
    if PHASE != 1:
        if PDL and PHASE == 2:
            gdc_wait()
        if PHASE == 0:  # one program: its counts are the totals, no chunk comes before
            total = hist.to(tl.int64)
            earlier = tl.zeros([BLOCK_E], dtype=tl.int64)
        else:  # every chunk's counts: their sum, and the sum of the chunks before this one
            total = tl.zeros([BLOCK_E], dtype=tl.int64)
            earlier = tl.zeros([BLOCK_E], dtype=tl.int64)
            for p0 in range(0, num_programs, BLOCK_P):
                chunks = p0 + tl.arange(0, BLOCK_P)
                seen = tl.load(chunk_counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :],
                               mask=(chunks < num_programs)[:, None], other=0, cache_modifier=".cg")
                total += tl.sum(seen, axis=0).to(tl.int64)
                earlier += tl.sum(tl.where((chunks < pid)[:, None], seen, 0), axis=0).to(tl.int64)
        # The slots each expert keeps, its first in slot order: at most capacity, then only
        # the first keep of the expert-sorted order.
        kept = tl.minimum(total, capacity)
        kept = tl.minimum(tl.maximum(keep - (tl.cumsum(kept, axis=0) - kept), 0), kept)
        padded = (kept + multiple - 1) // multiple * multiple
        if group_rows > 0:
            padded = tl.where(experts < E, group_rows, 0).to(tl.int64)
        group_end = tl.cumsum(padded, axis=0)
        group_start = group_end - padded
        tl.store(splits_ptr + experts, padded, mask=(experts < E) & (pid == 0))
        tl.store(counts_ptr + experts, kept, mask=(experts < E) & (pid == 0))
        # Where this chunk's first slot of each expert goes: after the earlier chunks' slots;
        # a slot is kept if it lands before its group's first unkept place.
        base = group_start + earlier
        limit = group_start + kept
        if MAP:  # a slot's rank: the earlier tokens of its expert's column (a cumsum)
            for t0 in range(begin, end, MAP_TOKENS):
                tokens = t0 + tl.arange(0, MAP_TOKENS)
                hit = _map_tile(topk_ptr, tokens, experts, end, E)
                rank = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive
                dest = base[None, :] + (rank - 1).to(tl.int64)
                held = hit & (dest < limit[None, :])
                slots = tokens.to(tl.int64)[:, None] * K + experts[None, :]
                tl.store(row_map_ptr + slots, tl.where(held, dest, -1),
                         mask=(tokens < end)[:, None] & (experts < E)[None, :])
                tl.store(token_ptr + dest,
                         tl.broadcast_to(tokens.to(tl.int64)[:, None], (MAP_TOKENS, BLOCK_E)),
                         mask=held & (dest < N))
                base += tl.sum(hit.to(tl.int64), axis=0)
        else:
            rank_lanes = tl.arange(0, RANK_BLOCK)
            ahead = tl.load(topk_ptr + begin + rank_lanes, mask=begin + rank_lanes < end, other=0)
            for s0 in range(begin, end, RANK_BLOCK):
                slots = s0 + rank_lanes
                in_chunk = slots < end
                raw = ahead
                # the next block's experts load while this block is ranked
                ahead = tl.load(topk_ptr + slots + RANK_BLOCK, mask=slots + RANK_BLOCK < end, other=0)
                routed = in_chunk & (raw >= 0) & (raw < E)
                expert = tl.where(routed, raw.to(tl.int32), -1)
                if ONE_HOT:
                    hit = expert[:, None] == experts[None, :]
                    rank = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive, per expert column
                    dest = tl.sum(tl.where(hit, base[None, :] + (rank - 1).to(tl.int64), 0), axis=1)
                    bound = tl.sum(tl.where(hit, limit[None, :], 0), axis=1)
                    base += tl.sum(hit.to(tl.int64), axis=0)
                else:
                    # rank: the earlier slots of the block with the same expert
                    same = (expert[:, None] == expert[None, :]) & (rank_lanes[None, :] < rank_lanes[:, None])
                    rank = tl.sum(same.to(tl.int32), axis=1)
                    clamped = tl.maximum(expert, 0)
                    dest = tl.gather(base, clamped, 0) + rank
                    bound = tl.gather(limit, clamped, 0)
                    base += tl.histogram(clamped, BLOCK_E, mask=routed).to(tl.int64)
                held = routed & (dest < bound)
                dest = tl.where(held, dest, -1)
                tl.store(row_map_ptr + slots, dest, mask=in_chunk)
                tl.store(token_ptr + dest, slots // K, mask=held & (dest < N))
        # Rows that hold no slot: each group's padding (experts split among the programs)
        # and the rows past the last group.
        group_fill = group_start + kept
        for e in range(pid, E, num_programs):
            lo = tl.sum(tl.where(experts == e, group_fill, 0))
            hi = tl.minimum(tl.sum(tl.where(experts == e, group_end, 0)), N)
            for r0 in range(lo, hi, BLOCK):
                rows = r0 + lanes
                tl.store(token_ptr + rows, -1, mask=rows < hi)
        for r0 in range(tl.sum(padded) + pid * BLOCK, N, num_programs * BLOCK):
            rows = r0 + lanes
            tl.store(token_ptr + rows, -1, mask=rows < N)


def routing_map(topk_indices: torch.Tensor, num_experts: int, multiple: int, num_rows: int,
                max_programs: int | None = None, *, capacity: int | None = None,
                keep: int | None = None, group_rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where every routed slot goes in the expert-grouped, padded layout. No host sync.

    Args:
        topk_indices: ``(T, k)`` integer tensor: the expert of slot ``(t, j)``; values
            outside ``[0, num_experts)`` (``-1``) drop the slot. Or a bool ``(T, E)``
            routing map: slot ``(t, e)`` goes to expert ``e`` where set (read as tiles of
            whole rows, each rank a column sum).
        num_experts: ``E``; multiple: every group is padded to a multiple of it.
        num_rows: rows of the layout, at least ``sum(m_splits)`` (``T*k + E*(multiple-1)``
            always is).
        max_programs: at most this many chunks of slots (default: one per SM).
        capacity: each expert keeps at most this many of its slots, its first in slot
            order; the others are dropped (``row_map`` -1).
        keep: after ``capacity``, only the first ``keep`` slots of the expert-sorted order
            (experts ascending, slots ascending within one) are kept.
        group_rows: every group has exactly this many rows instead of its kept slots padded
            to ``multiple`` (each expert must keep at most ``group_rows``).

    Returns:
        ``(m_splits, row_map, token_of_row, counts)``: ``(E,)`` int64 padded group sizes;
        ``(T, k)`` int64 row of every slot (slots ascending within an expert), ``-1`` if
        dropped; ``(num_rows,)`` int64 token of every row, ``-1`` for rows that hold no slot;
        ``(E,)`` int64 slots kept by each expert (its group's first ``counts`` rows hold
        them, the other ``m_splits - counts`` are padding).
    """
    tokens, k = topk_indices.shape
    slots = tokens * k
    if (not use_triton(topk_indices) or num_experts > _ROUTING_MAX_EXPERTS
            or slots >= 2**31 or num_rows >= 2**62):
        return routing_map_reference(topk_indices, num_experts, multiple, num_rows,
                                     capacity=capacity, keep=keep, group_rows=group_rows)
    device = topk_indices.device
    block_e = max(2, next_power_of_2(num_experts))
    one_hot = block_e <= _ONE_HOT_MAX_EXPERTS
    # Blocks compared pairwise: larger ones for many experts, as each block also costs a
    # histogram and a gather over all the experts (tuned on an H200, 64K to 256K slots).
    rank_block = max(16, _ONE_HOT_TILE // block_e) if one_hot else (32 if block_e <= 256 else 128)
    block = max(_COUNT_BLOCK, rank_block)
    limit = max_programs if max_programs is not None else sm_count(device)
    is_map = topk_indices.dtype == torch.bool
    # A map is read as tiles of whole rows: chunks of tokens, ranks from column sums.
    map_tokens = max(1, _ONE_HOT_TILE // block_e)
    unit, items = (map_tokens, tokens) if is_map else (rank_block, slots)
    chunk = cdiv(max(cdiv(items, limit), cdiv(_MIN_CHUNK, max(k, 1) if is_map else 1)),
                 unit) * unit
    programs = max(1, cdiv(items, chunk))
    work = torch.empty(block_e * programs, device=device, dtype=torch.int32)
    m_splits = torch.empty(num_experts, device=device, dtype=torch.int64)
    counts = torch.empty(num_experts, device=device, dtype=torch.int64)
    row_map = torch.empty(tokens, k, device=device, dtype=torch.int64)
    token_of_row = torch.empty(num_rows, device=device, dtype=torch.int64)
    phases = (1, 2) if programs > 1 else (0,)
    pdl = gdc_launch_dependents is not None and scatter_pdl(device)
    for phase in phases:
        _routing_kernel[(programs,)](
            topk_indices.contiguous().view(torch.uint8) if is_map else topk_indices.contiguous(),
            row_map, token_of_row, m_splits, counts, work, items, max(k, 1), num_experts,
            num_rows, multiple,
            slots if capacity is None else min(capacity, slots), slots if keep is None else keep,
            group_rows or 0, chunk, programs, PHASE=phase, BLOCK=block, MAP=is_map,
            MAP_TOKENS=map_tokens,
            RANK_BLOCK=rank_block, ONE_HOT=one_hot, BLOCK_E=block_e,
            BLOCK_P=max(1, min(64, _ONE_HOT_TILE // block_e)), PDL=pdl,
            num_warps=8 if one_hot else 4, **({"launch_pdl": True} if pdl and phase == 2 else {}))
    return m_splits, row_map, token_of_row, counts
