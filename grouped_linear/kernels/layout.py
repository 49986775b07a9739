"""Move rows between two layouts of the same groups, in one pass (padding and unpadding).

Both layouts hold ``G`` consecutive groups, given by ``(G,)`` non-decreasing cumulative
group ends; the ``i``-th row of group ``g`` in one pairs with the ``i``-th row of group
``g`` in the other while both groups have it. :func:`relayout` writes every row of the
destination exactly once: its partner row from the source, or zeros (padding rows,
rows past the last group). No separate zero fill, no host sync, deterministic.

Beside it: row gathers and the weighted k-way combine of routed rows, and
:func:`routing_map`, which places the routed slots of a top-k expert choice in the
expert-grouped, padded layout in one launch.
"""

import functools

import torch

from ._triton import tl, triton, use_triton
from .bias import _row_group

__all__ = ["relayout", "relayout_reference", "gather_rows", "gather_rows_reference",
           "combine_rows", "combine_rows_reference", "spread_rows", "spread_rows_reference",
           "scatter_rows", "routing_map", "routing_map_reference", "SCATTER_CONFIG",
           "COMBINE_CONFIG"]

# Launch shapes (rows per program, columns per program, warps) of scatter_rows (permute forward)
# and combine_rows (unpermute forward, permute backward); the layouts bench times them.
SCATTER_CONFIG = (16, 256, 4)
COMBINE_CONFIG = (2, 2048, 4)


def _starts(ends: torch.Tensor) -> torch.Tensor:
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def relayout_reference(src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor,
                       num_dst_rows: int) -> torch.Tensor:
    """Plain-PyTorch :func:`relayout`: a searchsorted pairing, then a masked gather."""
    dst_ends, src_ends = dst_ends.to(torch.int64), src_ends.to(torch.int64)
    num_groups = dst_ends.shape[0]
    rows = torch.arange(num_dst_rows, device=src.device, dtype=torch.int64)
    dst_starts, src_starts = _starts(dst_ends), _starts(src_ends)
    group = torch.searchsorted(dst_ends, rows, right=True)
    clamped = group.clamp(max=num_groups - 1)
    local = rows - dst_starts.index_select(0, clamped)
    limit = torch.minimum(dst_ends - dst_starts, src_ends - src_starts)
    valid = (group < num_groups) & (local < limit.index_select(0, clamped))
    if src.shape[0] == 0 or num_dst_rows == 0:
        return src.new_zeros(num_dst_rows, src.shape[1])
    index = (src_starts.index_select(0, clamped) + local).clamp(0, src.shape[0] - 1)
    return src.index_select(0, index).masked_fill_(~valid.unsqueeze(1), 0)


@triton.jit
def _relayout_kernel(src_ptr, dst_ptr, src_ends_ptr, dst_ends_ptr, R_dst, H, G,
                     stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    group = _row_group(dst_ends_ptr, rows, G, BLOCK_G)
    g = tl.minimum(group, G - 1)
    dst_end = tl.load(dst_ends_ptr + g)
    dst_start = tl.load(dst_ends_ptr + g - 1, mask=g > 0, other=0)
    src_end = tl.load(src_ends_ptr + g)
    src_start = tl.load(src_ends_ptr + g - 1, mask=g > 0, other=0)
    local = rows - dst_start
    valid = (group < G) & (local < tl.minimum(dst_end - dst_start, src_end - src_start))
    src_rows = (src_start + local).to(tl.int64)
    col_mask = (cols < H)[None, :]
    values = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :],
                     mask=valid[:, None] & col_mask, other=0.0)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], values,
             mask=(rows < R_dst)[:, None] & col_mask)


def relayout(src: torch.Tensor, src_ends: torch.Tensor, dst_ends: torch.Tensor,
             num_dst_rows: int) -> torch.Tensor:
    """``(R_src, H)`` in the source layout -> ``(num_dst_rows, H)`` in the destination one.

    ``src_ends`` / ``dst_ends``: ``(G,)`` cumulative group ends of each layout, on
    ``src``'s device, non-decreasing and within each tensor's rows.
    """
    G = dst_ends.shape[0]
    if (not use_triton(src) or src.dim() != 2 or src.stride(-1) != 1 or src.shape[0] == 0
            or num_dst_rows == 0 or G > 4096):
        return relayout_reference(src, src_ends, dst_ends, num_dst_rows)
    H = src.shape[1]
    dst = torch.empty(num_dst_rows, H, device=src.device, dtype=src.dtype)
    block_r, block_h = 16, min(256, triton.next_power_of_2(max(H, 16)))
    grid = (triton.cdiv(num_dst_rows, block_r), triton.cdiv(H, block_h))
    _relayout_kernel[grid](src, dst, src_ends, dst_ends, num_dst_rows, H, G, src.stride(0),
                           dst.stride(0), BLOCK_R=block_r, BLOCK_H=block_h,
                           BLOCK_G=min(64, triton.next_power_of_2(G)))
    return dst


# --------------------------------------------------------------------------- row gathers
def gather_rows_reference(src: torch.Tensor, index: torch.Tensor,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = scale[r] * src[index[r]]``, a zero row where ``index[r]`` is outside ``src``."""
    valid = (index >= 0) & (index < src.shape[0])
    if src.shape[0] == 0 or index.numel() == 0:
        return src.new_zeros(index.shape[0], *src.shape[1:])
    out = src.index_select(0, index.clamp(0, src.shape[0] - 1))
    out = out.masked_fill_(~valid.view(-1, *([1] * (src.dim() - 1))), 0)
    if scale is not None:
        out = (out.float() * scale.float().masked_fill(~valid, 0).unsqueeze(1)).to(src.dtype)
    return out


def combine_rows_reference(src: torch.Tensor, row_map: torch.Tensor,
                           weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * src[row_map[t, j]]`` in float32, over the slots whose
    row lies inside ``src``; output in ``src``'s dtype."""
    tokens, k = row_map.shape
    rows = gather_rows_reference(src, row_map.reshape(-1)).view(tokens, k, -1).float()
    if weights is not None:
        valid = (row_map >= 0) & (row_map < src.shape[0])
        rows = rows * weights.float().masked_fill(~valid, 0).unsqueeze(-1)
    return rows.sum(dim=1).to(src.dtype)


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, index_ptr, scale_ptr, R, R_src, H, stride_src,
                        stride_dst, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """``dst[r] = scale[r] * src[index[r]]``, zeros where the index is outside ``src``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    index = tl.load(index_ptr + rows, mask=rows < R, other=-1).to(tl.int64)
    valid = (index >= 0) & (index < R_src)
    values = tl.load(src_ptr + index[:, None] * stride_src + cols[None, :],
                     mask=valid[:, None] & col_mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        values = values.to(tl.float32) * scale[:, None]
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :],
             values.to(dst_ptr.dtype.element_ty), mask=(rows < R)[:, None] & col_mask)


@triton.jit
def _combine_rows_kernel(src_ptr, dst_ptr, map_ptr, weights_ptr, T, K, R_src, H, stride_src,
                         stride_dst, HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    token_mask = tokens < T
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in range(0, K):  # fixed slot order: deterministic
        slot = tokens.to(tl.int64) * K + j
        row = tl.load(map_ptr + slot, mask=token_mask, other=-1).to(tl.int64)
        valid = (row >= 0) & (row < R_src)
        values = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :],
                         mask=valid[:, None] & col_mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        acc += values
    tl.store(dst_ptr + tokens.to(tl.int64)[:, None] * stride_dst + cols[None, :],
             acc.to(dst_ptr.dtype.element_ty), mask=token_mask[:, None] & col_mask)


def _rows_kernel_ok(src: torch.Tensor) -> bool:
    return (use_triton(src) and src.dim() == 2 and src.stride(-1) == 1
            and src.dtype != torch.float64 and src.shape[1] > 0)


def gather_rows(src: torch.Tensor, index: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(R_src, H)`` -> ``(R, H)``: row ``index[r]`` of ``src`` (times ``scale[r]``, in
    float32, when given), zeros where the index is outside ``src`` (-1 for "none").
    One read of the gathered rows, one write."""
    if (not _rows_kernel_ok(src) or index.numel() == 0 or src.shape[0] == 0
            or (scale is not None and scale.dtype == torch.float64)):
        return gather_rows_reference(src, index, scale)
    R, H = index.shape[0], src.shape[1]
    # The CPU interpreter truncates float32 -> bf16: with a scale, torch does the rounding.
    out_dtype = torch.float32 if scale is not None and src.device.type == "cpu" else src.dtype
    out = torch.empty(R, H, device=src.device, dtype=out_dtype)
    block_r, block_h = 16, min(256, triton.next_power_of_2(H))
    _gather_rows_kernel[(triton.cdiv(R, block_r), triton.cdiv(H, block_h))](
        src, out, index.contiguous(), scale.contiguous() if scale is not None else src, R,
        src.shape[0], H, src.stride(0), out.stride(0), HAS_SCALE=scale is not None,
        BLOCK_R=block_r, BLOCK_H=block_h)
    return out.to(src.dtype)


@triton.jit
def _scatter_rows_kernel(src_ptr, dst_ptr, map_ptr, token_ptr, weights_ptr, T, K, N, H,
                         stride_src, stride_dst, token_programs, HAS_WEIGHTS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Programs ``< token_programs``: ``BLOCK_T`` source rows, read once and written to each
    of their ``K`` slots' rows ``map[t, j]`` (those in ``[0, N)``), times ``weights[t, j]``
    (float32) with ``HAS_WEIGHTS``. The others: one block of ``BLOCK_T`` destination rows
    each, zeros where ``token[r] < 0`` (rows no slot holds)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = (cols < H)[None, :]
    lanes = tl.arange(0, BLOCK_T)
    if pid < token_programs:
        tokens = pid * BLOCK_T + lanes
        token_mask = tokens < T
        values = tl.load(src_ptr + tokens.to(tl.int64)[:, None] * stride_src + cols[None, :],
                         mask=token_mask[:, None] & col_mask, other=0.0)
        for j in range(0, K):
            slot = tokens.to(tl.int64) * K + j
            row = tl.load(map_ptr + slot, mask=token_mask, other=-1).to(tl.int64)
            valid = (row >= 0) & (row < N)
            if HAS_WEIGHTS:
                weight = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
                out = (values.to(tl.float32) * weight[:, None]).to(dst_ptr.dtype.element_ty)
            else:
                out = values
            tl.store(dst_ptr + row[:, None] * stride_dst + cols[None, :], out,
                     mask=valid[:, None] & col_mask)
    else:
        rows = (pid - token_programs) * BLOCK_T + lanes
        token = tl.load(token_ptr + rows, mask=rows < N, other=0)
        zeros = tl.zeros([BLOCK_T, BLOCK_H], dtype=dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], zeros,
                 mask=((rows < N) & (token < 0))[:, None] & col_mask)


def _scatter(src: torch.Tensor, row_map: torch.Tensor, held: torch.Tensor,
             weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Launch :func:`_scatter_rows_kernel`: ``held`` ``(N,)``, negative for rows no slot holds."""
    tokens, k = row_map.shape
    num_rows, H = held.shape[0], src.shape[1]
    out = torch.empty(num_rows, H, device=src.device, dtype=out_dtype)
    block_t, block_h, warps = SCATTER_CONFIG
    block_h = min(block_h, triton.next_power_of_2(H))
    token_programs = triton.cdiv(tokens, block_t)
    grid = (token_programs + triton.cdiv(num_rows, block_t), triton.cdiv(H, block_h))
    _scatter_rows_kernel[grid](
        src, out, row_map.contiguous(), held.contiguous(),
        weights.contiguous() if weights is not None else src, tokens, k, num_rows, H,
        src.stride(0), out.stride(0), token_programs, HAS_WEIGHTS=weights is not None,
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)
    return out


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, token_of_row: torch.Tensor
                 ) -> torch.Tensor:
    """``(T, H)`` -> ``(N, H)`` with ``N = len(token_of_row)``: ``out[row_map[t, j]] = src[t]``,
    zero rows where ``token_of_row`` is negative. ``row_map`` ``(T, k)`` and ``token_of_row``
    must describe the same placement (as :func:`routing_map` returns them); the result
    equals ``gather_rows(src, token_of_row)`` but reads each source row once, however many
    slots use it."""
    tokens, k = row_map.shape
    num_rows = token_of_row.shape[0]
    if not _rows_kernel_ok(src) or tokens == 0 or k == 0 or num_rows == 0:
        return gather_rows_reference(src, token_of_row)
    return _scatter(src, row_map, token_of_row, None, src.dtype)


def spread_rows_reference(src: torch.Tensor, row_map: torch.Tensor, num_rows: int,
                          weights: torch.Tensor | None) -> torch.Tensor:
    """``(T, H)`` -> ``(num_rows, H)``: ``out[row_map[t, j]] = weights[t, j] * src[t]`` (in
    float32, or float64 when either input is) for the slots whose row lies in
    ``[0, num_rows)``; rows no slot holds are 0. Rows held by a slot must be distinct."""
    tokens, k = row_map.shape
    wide = src.dtype == torch.float64 or (weights is not None and weights.dtype == torch.float64)
    acc = torch.float64 if wide else torch.float32
    flat = row_map.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_rows)
    out = torch.zeros(num_rows + 1, *src.shape[1:], dtype=acc, device=src.device)
    rows = src.to(acc).repeat_interleave(k, dim=0)
    if weights is not None:
        rows = rows * weights.reshape(-1, 1).to(acc)
    out.index_copy_(0, torch.where(valid, flat, num_rows), rows)
    return out[:num_rows].to(src.dtype)


@triton.jit
def _slot_of_row_kernel(map_ptr, slot_ptr, S, N, BLOCK: tl.constexpr):
    """``slot[map[s]] = s`` for the slots ``s`` whose row is in ``[0, N)``."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(map_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
    tl.store(slot_ptr + rows, slots.to(tl.int64), mask=(slots < S) & (rows >= 0) & (rows < N))


def spread_rows(src: torch.Tensor, row_map: torch.Tensor, num_rows: int,
                weights: torch.Tensor | None) -> torch.Tensor:
    """:func:`spread_rows_reference` as an inverse slot map (one small kernel, to know the
    rows no slot holds) and a scatter of the source rows, each read once and written to
    its slots' rows, scaled by their weights; unheld rows written as zeros."""
    tokens, k = row_map.shape
    if (not _rows_kernel_ok(src) or tokens == 0 or k == 0 or num_rows == 0
            or (weights is not None and weights.dtype == torch.float64)):
        return spread_rows_reference(src, row_map, num_rows, weights)
    slot_of_row = torch.full((num_rows,), -1, device=src.device, dtype=torch.int64)
    _slot_of_row_kernel[(triton.cdiv(tokens * k, 1024),)](
        row_map.contiguous(), slot_of_row, tokens * k, num_rows, BLOCK=1024)
    # The CPU interpreter truncates float32 -> bf16: with weights, torch does the rounding.
    out_dtype = torch.float32 if weights is not None and src.device.type == "cpu" else src.dtype
    return _scatter(src, row_map, slot_of_row, weights, out_dtype).to(src.dtype)


def combine_rows(src: torch.Tensor, row_map: torch.Tensor,
                 weights: torch.Tensor | None) -> torch.Tensor:
    """``(R_src, H)`` -> ``(T, H)``: ``sum_j weights[t, j] * src[row_map[t, j]]`` over the
    slots whose row lies in ``src``, accumulated in float32 in slot order. One read of
    the routed rows, one write."""
    tokens, k = row_map.shape
    if not _rows_kernel_ok(src) or tokens == 0 or k == 0 or src.shape[0] == 0 or (
            weights is not None and weights.dtype == torch.float64):
        return combine_rows_reference(src, row_map, weights)
    H = src.shape[1]
    # Triton 3.6's CPU interpreter truncates float32 -> bf16 instead of rounding: there the
    # kernel writes float32 and torch rounds.
    out_dtype = torch.float32 if src.device.type == "cpu" else src.dtype
    out = torch.empty(tokens, H, device=src.device, dtype=out_dtype)
    block_t, block_h, warps = COMBINE_CONFIG
    block_h = min(block_h, triton.next_power_of_2(H))
    _combine_rows_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(H, block_h))](
        src, out, row_map.contiguous(), weights.contiguous() if weights is not None else src,
        tokens, k, src.shape[0], H, src.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)
    return out.to(src.dtype)


# --------------------------------------------------------------------------- routing map
# Slot ``s = t*k + j`` of a ``(T, k)`` expert choice goes to a row of the expert-grouped
# layout: experts in order, slots ascending within an expert, each group padded with
# unused rows to a multiple. The kernel splits the slots into contiguous chunks, one per
# program. Phase 1: each program counts its chunk per expert (a histogram), stores the
# counts and adds them to the totals. Phase 2: from the totals (padded group starts) and
# the counts of the chunks before its own, a program knows where its first slot of every
# expert lands, then walks its chunk in blocks: a slot's rank among the block's slots of
# its expert comes from a cumulative sum of the one-hot (few experts) or from comparing
# the slots pairwise (many experts), and the block's histogram moves the starts on.
# With several programs the phases are two launches of the same kernel (the launch boundary
# orders them); one program runs both in one launch. The kernel also has a grid-barrier
# form (PHASE=0 with several programs) that saves the second launch, unused: it needs every
# program resident at once, which a kernel holding SMs on another stream (NCCL) can deny.
_ROUTING_MAX_EXPERTS = 1024
_COUNT_BLOCK = 1024  # slots per histogram step (phase 1)
_ONE_HOT_TILE = 8192  # one-hot elements per block of slots (phase 2, few experts)
_ONE_HOT_MAX_EXPERTS = 32  # above this, ranks by pairwise comparison
_MIN_CHUNK = 256  # fewest slots per program
# int32 work tensor: [0] the barrier counter, [32, 32 + BLOCK_E) the totals per expert,
# then BLOCK_E counts per chunk.


def routing_map_reference(topk_indices: torch.Tensor, num_experts: int, multiple: int,
                          num_rows: int | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`routing_map` (a stable sort by expert); ``num_rows=None`` sizes
    ``token_of_row`` exactly, ``sum(m_splits)`` (a host read)."""
    tokens, k = topk_indices.shape
    slots = tokens * k
    device = topk_indices.device
    flat = topk_indices.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(num_experts, device=device, dtype=torch.int64)
    ends = torch.searchsorted(sorted_key, experts, right=True)
    starts = _starts(ends)
    counts = ends - starts
    m_splits = (counts + (multiple - 1)) // multiple * multiple
    p_ends = m_splits.cumsum(0)
    p_starts = p_ends - m_splits

    # The slot at sorted position p goes to p_starts[e] + (p - starts[e]).
    position = torch.arange(slots, device=device, dtype=torch.int64)
    expert = sorted_key.clamp(max=num_experts - 1)
    dest = p_starts.index_select(0, expert) + position - starts.index_select(0, expert)
    dest = torch.where(sorted_key < num_experts, dest, -1)
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
        return m_splits, row_map, torch.full_like(rows, -1)
    sorted_pos = (starts.index_select(0, clamped) + local).clamp(0, slots - 1)
    token_of_row = torch.where(held, order.index_select(0, sorted_pos) // k, -1)
    return m_splits, row_map, token_of_row


@triton.jit
def _routing_kernel(topk_ptr, row_map_ptr, token_ptr, splits_ptr, work_ptr, S, K, E, N,
                    multiple, chunk, num_programs, PHASE: tl.constexpr, BLOCK: tl.constexpr,
                    RANK_BLOCK: tl.constexpr, ONE_HOT: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK)
    begin = pid.to(tl.int64) * chunk
    end = tl.minimum(begin + chunk, S)
    totals_ptr = work_ptr + 32
    counts_ptr = totals_ptr + BLOCK_E  # (num_programs, BLOCK_E) per-chunk counts
    if PHASE != 2:
        hist = tl.zeros([BLOCK_E], dtype=tl.int32)
        for s0 in range(begin, end, BLOCK):
            slots = s0 + lanes
            in_chunk = slots < end
            raw = tl.load(topk_ptr + slots, mask=in_chunk, other=0)
            routed = in_chunk & (raw >= 0) & (raw < E)
            hist += tl.histogram(tl.where(routed, raw.to(tl.int32), 0), BLOCK_E, mask=routed)
        tl.store(counts_ptr + pid * BLOCK_E + experts, hist)
        tl.atomic_add(totals_ptr + experts, hist, mask=experts < E, sem="relaxed")
    if PHASE == 0:
        # Grid barrier: every thread's stores are done before one thread arrives (release);
        # the spin reads the counter with acquire, then the block waits for it.
        tl.debug_barrier()
        tl.atomic_add(work_ptr, 1, sem="release")
        arrived = tl.atomic_add(work_ptr, 0, sem="acquire")
        while arrived < num_programs:
            arrived = tl.atomic_add(work_ptr, 0, sem="acquire")
        tl.debug_barrier()
    if PHASE != 1:
        total = tl.load(totals_ptr + experts, mask=experts < E, other=0,
                        cache_modifier=".cg").to(tl.int64)
        padded = (total + multiple - 1) // multiple * multiple
        group_end = tl.cumsum(padded, axis=0)
        group_start = group_end - padded
        tl.store(splits_ptr + experts, padded, mask=(experts < E) & (pid == 0))
        # Where this chunk's first slot of each expert goes: after the earlier chunks' slots.
        base = group_start
        for p0 in range(0, pid, BLOCK_P):
            chunks = p0 + tl.arange(0, BLOCK_P)
            before = tl.load(counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :],
                             mask=(chunks < pid)[:, None], other=0, cache_modifier=".cg")
            base += tl.sum(before, axis=0).to(tl.int64)
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
                base += tl.sum(hit.to(tl.int64), axis=0)
            else:
                # rank: the earlier slots of the block with the same expert
                same = (expert[:, None] == expert[None, :]) & (rank_lanes[None, :] < rank_lanes[:, None])
                rank = tl.sum(same.to(tl.int32), axis=1)
                clamped = tl.maximum(expert, 0)
                dest = tl.gather(base, clamped, 0) + rank
                base += tl.histogram(clamped, BLOCK_E, mask=routed).to(tl.int64)
            dest = tl.where(routed, dest, -1)
            tl.store(row_map_ptr + slots, dest, mask=in_chunk)
            tl.store(token_ptr + dest, slots // K, mask=routed & (dest < N))
        # Rows that hold no slot: each group's padding (experts split among the programs)
        # and the rows past the last group.
        group_fill = group_start + total
        for e in range(pid, E, num_programs):
            lo = tl.sum(tl.where(experts == e, group_fill, 0))
            hi = tl.minimum(tl.sum(tl.where(experts == e, group_end, 0)), N)
            for r0 in range(lo, hi, BLOCK):
                rows = r0 + lanes
                tl.store(token_ptr + rows, -1, mask=rows < hi)
        for r0 in range(tl.sum(padded) + pid * BLOCK, N, num_programs * BLOCK):
            rows = r0 + lanes
            tl.store(token_ptr + rows, -1, mask=rows < N)


@functools.lru_cache(maxsize=8)
def _max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def routing_map(topk_indices: torch.Tensor, num_experts: int, multiple: int, num_rows: int,
                max_programs: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where every routed slot goes in the expert-grouped, padded layout. No host sync.

    Args:
        topk_indices: ``(T, k)`` integer tensor: the expert of slot ``(t, j)``; values
            outside ``[0, num_experts)`` (``-1``) drop the slot.
        num_experts: ``E``; multiple: every group is padded to a multiple of it.
        num_rows: rows of the layout, at least ``sum(m_splits)`` (``T*k + E*(multiple-1)``
            always is).
        max_programs: at most this many chunks of slots (default: one per SM).

    Returns:
        ``(m_splits, row_map, token_of_row)``: ``(E,)`` int64 padded group sizes; ``(T, k)``
        int64 row of every slot (slots ascending within an expert), ``-1`` if dropped;
        ``(num_rows,)`` int64 token of every row, ``-1`` for rows that hold no slot.
    """
    tokens, k = topk_indices.shape
    slots = tokens * k
    if (not use_triton(topk_indices) or num_experts > _ROUTING_MAX_EXPERTS
            or slots >= 2**31 or num_rows >= 2**62):
        return routing_map_reference(topk_indices, num_experts, multiple, num_rows)
    device = topk_indices.device
    block_e = max(2, triton.next_power_of_2(num_experts))
    one_hot = block_e <= _ONE_HOT_MAX_EXPERTS
    # Blocks compared pairwise: larger ones for many experts, as each block also costs a
    # histogram and a gather over all the experts (tuned on an H200, 64K to 256K slots).
    rank_block = max(16, _ONE_HOT_TILE // block_e) if one_hot else (32 if block_e <= 256 else 128)
    block = max(_COUNT_BLOCK, rank_block)
    limit = max_programs if max_programs is not None else _max_programs(device)
    chunk = triton.cdiv(max(triton.cdiv(slots, limit), _MIN_CHUNK), rank_block) * rank_block
    programs = max(1, triton.cdiv(slots, chunk))
    work = torch.zeros(32 + block_e * (programs + 1), device=device, dtype=torch.int32)
    m_splits = torch.empty(num_experts, device=device, dtype=torch.int64)
    row_map = torch.empty(tokens, k, device=device, dtype=torch.int64)
    token_of_row = torch.empty(num_rows, device=device, dtype=torch.int64)
    phases = (1, 2) if programs > 1 else (0,)
    for phase in phases:
        _routing_kernel[(programs,)](
            topk_indices.contiguous(), row_map, token_of_row, m_splits, work, slots, max(k, 1),
            num_experts, num_rows, multiple, chunk, programs, PHASE=phase, BLOCK=block,
            RANK_BLOCK=rank_block, ONE_HOT=one_hot, BLOCK_E=block_e,
            BLOCK_P=max(1, min(64, _ONE_HOT_TILE // block_e)), num_warps=8 if one_hot else 4)
    return m_splits, row_map, token_of_row
