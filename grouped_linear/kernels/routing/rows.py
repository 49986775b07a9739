"""Row gathers and scatters: the permute moves and unpermute's backward (their routing map is
in :mod:`grouped_linear.kernels.routing.routing_map`, the k-way combine in
:mod:`grouped_linear.kernels.routing.combine`), each in one pass, without a host sync.
"""

import functools

import torch

from .._triton import cdiv, kernel, next_power_of_2, sm_count, tl, triton, use_triton

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older Triton or none
    gdc_wait = None

__all__ = ["within", "gather_rows", "gather_rows_reference", "spread_rows",
           "spread_rows_reference", "scatter_rows", "SCATTER_CONFIG", "weighted_dtype"]

# Launch shape (rows per program, columns per program, warps) of scatter_rows (permute forward,
# and spread_rows): the default of its config= keyword; the layouts bench times it,
# benchmarks/layout_kernels.py others.
SCATTER_CONFIG = (16, 256, 4)
# Destination rows per program of the scatter's zero-fill part (it reads their slot entries,
# then writes zeros across all columns only where a row holds no slot).
ZERO_ROWS = 32
# Programs per SM that share out the scatter's zero rows when the group sizes locate them
# (permute): the first ones launched, so the zeros are written while the copies run.
GAP_PROGRAMS_PER_SM = 4


# --------------------------------------------------------------------------- row gathers
def within(values: torch.Tensor, low: int, high: int) -> bool:
    """Whether every one of ``values`` (non-empty, read on the host: a sync on CUDA) lies in
    ``[low, high)``: one ``aminmax``, compared as Python ints (no dtype wraps around)."""
    least, most = (int(v) for v in torch.aminmax(values))
    return least >= low and most < high


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = scale[r] * src[index[r]]``, a zero row where ``index[r]`` is outside ``src``."""
    if src.shape[0] == 0 or index.numel() == 0:
        return src.new_zeros(index.shape[0], *src.shape[1:])
    valid = None  # every index inside src: a plain index_select, one op where masking takes six
    # (the host reads CPU indices freely, but not while torch.compile traces)
    if (src.device.type != "cpu" or torch.compiler.is_compiling()
            or not within(index, 0, src.shape[0])):
        valid = (index >= 0) & (index < src.shape[0])
    out = src.index_select(0, index if valid is None else index.clamp(0, src.shape[0] - 1))
    if valid is not None:
        out = out.masked_fill_(~valid.view(-1, *([1] * (src.dim() - 1))), 0)
    if scale is not None:
        scale = scale.float() if valid is None else scale.float().masked_fill(~valid, 0)
        out = (out.float() * scale.unsqueeze(1)).to(src.dtype)
    return out


@kernel
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


def _rows_kernel_ok(src: torch.Tensor) -> bool:
    return (use_triton(src) and src.dim() == 2 and src.stride(-1) == 1
            and src.dtype != torch.float64 and not src.is_complex() and src.shape[1] > 0)


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
    block_r, block_h = 16, min(256, next_power_of_2(H))
    _gather_rows_kernel[(cdiv(R, block_r), cdiv(H, block_h))](
        src, out, index.contiguous(), scale.contiguous() if scale is not None else src, R,
        src.shape[0], H, src.stride(0), out.stride(0), HAS_SCALE=scale is not None,
        BLOCK_R=block_r, BLOCK_H=block_h)
    return out.to(src.dtype)


@triton.jit
def _zero_gaps(dst_ptr, splits_ptr, counts_ptr, E, N, H, stride_dst, first_unit, stride_unit,
               ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    """Zeros in the rows no slot holds, known from the group sizes: group ``e``'s last
    ``splits[e] - counts[e]`` rows (its padding) and the rows past the last group. Counted
    in row order, those rows form units of ``ROWS`` rows by one ``BLOCK_H`` column block;
    the caller takes units ``first_unit, first_unit + stride_unit, ...``."""
    slots = tl.arange(0, BLOCK_E)
    is_group = slots < E
    padded = tl.load(splits_ptr + slots, mask=is_group, other=0).to(tl.int64)
    held = tl.load(counts_ptr + slots, mask=is_group, other=0).to(tl.int64)
    total = tl.sum(padded, axis=0)
    # slot E: the rows past the groups; slots above it: nothing
    gap_row = tl.where(is_group, tl.cumsum(padded, axis=0) - padded + held, total)
    gap_len = tl.where(is_group, padded - held, tl.where(slots == E, tl.maximum(N - total, 0), 0))
    gap_end = tl.cumsum(gap_len, axis=0)
    gap_begin = gap_end - gap_len
    gaps = tl.sum(gap_len, axis=0)
    column_blocks = tl.cdiv(H, BLOCK_H)
    units = tl.cdiv(gaps, ROWS) * column_blocks
    zeros = tl.zeros([ROWS, BLOCK_H], dtype=dst_ptr.dtype.element_ty)
    for unit in range(first_unit.to(tl.int64), units, stride_unit):
        z = (unit // column_blocks) * ROWS + tl.arange(0, ROWS)
        owner = (gap_begin[None, :] <= z[:, None]) & (z[:, None] < gap_end[None, :])
        rows = tl.sum(tl.where(owner, gap_row[None, :] + (z[:, None] - gap_begin[None, :]), 0),
                      axis=1)
        cols = (unit % column_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        keep = (z < gaps) & (rows < N)
        tl.store(dst_ptr + rows[:, None] * stride_dst + cols[None, :], zeros,
                 mask=keep[:, None] & (cols < H)[None, :], cache_modifier=".cs")


# Slots per token from which the row kernels take a token's slots as mostly unused (a
# routing map's E): loaded SLOT_CHUNK at a time, an unused one skipped.
SPARSE_SLOTS = 32
SLOT_CHUNK = 32


def sparse_slots(k: int) -> bool:
    """Whether the row kernels treat ``k`` slots per token as sparse."""
    return k >= SPARSE_SLOTS


def slot_options(k: int) -> dict:
    """The row kernels' ``SPARSE`` and ``K_CHUNK`` for ``k`` slots per token."""
    return {"SPARSE": sparse_slots(k), "K_CHUNK": SLOT_CHUNK if sparse_slots(k) else 1}


@triton.jit
def slot_table(map_ptr, tokens, token_mask, j, K, SPARSE: tl.constexpr, K_CHUNK: tl.constexpr):
    """Where ``SPARSE``, the rows of slots ``[j, j + K_CHUNK)`` of ``tokens`` as a
    ``(BLOCK_T, K_CHUNK)`` tile (``-1`` past ``K``), for :func:`slot_row`; else a
    placeholder."""
    if SPARSE:
        ks = j + tl.arange(0, K_CHUNK)
        table = tl.load(map_ptr + tokens.to(tl.int64)[:, None] * K + ks[None, :],
                        mask=token_mask[:, None] & (ks < K)[None, :], other=-1)
    else:
        table = tl.zeros([1, 1], dtype=tl.int64)
    return table


@triton.jit
def next_slot_table(table, map_ptr, tokens, token_mask, j, K, SPARSE: tl.constexpr,
                    K_CHUNK: tl.constexpr):
    """``table``, or where ``SPARSE`` and slot ``j`` starts a chunk, that chunk's."""
    if SPARSE:
        if (j % K_CHUNK == 0) & (j > 0):
            table = slot_table(map_ptr, tokens, token_mask, j, K, SPARSE, K_CHUNK)
    return table


@triton.jit
def slot_row(map_ptr, table, tokens, token_mask, j, K, SPARSE: tl.constexpr,
             K_CHUNK: tl.constexpr):
    """The row of slot ``j`` of each of ``tokens``: picked from ``table`` (its chunk) where
    ``SPARSE``, else loaded."""
    if SPARSE:
        row = tl.sum(tl.where(tl.arange(0, K_CHUNK)[None, :] == j % K_CHUNK, table, 0), axis=1)
    else:
        row = tl.load(map_ptr + tokens.to(tl.int64) * K + j, mask=token_mask, other=-1)
    return row.to(tl.int64)


@triton.jit
def _store_slot(dst_ptr, weights_ptr, values, row, valid, slot, cols, col_mask, stride_dst,
                HAS_WEIGHTS: tl.constexpr):
    if HAS_WEIGHTS:
        weight = tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        out = (values.to(tl.float32) * weight[:, None]).to(dst_ptr.dtype.element_ty)
    else:
        out = values
    tl.store(dst_ptr + row[:, None] * stride_dst + cols[None, :], out,
             mask=valid[:, None] & col_mask, cache_modifier=".cs")


@kernel
@triton.jit
def _scatter_rows_kernel(src_ptr, dst_ptr, map_ptr, token_ptr, weights_ptr, splits_ptr,
                         counts_ptr, T, K, N, H, E, stride_src, stride_dst, token_programs,
                         gap_programs, HAS_WEIGHTS: tl.constexpr, SLOTS: tl.constexpr,
                         GAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_E: tl.constexpr, ZERO_ROWS: tl.constexpr, PDL: tl.constexpr,
                         SPARSE: tl.constexpr, K_CHUNK: tl.constexpr):
    """A 1-D grid. The first ``token_programs * cdiv(H, BLOCK_H)`` programs: ``BLOCK_T``
    source rows by ``BLOCK_H`` columns each, read once and written to each of their ``K``
    slots' rows ``map[t, j]`` (those in ``[0, N)``), times ``weights[t, j]`` (float32) with
    ``HAS_WEIGHTS``. The rows no slot holds get zeros in one of two ways. With ``GAPS``
    they follow from the ``E`` padded group sizes ``splits`` and the rows each group holds,
    ``counts`` (the routing map's layout): the first ``gap_programs`` programs share them out
    (:func:`_zero_gaps`), and there are no other programs. Otherwise the programs after the
    token programs take ``ZERO_ROWS`` destination rows each, all their columns written as
    zeros where ``token[r] < 0``; most blocks hold every row and return after one look.
    With ``SLOTS``, ``token_ptr`` holds a slot per row, trusted only where ``map`` sends that
    slot back to the row (so the rows no slot holds may contain anything: the buffer needs
    no fill). With ``PDL`` (launched as a programmatic dependent of the kernel before it,
    which must not write ``src``) a program waits for that kernel only after reading its
    source rows. The row stores stream past the caches (``.cs``): on the H200, permute
    forward and unpermute backward at 4096 x 65536 and 7168 x 131072 rows ran ~1 % faster
    than with Triton's default stores in two sweeps (write-through stores level;
    ``evict_first`` source loads level alone, 3 % slower with the streaming stores)."""
    pid = tl.program_id(0)
    column_blocks = tl.cdiv(H, BLOCK_H)
    if pid < token_programs * column_blocks:
        cols = (pid % column_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_mask = (cols < H)[None, :]
        tokens = (pid // column_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = tokens < T
        values = tl.load(src_ptr + tokens.to(tl.int64)[:, None] * stride_src + cols[None, :],
                         mask=token_mask[:, None] & col_mask, other=0.0)
        if PDL:
            gdc_wait()
        table = slot_table(map_ptr, tokens, token_mask, 0, K, SPARSE, K_CHUNK)
        for j in range(0, K):
            slot = tokens.to(tl.int64) * K + j
            table = next_slot_table(table, map_ptr, tokens, token_mask, j, K, SPARSE, K_CHUNK)
            row = slot_row(map_ptr, table, tokens, token_mask, j, K, SPARSE, K_CHUNK)
            valid = (row >= 0) & (row < N)
            if SPARSE:  # a slot no token of the block uses costs a branch only
                used = tl.max(valid.to(tl.int32), axis=0) > 0
            else:
                used = True
            if used:
                _store_slot(dst_ptr, weights_ptr, values, row, valid, slot, cols, col_mask,
                            stride_dst, HAS_WEIGHTS)
        if GAPS:
            if pid < gap_programs:
                _zero_gaps(dst_ptr, splits_ptr, counts_ptr, E, N, H, stride_dst, pid,
                           gap_programs, BLOCK_T, BLOCK_H, BLOCK_E)
    else:
        if PDL:
            gdc_wait()
        rows = (pid - token_programs * column_blocks) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        in_range = rows < N
        token = tl.load(token_ptr + rows, mask=in_range, other=0)
        unheld = token < 0
        if SLOTS:
            real = (token >= 0) & (token < T * K)
            back = tl.load(map_ptr + token, mask=in_range & real, other=-1)
            unheld = (~real) | (back != rows)
        unheld = unheld & in_range
        if tl.max(unheld.to(tl.int32), axis=0) > 0:
            zeros = tl.zeros([ZERO_ROWS, BLOCK_H], dtype=dst_ptr.dtype.element_ty)
            base = dst_ptr + rows.to(tl.int64)[:, None] * stride_dst
            for c0 in range(0, H, BLOCK_H):
                cols = c0 + tl.arange(0, BLOCK_H)
                tl.store(base + cols[None, :], zeros, mask=unheld[:, None] & (cols < H)[None, :])


def _scatter(src: torch.Tensor, row_map: torch.Tensor, held: torch.Tensor,
             weights: torch.Tensor | None, out_dtype: torch.dtype, slots: bool = False,
             groups: tuple[torch.Tensor, torch.Tensor] | None = None,
             config: tuple[int, int, int] = SCATTER_CONFIG) -> torch.Tensor:
    """Launch :func:`_scatter_rows_kernel`: ``held`` ``(N,)``, negative for rows no slot holds
    (``slots``: the slot of each held row, anything for the others); ``groups``: the padded
    group sizes and each group's held rows, from which the unheld rows are found instead;
    ``config``: the launch shape (rows per program, columns per program, warps).
    Both callers launch it right after the kernel that wrote ``held`` (and ``row_map`` or
    not), which itself started after ``src`` was complete: so the scatter may read ``src``
    before that kernel ends."""
    tokens, k = row_map.shape
    num_rows, H = held.shape[0], src.shape[1]
    out = torch.empty(num_rows, H, device=src.device, dtype=out_dtype)
    block_t, block_h, warps = config
    block_h = min(block_h, next_power_of_2(H))
    token_programs = cdiv(tokens, block_t)
    copy_programs = token_programs * cdiv(H, block_h)
    if groups is not None:
        splits, counts = groups
        num_experts = splits.shape[0]
        grid = (copy_programs,)
        gap_programs = min(copy_programs, GAP_PROGRAMS_PER_SM * sm_count(src.device))
    else:
        splits = counts = row_map
        num_experts = 0
        grid = (copy_programs + cdiv(num_rows, ZERO_ROWS),)
        gap_programs = 0
    _scatter_rows_kernel[grid](
        src, out, row_map.contiguous(), held.contiguous(),
        weights.contiguous() if weights is not None else src, splits, counts, tokens, k,
        num_rows, H, num_experts, src.stride(0), out.stride(0), token_programs, gap_programs,
        HAS_WEIGHTS=weights is not None, SLOTS=slots, GAPS=groups is not None, BLOCK_T=block_t,
        BLOCK_H=block_h, BLOCK_E=next_power_of_2(num_experts + 1), ZERO_ROWS=ZERO_ROWS,
        num_warps=warps, **slot_options(k), **_pdl_options(src.device))
    return out


def scatter_pdl(device: torch.device) -> bool:
    """Whether the scatter launches as a programmatic dependent on ``device`` (sm90 on)."""
    return gdc_wait is not None and device.type == "cuda" and _sm90_or_later(
        device.index if device.index is not None else torch.cuda.current_device())


def _pdl_options(device: torch.device) -> dict:
    return {"PDL": True, "launch_pdl": True} if scatter_pdl(device) else {"PDL": False}


@functools.cache
def _sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def scatter_rows(src: torch.Tensor, row_map: torch.Tensor, token_of_row: torch.Tensor,
                 groups: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 config: tuple[int, int, int] = SCATTER_CONFIG) -> torch.Tensor:
    """``(T, H)`` -> ``(N, H)`` with ``N = len(token_of_row)``: ``out[row_map[t, j]] = src[t]``,
    zero rows where ``token_of_row`` is negative. ``row_map`` ``(T, k)`` and ``token_of_row``
    must describe the same placement (as :func:`routing_map` returns them); the result
    equals ``gather_rows(src, token_of_row)`` but reads each source row once, however many
    slots use it.

    ``groups``: ``(m_splits, counts)`` of that routing map (``(E,)`` padded group sizes and
    the slots each group holds, summing to at most ``N``). The rows no slot holds are then
    each group's last ``m_splits - counts`` rows and those past the groups, zeroed by the
    copying programs themselves instead of by a scan of ``token_of_row`` at the end.
    ``config``: the launch shape (rows per program, columns per program, warps)."""
    tokens, k = row_map.shape
    num_rows = token_of_row.shape[0]
    if not _rows_kernel_ok(src) or tokens == 0 or k == 0 or num_rows == 0:
        return gather_rows_reference(src, token_of_row)
    return _scatter(src, row_map, token_of_row, None, src.dtype, groups=groups, config=config)


def weighted_dtype(src: torch.Tensor, weights: torch.Tensor | None) -> torch.dtype:
    """The dtype the references weight rows in: float64 where ``src`` or ``weights`` is,
    else float32."""
    wide = torch.float64 in (src.dtype, None if weights is None else weights.dtype)
    return torch.float64 if wide else torch.float32


def spread_rows_reference(src: torch.Tensor, row_map: torch.Tensor, num_rows: int,
                          weights: torch.Tensor | None) -> torch.Tensor:
    """``(T, H)`` -> ``(num_rows, H)``: ``out[row_map[t, j]] = weights[t, j] * src[t]`` (the
    products in float32, or float64 when either input is) for the slots whose row lies in
    ``[0, num_rows)``; rows no slot holds are 0. Rows held by a slot must be distinct."""
    tokens, k = row_map.shape
    # Without weights the rows are copied, not computed: they stay in their dtype.
    acc = src.dtype if weights is None else weighted_dtype(src, weights)
    flat = row_map.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_rows)
    out = torch.zeros(num_rows + 1, *src.shape[1:], dtype=acc, device=src.device)
    rows = src.to(acc).repeat_interleave(k, dim=0)
    if weights is not None:
        rows = rows * weights.reshape(-1, 1).to(acc)
    out.index_copy_(0, torch.where(valid, flat, num_rows), rows)
    return out[:num_rows].to(src.dtype)


@kernel
@triton.jit
def _slot_of_row_kernel(map_ptr, slot_ptr, S, N, BLOCK: tl.constexpr):
    """``slot[map[s]] = s`` for the slots ``s`` whose row is in ``[0, N)``."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(map_ptr + slots, mask=slots < S, other=-1).to(tl.int64)
    tl.store(slot_ptr + rows, slots.to(tl.int64), mask=(slots < S) & (rows >= 0) & (rows < N))


def spread_rows(src: torch.Tensor, row_map: torch.Tensor, num_rows: int,
                weights: torch.Tensor | None, *,
                config: tuple[int, int, int] = SCATTER_CONFIG) -> torch.Tensor:
    """:func:`spread_rows_reference` as an inverse slot map (one small kernel, to know the
    rows no slot holds) and a scatter of the source rows, each read once and written to
    its slots' rows, scaled by their weights; unheld rows written as zeros. ``config``: the
    scatter's launch shape (as :func:`scatter_rows`)."""
    tokens, k = row_map.shape
    if (not _rows_kernel_ok(src) or tokens == 0 or k == 0 or num_rows == 0
            or (weights is not None and weights.dtype == torch.float64)):
        return spread_rows_reference(src, row_map, num_rows, weights)
    # No fill: the scatter trusts an entry only where row_map leads back to its row.
    slot_of_row = torch.empty(num_rows, device=src.device, dtype=torch.int64)
    _slot_of_row_kernel[(cdiv(tokens * k, 1024),)](
        row_map.contiguous(), slot_of_row, tokens * k, num_rows, BLOCK=1024)
    # The CPU interpreter truncates float32 -> bf16: with weights, torch does the rounding.
    out_dtype = torch.float32 if weights is not None and src.device.type == "cpu" else src.dtype
    return _scatter(src, row_map, slot_of_row, weights, out_dtype, slots=True,
                    config=config).to(src.dtype)
