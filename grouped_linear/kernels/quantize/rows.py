"""FP8 quantization of rows in one Triton pass: one scale per row (tokens, weights' output
channels), or one given scale per group of rows (tensorwise); the operands of the forward and
dgrad GEMMs, as FP8 data plus float32 dequantization factors (``1 / scale``), the way torch's
scaled GEMMs take them. A list of pieces is quantized as their concatenation without the copy
(:func:`quantize_rows_pieces`). The plain-PyTorch reference is
:func:`quantize_rows_reference`.
"""

import torch

from .._groups import row_groups
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .common import (
    PieceShifts,
    amax_to_scale,
    clamp_keeping_nan,
    finish,
    fp8_buffer,
    inverse,
    magnitudes,
    piece_shift,
    piece_shifts,
    saturate,
    scale_from_amax,
)

__all__ = ["quantize_rows", "quantize_rows_reference", "quantize_rows_pieces",
           "quantize_weight_rows", "ROWS_CONFIG"]


# Launch shape of the rows kernel: (rows per program, columns per block, warps), the
# default of quantize_rows(config=); benchmarks/fp8_quantize.py times the alternatives.
ROWS_CONFIG = (1, 4096, 8)


def quantize_rows_reference(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)`` and ``(R,)`` float32 dequantization factors."""
    if scale is None:
        amax = magnitudes(t).amax(dim=1) if t.shape[1] else t.new_zeros(t.shape[0])
        scale = scale_from_amax(amax, fp8_dtype, power_of_two)
    return saturate(t, scale[:, None], fp8_dtype), 1.0 / scale


@kernel
@triton.jit
def _quantize_rows_kernel(t_ptr, q_ptr, inv_ptr, scale_ptr, shifts_ptr, ends_ptr, R, C, G,
                          stride_t, stride_q, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                          GIVEN_SCALE: tl.constexpr, PIECES: tl.constexpr,
                          GROUPS: tl.constexpr, GROUP_ROWS: tl.constexpr,
                          SHIFT_MULTIPLE: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Rows of ``t`` (``PIECES``: of the concatenation of pieces, see :func:`piece_shift`).
    ``GROUPS``: ``"ends"`` (the rows' groups end at ``ends`` ``(G,)``: always with
    ``PIECES``), ``"uniform"`` (every ``GROUP_ROWS`` rows) or ``"none"``; a given scale is
    per group with groups, else per row."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    base = rows.to(tl.int64)[:, None] * stride_t
    if GROUPS == "ends":
        slots = tl.arange(0, BLOCK_S)
        ends = tl.load(ends_ptr + slots, mask=slots < G, other=R)
        piece = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        piece = tl.minimum(piece, G - 1)  # rows past the last end: the last group's
    elif GROUPS == "uniform":
        piece = tl.minimum(rows // GROUP_ROWS, G - 1)
    if PIECES:
        base += piece_shift(shifts_ptr, piece, SHIFT_MULTIPLE)[:, None]
    if GIVEN_SCALE:  # the caller's scales (tensorwise: the group's)
        if GROUPS != "none":
            scale = tl.load(scale_ptr + piece)
        else:
            scale = tl.load(scale_ptr + rows, mask=row_mask, other=1.0)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):  # pass 1: row amax
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            values = tl.load(t_ptr + base + cols[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(values.to(tl.float32)), axis=1))
        scale = amax_to_scale(amax, FP8_MAX, POW2)
    for c0 in range(0, C, BLOCK_C):  # pass 2: scale, saturate, round
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < C)[None, :]
        values = tl.load(t_ptr + base + cols[None, :], mask=mask, other=0.0)
        scaled = clamp_keeping_nan(values.to(tl.float32) * scale[:, None], FP8_MAX)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
                 scaled.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_ptr + rows, inverse(scale), mask=row_mask)


def _rows_launch_shape(C: int, config: tuple[int, int, int] = ROWS_CONFIG
                       ) -> tuple[int, int, int]:
    """(rows per program, columns per block, warps) of :func:`_quantize_rows_kernel` for
    rows of ``C``: ``config``, with several narrow rows per program."""
    block_r, max_block_c, warps = config
    block_c = min(max_block_c, next_power_of_2(max(C, 16)))
    return max(block_r, max_block_c // block_c), block_c, warps


def quantize_rows(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                  scale: torch.Tensor | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ends: torch.Tensor | None = None, group_rows: int = 0, *,
                  config: tuple[int, int, int] = ROWS_CONFIG
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)`` and ``(R,)`` dequantization factors, one read pass
    per row block (two when a row is wider than one block). ``scale`` ``(R,)`` float32
    gives the rows' scales instead of deriving them from the rows' amax; with ``ends``
    (the ``(G,)`` row ends of groups of rows) or ``group_rows`` (groups of that many rows)
    it is ``(G,)``, one scale per group (rows past the last end take the last group's).
    ``out``: an FP8 ``(R, C)`` tensor with unit column stride and a float32 ``(R,)`` one to
    write into (views of larger buffers: see :func:`quantize_rows_pieces`). ``config``: the
    launch shape (rows per program, columns per block, warps)."""
    kernel = use_triton(t) and t.stride(-1) == 1 and t.shape[0] > 0
    if scale is not None and (ends is not None or group_rows):
        num_groups = ends.shape[0] if ends is not None else -(-t.shape[0] // group_rows)
        if not (kernel and out is None and 0 < num_groups <= _MAX_KERNEL_GROUPS):
            scale = _scale_per_row(scale, ends, group_rows, t.shape[0])
            ends, group_rows = None, 0
    else:
        ends, group_rows = None, 0
    if not kernel or (out is not None and t.device.type == "cpu"):
        if out is None:
            return quantize_rows_reference(t, fp8_dtype, power_of_two, scale)
        data, inv = quantize_rows(t, fp8_dtype, power_of_two, scale)  # CPU: torch rounds
        out[0].copy_(data)
        out[1].copy_(inv)
        return out
    R, C = t.shape
    if out is not None:
        data, inv = out
    else:
        data = fp8_buffer((R, C), t.device, fp8_dtype)
        inv = torch.empty(R, device=t.device, dtype=torch.float32)
    if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous()):
        scale = scale.float().contiguous()
    _launch_rows(t, data, inv, scale, fp8_dtype, power_of_two, ends=ends,
                 group_rows=group_rows, config=config)
    return finish(data, fp8_dtype), inv


# Group-scaled rows with more groups than this take per-row scales (the kernel holds all
# the group ends of a row at once).
_MAX_KERNEL_GROUPS = 4096


def _scale_per_row(scale: torch.Tensor, ends: torch.Tensor | None, group_rows: int,
                   num_rows: int) -> torch.Tensor:
    """Per-group scales spread onto ``num_rows`` rows (past the last group: the last's)."""
    if ends is None:
        index = torch.arange(num_rows, device=scale.device) // group_rows
    else:
        index = row_groups(ends, num_rows)
    return scale.float().index_select(0, index.clamp(max=scale.shape[0] - 1)).contiguous()


def _launch_rows(t: torch.Tensor, data: torch.Tensor, inv: torch.Tensor,
                 scale: torch.Tensor | None, fp8_dtype: torch.dtype, power_of_two: bool,
                 shifts: "PieceShifts | None" = None, ends: torch.Tensor | None = None,
                 group_rows: int = 0, config: tuple[int, int, int] = ROWS_CONFIG) -> None:
    """:func:`_quantize_rows_kernel` over the ``data.shape[0]`` rows of ``t`` into
    ``data``/``inv``; with ``shifts``, ``t`` is the first of the pieces and ``ends`` their
    ``(G,)`` row ends (``scale`` is then per piece); ``ends`` alone or ``group_rows``: the
    rows' groups, ``scale`` per group."""
    R, C = data.shape
    if ends is not None:
        kind, G = "ends", ends.shape[0]
    elif group_rows:
        kind, G = "uniform", -(-R // group_rows)
    else:
        kind, G = "none", 1
    block_r, block_c, warps = _rows_launch_shape(C, config)
    _quantize_rows_kernel[(cdiv(R, block_r),)](
        t, data, inv, scale if scale is not None else inv,
        shifts.shifts if shifts is not None else inv, ends if ends is not None else inv,
        R, C, G, t.stride(0), data.stride(0), FP8_MAX=torch.finfo(fp8_dtype).max,
        POW2=power_of_two, GIVEN_SCALE=scale is not None, PIECES=shifts is not None,
        GROUPS=kind, GROUP_ROWS=max(group_rows, 1),
        SHIFT_MULTIPLE=shifts.multiple if shifts is not None else 1, BLOCK_R=block_r,
        BLOCK_C=block_c, BLOCK_S=next_power_of_2(G + 1) if kind == "ends" else 2,
        num_warps=warps,
    )


def quantize_rows_pieces(pieces: list[torch.Tensor], fp8_dtype: torch.dtype, power_of_two: bool,
                         group_scale: torch.Tensor | None = None,
                         ends: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``torch.cat(pieces)`` without the concatenation: each
    ``(m_g, C)`` piece is quantized straight into its rows of one FP8 ``(M, C)`` buffer
    (one read of each piece). ``group_scale`` ``(G,)``: piece ``g``'s rows all take scale
    ``group_scale[g]`` (tensorwise) instead of their own amax. ``ends``: the pieces'
    ``(G,)`` row ends on the device; with them, one launch reads all the pieces (see
    :func:`piece_shifts`), else one launch per piece."""
    rows = sum(piece.shape[0] for piece in pieces)
    C = pieces[0].shape[1]
    device = pieces[0].device
    shifts = piece_shifts(pieces) if use_triton(pieces[0]) and rows and ends is not None \
        else None
    if shifts is not None:  # one launch over all the pieces
        data = fp8_buffer((rows, C), device, fp8_dtype)
        inv = torch.empty(rows, device=device, dtype=torch.float32)
        scale = group_scale.float().contiguous() if group_scale is not None else None
        _launch_rows(shifts.base, data, inv, scale, fp8_dtype, power_of_two, shifts, ends)
        return finish(data, fp8_dtype), inv
    data = torch.empty(rows, C, device=device, dtype=fp8_dtype)
    inv = torch.empty(rows, device=device, dtype=torch.float32)
    start = 0
    for g, piece in enumerate(pieces):
        end = start + piece.shape[0]
        if end > start:
            scale = group_scale[g:g + 1].float().expand(piece.shape[0]).contiguous() \
                if group_scale is not None else None
            quantize_rows(piece, fp8_dtype, power_of_two, scale, out=(data[start:end],
                                                                      inv[start:end]))
        start = end
    return data, inv


def quantize_weight_rows(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                         group_scale: torch.Tensor | None = None,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward GEMM's weight: ``(G, N, K)`` -> FP8 ``(G, N, K)`` scaled per output
    channel (or per group with ``group_scale`` ``(G,)``), and ``(G, N)`` factors, written
    into ``out`` (such a pair, contiguous) if given."""
    G, N, K = weight.shape
    if N == 0:
        return out if out is not None else (
            weight.new_empty(G, 0, K, dtype=fp8_dtype),
            weight.new_empty(G, 0, dtype=torch.float32))
    flat_out = None if out is None else (out[0].view(G * N, K), out[1].view(G * N))
    data, inv = quantize_rows(weight.reshape(G * N, K), fp8_dtype, power_of_two, group_scale,
                              flat_out, group_rows=N if group_scale is not None else 0)
    return data.view(G, N, K), inv.view(G, N)
