"""FP8 quantization that writes transposed copies: the operands of the weight-gradient
GEMM and the dgrad GEMM's weight.

* :func:`quantize_group_columns_t`: ``(M, C)`` rows split into groups -> FP8 ``(C, M')``,
  one scale per (group, column) along the group's rows (or per group), each group
  optionally starting on an aligned column;
* the same tiles serve the weights of :mod:`grouped_linear.kernels.quantize.rows`.

Each has its plain-PyTorch reference beside it; scales follow
:func:`grouped_linear.kernels.quantize.common.scale_from_amax`.
"""

from __future__ import annotations

import torch

from .._groups import row_groups
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from ..bias import bias_grad
from ..ends import aligned_offsets
from . import columns_tiled
from .common import amax_to_scale, finish, fp8_buffer, group_amax, piece_shifts, scale_from_amax

__all__ = ["quantize_group_columns_t", "quantize_group_columns_t_reference",
           "quantize_group_columns_t_pieces", "transpose_group_columns", "fold_row_factors",
           "GROUP_COLUMNS_METHOD", "GROUP_COLUMNS_CONFIG"]

# How quantize_group_columns_t runs on GPUs: "per_group" (one program per group and
# column block walks the group's rows twice) or "tiled" (a column-amax kernel over row
# tiles with atomic maxima, then one quantize-and-transpose kernel over the same tiles:
# every tile in flight at once; :mod:`grouped_linear.kernels.quantize.columns_tiled`).
# Launch shape of the per-group method: (rows, columns, warps).
# benchmarks/fp8_quantize.py times both on the H200: tiled (128, 64, 4) is the faster
# (0.37-0.40 of copy bandwidth against 0.28-0.31, dsv3_ep32_fc1's x and dy).
GROUP_COLUMNS_METHOD = "tiled"
GROUP_COLUMNS_CONFIG = (32, 64, 4)


def fold_row_factors(t: torch.Tensor, row_factors: torch.Tensor) -> torch.Tensor:
    """``t[m, :] * row_factors[m]`` in float32, kept finite (saturated at float32's range)."""
    limit = torch.finfo(torch.float32).max
    return (t.float() * row_factors.float()[:, None]).clamp(-limit, limit)


def quantize_group_columns_t_reference(t: torch.Tensor, offsets: torch.Tensor,
                                       fp8_dtype: torch.dtype, power_of_two: bool,
                                       group_scale: torch.Tensor | None = None,
                                       row_factors: torch.Tensor | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, C)`` -> FP8 transpose ``(C, M)`` scaled per (group, column) along the group's
    rows (or per group), and ``(G, C)`` float32 dequantization factors; rows past the
    last group are 0. ``row_factors`` ``(M,)``: quantize ``t`` with row ``m`` multiplied by
    ``row_factors[m]`` (:func:`fold_row_factors`)."""
    if row_factors is not None:
        t = fold_row_factors(t, row_factors)
    if group_scale is None:
        scale = scale_from_amax(group_amax(t, offsets), fp8_dtype, power_of_two)
    else:
        scale = group_scale[:, None].expand(offsets.shape[0], t.shape[1]).contiguous()
    groups = row_groups(offsets, t.shape[0])
    per_row = torch.cat([scale, torch.ones_like(scale[:1])]).index_select(0, groups)
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = (t.float() * per_row).clamp(-fp8_max, fp8_max)
    data = scaled.masked_fill((groups == offsets.shape[0]).unsqueeze(1), 0.0).to(fp8_dtype)
    return data.t().contiguous(), 1.0 / scale


@kernel
@triton.jit
def _quantize_group_columns_t_kernel(t_ptr, offsets_ptr, dst_offsets_ptr, q_ptr, inv_ptr, scale_ptr,
                                     M, C, stride_t, stride_q,
                                     FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                                     GIVEN_SCALE: tl.constexpr, PAD: tl.constexpr,
                                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Group ``g``'s rows ``[start, end)``, columns of one block: scale per column, write
    ``q[col * stride_q + j]`` with ``j = dst_start + index``, ``dst_start`` the group's start
    in ``dst_offsets`` and ``index`` the row's index inside the group; then zero ``j`` up to
    the group's ``dst`` end (< ``PAD`` columns)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    end = tl.load(offsets_ptr + group)
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    if GIVEN_SCALE:  # one scale per group from the caller (tensorwise)
        scale = tl.zeros([BLOCK_C], dtype=tl.float32) + tl.load(scale_ptr + group)
    else:
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):  # pass 1: column amax over the group's rows
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < end)[:, None] & col_mask[None, :]
            values = tl.load(t_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                             mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(values.to(tl.float32)), axis=0))
        scale = amax_to_scale(amax, FP8_MAX, POW2)
    q_base = q_ptr + cols.to(tl.int64)[None, :] * stride_q
    dst_start = tl.load(dst_offsets_ptr + group - 1, mask=group > 0, other=0)
    for r0 in range(start, end, BLOCK_R):  # pass 2: quantize and write transposed
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & col_mask[None, :]
        values = tl.load(t_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask,
                         other=0.0)
        scaled = tl.clamp(values.to(tl.float32) * scale[None, :], -FP8_MAX, FP8_MAX)
        tl.store(q_base + (rows - start + dst_start)[:, None], scaled.to(q_ptr.dtype.element_ty),
                 mask=mask)
    if PAD > 1:  # the group's alignment columns
        dst_end = tl.load(dst_offsets_ptr + group)
        pads = dst_start + (end - start) + tl.arange(0, PAD)
        zeros = tl.zeros([PAD, BLOCK_C], dtype=q_ptr.dtype.element_ty)
        tl.store(q_base + pads[:, None], zeros, mask=(pads < dst_end)[:, None] & col_mask[None, :])
    tl.store(inv_ptr + group.to(tl.int64) * C + cols, 1.0 / scale, mask=col_mask)


@kernel
@triton.jit
def _zero_columns_from_kernel(q_ptr, offsets_ptr, G, C, M, stride_q, BLOCK_C: tl.constexpr,
                              BLOCK_M: tl.constexpr):
    """Zero ``q[:, offsets[-1]:]`` (the transposed tail)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    end = tl.load(offsets_ptr + G - 1)
    for m0 in range(end, M, BLOCK_M):
        ms = m0 + tl.arange(0, BLOCK_M)
        zeros = tl.zeros([BLOCK_C, BLOCK_M], dtype=q_ptr.dtype.element_ty)
        tl.store(q_ptr + cols.to(tl.int64)[:, None] * stride_q + ms[None, :], zeros,
                 mask=(cols < C)[:, None] & (ms < M)[None, :])


def _aligned_width(rows: int, groups: int, align: int) -> int:
    """Columns of the transposed wgrad operand: ``rows``, or with ``align > 1`` room for
    every group's alignment padding, rounded up to 16 (FP8 GEMMs need 16-element rows)."""
    return -(-(rows + (align - 1) * groups) // 16) * 16 if align > 1 else rows


def _transposed_buffer(C: int, M: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Where the kernels write an FP8 ``(C, M)`` operand: on GPUs its row stride is ``M``
    rounded up to 16 elements (FP8 GEMMs need 16-byte aligned leading dimensions; the extra
    columns are never read); on CPUs float32 (see :func:`~grouped_linear.kernels.quantize.common.fp8_buffer`)."""
    if device.type == "cpu":
        return fp8_buffer((C, M), device, dtype)
    return torch.empty(C, -(-M // 16) * 16, device=device, dtype=dtype)[:, :M]


def quantize_group_columns_t(t: torch.Tensor, offsets: torch.Tensor, fp8_dtype: torch.dtype,
                             power_of_two: bool, group_scale: torch.Tensor | None = None,
                             align: int = 1, column_sums: torch.Tensor | None = None,
                             row_factors: torch.Tensor | None = None,
                             data_offsets: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The wgrad operand: ``(M, C)`` -> FP8 transposed, scaled per (group, column) along
    the group's rows (or per group with ``group_scale`` ``(G,)`` float32).

    Returns ``(data, inv, data_offsets)``. With ``align=1``: ``data`` ``(C, M)``,
    ``data_offsets`` is ``offsets`` and columns past ``offsets[-1]`` are 0. With
    ``align > 1``: every group starts at a multiple of ``align`` columns, zero-padded
    up to the next (``data_offsets`` = :func:`~grouped_linear.kernels.ends.aligned_offsets`),
    ``data`` has ``M + (align - 1) * G`` columns rounded up to a multiple of 16 (FP8
    GEMMs need 16-element rows), those past ``data_offsets[-1]`` unspecified. On GPUs
    the row stride is a multiple of 16. ``inv`` is ``(G, C)``.

    ``column_sums``: an optional ``(G, C)`` float32 tensor filled with the per-group column
    sums of ``t`` (a bias gradient), from the same read of ``t`` where the kernels allow
    it, else by :func:`grouped_linear.kernels.bias.bias_grad`.

    ``row_factors``: an optional ``(M,)`` float tensor; what is quantized is then ``t`` with
    row ``m`` multiplied by ``row_factors[m]`` (:func:`fold_row_factors`; the column sums
    stay those of ``t`` itself). The weight gradient folds the forward's per-token factors
    of ``x`` into ``dy`` this way.

    ``data_offsets``: the aligned group ends when the caller already has them (from an
    earlier call with the same ``offsets`` and ``align``).
    """
    M, C = t.shape
    G = offsets.shape[0]
    if data_offsets is None:
        data_offsets = offsets if align == 1 else aligned_offsets(offsets, align)
    width = _aligned_width(M, G, align)
    kernels = use_triton(t) and t.stride(-1) == 1 and t.shape[0] > 0
    tiled = kernels and GROUP_COLUMNS_METHOD == "tiled" and G * C < 2**31
    fused_sums = column_sums if tiled and group_scale is None else None
    if column_sums is not None and fused_sums is None:  # no column-amax pass to share
        column_sums.copy_(bias_grad(t, offsets, torch.float32))
    if row_factors is not None and not tiled:  # the per-group kernel reads the folded rows
        t, row_factors = fold_row_factors(t, row_factors), None
    if not kernels:
        data, inv = quantize_group_columns_t_reference(t, offsets, fp8_dtype, power_of_two,
                                                       group_scale)
        if align > 1:
            data = _realign_columns(data, offsets, data_offsets, width)
        return data, inv, data_offsets
    data = _transposed_buffer(C, width, t.device, fp8_dtype)
    if tiled:
        inv = columns_tiled.quantize_columns_t(t, offsets, data_offsets, data, fp8_dtype,
                                              power_of_two, group_scale, align,
                                              dst_multiple=align, sums=fused_sums,
                                              row_factors=row_factors)
        return finish(data, fp8_dtype), inv, data_offsets
    inv = torch.empty(G, C, device=t.device, dtype=torch.float32)
    block_r, block_c, warps = GROUP_COLUMNS_CONFIG
    _quantize_group_columns_t_kernel[(G, cdiv(C, block_c))](
        t, offsets, data_offsets, data, inv, group_scale if group_scale is not None else inv,
        M, C, t.stride(0), data.stride(0), FP8_MAX=torch.finfo(fp8_dtype).max,
        POW2=power_of_two, GIVEN_SCALE=group_scale is not None,
        PAD=next_power_of_2(align) if align > 1 else 1, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps,
    )
    if align == 1:
        _zero_columns_from_kernel[(cdiv(C, 64),)](
            data, offsets, G, C, M, data.stride(0), BLOCK_C=64, BLOCK_M=32,
        )
    return finish(data, fp8_dtype), inv, data_offsets


def transpose_group_columns(codes: torch.Tensor, offsets: torch.Tensor, align: int = 1,
                            data_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 codes ``(M, C)`` moved unchanged into the transposed layout of
    :func:`quantize_group_columns_t` with the same ``align`` (and ``data_offsets``, computed
    when not given): ``(C, width)``, zeros in the alignment and tail columns. The wgrad
    operand of a tensor already quantized per token whose factors were moved onto the other
    operand; one launch on GPUs, no factors."""
    M, C = codes.shape
    G = offsets.shape[0]
    if data_offsets is None:
        data_offsets = offsets if align == 1 else aligned_offsets(offsets, align)
    if not (use_triton(codes) and codes.stride(-1) == 1 and M > 0
            and GROUP_COLUMNS_METHOD == "tiled" and G * C < 2**31):
        ones = torch.ones(G, device=codes.device)
        data, _ = quantize_group_columns_t_reference(codes, offsets, codes.dtype, False, ones)
        return _realign_columns(data, offsets, data_offsets, _aligned_width(M, G, align)) \
            if align > 1 else data
    data = _transposed_buffer(C, _aligned_width(M, G, align), codes.device, codes.dtype)
    columns_tiled.quantize_columns_t(codes, offsets, data_offsets, data, codes.dtype, False, None,
                                    align, dst_multiple=align, unit_scale=True)
    return finish(data, codes.dtype)


def quantize_group_columns_t_pieces(pieces: list[torch.Tensor], fp8_dtype: torch.dtype,
                                    power_of_two: bool, group_scale: torch.Tensor | None = None,
                                    align: int = 16, width: int | None = None,
                                    offsets: torch.Tensor | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_group_columns_t` of ``torch.cat(pieces)`` with ``align`` (one group
    per piece) without the concatenation: each ``(m_g, C)`` piece is quantized straight into
    its aligned columns of one transposed FP8 buffer. Returns ``(data, inv)``: ``data``
    ``(C, width)`` (``width`` defaults to the one :func:`quantize_group_columns_t` uses),
    group ``g`` at columns from ``sum_{h<g} round_up(m_h, align)``, zero-padded to
    ``round_up(m_g, align)``; ``inv`` ``(G, C)``. ``offsets``: the pieces' ``(G,)`` int32
    row ends already on the device, so nothing is copied from the host per call (a
    host-to-device copy waits for the queued GPU work)."""
    sizes = [piece.shape[0] for piece in pieces]
    G, C = len(pieces), pieces[0].shape[1]
    device = pieces[0].device
    rows = sum(sizes)
    if width is None:
        width = _aligned_width(rows, G, align)
    padded = [-(-size // align) * align for size in sizes]
    if offsets is None:
        offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    if not use_triton(pieces[0]) or GROUP_COLUMNS_METHOD != "tiled" or any(
            piece.stride(-1) != 1 for piece in pieces):
        data, inv, _ = quantize_group_columns_t(torch.cat(pieces), offsets, fp8_dtype,
                                                power_of_two, group_scale, align)
        if data.shape[1] < width:
            data = torch.cat([data, data.new_zeros(C, width - data.shape[1])], dim=1)
        return data[:, :width], inv
    data = _transposed_buffer(C, width, device, fp8_dtype)
    shifts = piece_shifts(pieces) if rows and G * C < 2**31 else None
    if shifts is not None:  # one launch per pass over all the pieces
        data_offsets = aligned_offsets(offsets, align) if align > 1 else offsets
        inv = columns_tiled.quantize_columns_t(
            shifts.base, offsets, data_offsets, data, fp8_dtype, power_of_two, group_scale, align,
            width=width, dst_multiple=align, shifts=shifts, num_rows=rows)
        return finish(data, fp8_dtype), inv
    group_sizes = torch.diff(offsets.to(torch.int32), prepend=offsets.new_zeros(1, dtype=torch.int32))
    padded_sizes = (group_sizes + (align - 1)) // align * align
    invs, start = [], 0
    for g, piece in enumerate(pieces):
        one_group, one_padded = group_sizes[g:g + 1], padded_sizes[g:g + 1]
        scale = group_scale[g:g + 1] if group_scale is not None else None
        if sizes[g] == 0:  # nothing to write; the factors of an empty group
            invs.append(quantize_group_columns_t_reference(piece, one_group, fp8_dtype,
                                                           power_of_two, scale)[1])
            continue
        # The piece's columns as a view: its group starts at column 0 of it.
        view = data[:, start:start + padded[g]]
        invs.append(columns_tiled.quantize_columns_t(
            piece, one_group, one_padded, view, fp8_dtype, power_of_two, scale, align,
            stride_q=data.stride(0), width=padded[g],
            dst_multiple=align if start % 16 == 0 else 1))
        start += padded[g]
    if start < width:
        data[:, start:].zero_()
    return finish(data, fp8_dtype), torch.cat(invs)


def _realign_columns(data: torch.Tensor, offsets: torch.Tensor, data_offsets: torch.Tensor,
                     width: int) -> torch.Tensor:
    """Reference of the aligned layout: each group's columns moved to its aligned start."""
    out = torch.zeros(data.shape[0], width, dtype=data.dtype, device=data.device)
    ends, aligned_ends = offsets.tolist(), data_offsets.tolist()
    for g, end in enumerate(ends):
        start = ends[g - 1] if g else 0
        aligned_start = aligned_ends[g - 1] if g else 0
        out[:, aligned_start:aligned_start + end - start] = data[:, start:end]
    return out
