"""FP8 scaling and quantize -> dequantize of grouped tensors (plain-PyTorch references).

Scaling units ("where one scale applies"), for ``G`` groups of rows given by the
``(G,)`` cumulative ``offsets``:

* ``rows``: one scale per row of an ``(M, C)`` tensor (tokens);
* ``group_columns``: one scale per (group, column) of an ``(M, C)`` tensor: the
  wgrad operands, scaled along the tokens of each group;
* ``groups``: one scale per group of an ``(M, C)`` tensor (tensorwise);
* for a weight ``(G, N, K)``: ``dim=2`` one scale per (group, output channel),
  ``dim=1`` per (group, input channel), ``dim=None`` one per group.

``scale = fp8_max / amax`` (1 for all-zero units, finite always), optionally rounded
down to a power of two. ``fake_quant`` returns ``dequantize(quantize(t))`` in
float32: the exact values an FP8 GEMM multiplies, so CPU emulation and tests see
the same numerics as the device path.
"""

from dataclasses import dataclass

import torch

from .._triton import cdiv, interpreting, kernel, next_power_of_2, tl, triton, use_triton
from ..bias import row_groups

__all__ = ["scale_from_amax", "saturate", "fake_quant", "fake_quant_rows", "fake_quant_group_columns",
           "fake_quant_groups", "fake_quant_weight", "quantize_rows", "quantize_rows_reference",
           "quantize_rows_pieces", "piece_shifts", "PieceShifts",
           "quantize_weight_rows", "unit_factors",
           "fake_quant_column_tiles", "fake_quant_weight_blocks", "fake_quant_row_tiles"]

_FLOAT32_MAX = torch.finfo(torch.float32).max
# Launch shape of the rows kernel: (rows per program, columns per block, warps);
# benchmarks/fp8_quantize.py times the alternatives on the H200.
ROWS_CONFIG = (1, 4096, 8)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """float32 scales mapping ``amax`` onto the format's largest finite value."""
    amax = amax.float()
    fp8_max = torch.finfo(fp8_dtype).max
    scale = torch.where(amax > 0, fp8_max / amax.clamp(min=1e-30), torch.ones_like(amax))
    scale = scale.clamp(max=_FLOAT32_MAX)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


_UNIT_FACTORS: dict[torch.device, torch.Tensor] = {}


def unit_factors(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 ones of ``shape``: the dequantization factors of an FP8 operand whose scales
    were moved onto the other operand. On CUDA, a view of one buffer per device, filled when
    it is created or grown, not per call (read-only: GEMMs only read it). Inside a CUDA graph
    capture or a compiled region a fresh tensor is made: a buffer first filled there would
    stay unfilled until the graph's first replay."""
    numel = 1
    for size in shape:
        numel *= size
    if (device.type != "cuda" or torch.cuda.is_current_stream_capturing()
            or torch.compiler.is_compiling()):
        return torch.ones(shape, device=device, dtype=torch.float32)
    buffer = _UNIT_FACTORS.get(device)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.ones(max(numel, 4096), device=device, dtype=torch.float32)
        _UNIT_FACTORS[device] = buffer
    return buffer[:numel].view(shape)


def saturate(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``round_fp8(clamp(t * scale, -fp8_max, fp8_max))`` (``scale`` broadcasts)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def fake_quant(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``round_fp8(saturate(t * scale)) / scale`` in float32 (``scale`` broadcasts)."""
    return saturate(t, scale, fp8_dtype).float() / scale


def fake_quant_rows(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """One scale per row of ``(M, C)``."""
    amax = t.abs().amax(dim=1, keepdim=True) if t.shape[1] else t.new_zeros(t.shape[0], 1)
    return fake_quant(t, scale_from_amax(amax, fp8_dtype, power_of_two), fp8_dtype)


def _group_amax(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``(G, C)`` max of ``|t|`` over each group's rows (0 for empty groups)."""
    bounds = torch.cat([offsets.new_zeros(1), offsets]).to(torch.int64)
    return torch.segment_reduce(t.abs().float().contiguous(), "max", offsets=bounds, axis=0,
                                unsafe=True, initial=0.0)


def _per_row(values: torch.Tensor, offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Spread per-group ``(G, ...)`` values onto rows; rows past the last group get 1."""
    padded = torch.cat([values, torch.ones_like(values[:1])])
    return padded.index_select(0, row_groups(offsets, num_rows))


def fake_quant_group_columns(t: torch.Tensor, offsets: torch.Tensor, fp8_dtype: torch.dtype,
                             power_of_two: bool) -> torch.Tensor:
    """One scale per (group, column) of ``(M, C)``: amax over the group's rows."""
    scale = scale_from_amax(_group_amax(t, offsets), fp8_dtype, power_of_two)
    return fake_quant(t, _per_row(scale, offsets, t.shape[0]), fp8_dtype)


def fake_quant_groups(t: torch.Tensor, offsets: torch.Tensor, fp8_dtype: torch.dtype,
                      power_of_two: bool) -> torch.Tensor:
    """One scale per group of ``(M, C)``."""
    amax = _group_amax(t, offsets).amax(dim=1, keepdim=True) if t.shape[1] \
        else t.new_zeros(offsets.shape[0], 1)
    scale = scale_from_amax(amax, fp8_dtype, power_of_two)
    return fake_quant(t, _per_row(scale, offsets, t.shape[0]), fp8_dtype)


def fake_quant_weight(weight: torch.Tensor, dim: int | None, fp8_dtype: torch.dtype,
                      power_of_two: bool) -> torch.Tensor:
    """``(G, N, K)`` weight: one scale per slice along ``dim`` (2: per output channel,
    1: per input channel) or per group (``dim=None``)."""
    dims = (1, 2) if dim is None else (dim,)
    amax = weight.abs().amax(dim=dims, keepdim=True)
    return fake_quant(weight, scale_from_amax(amax, fp8_dtype, power_of_two), fp8_dtype)


# --------------------------------------------------------------------------- FP8 tensors
# The operands of real FP8 GEMMs: FP8 data plus float32 dequantization factors
# (``1 / scale``), as torch's scaled GEMMs take them.
def quantize_rows_reference(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)`` and ``(R,)`` float32 dequantization factors."""
    if scale is None:
        amax = t.abs().amax(dim=1) if t.shape[1] else t.new_zeros(t.shape[0])
        scale = scale_from_amax(amax, fp8_dtype, power_of_two)
    return saturate(t, scale[:, None], fp8_dtype), 1.0 / scale


@triton.jit
def _scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.where(amax > 0, FP8_MAX / tl.maximum(amax, 1e-30), 1.0)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    if POW2:
        scale = tl.math.exp2(tl.floor(tl.math.log2(scale)))
    return scale


@triton.jit
def piece_shift(shifts_ptr, g, MULTIPLE: tl.constexpr):
    """Element offset from the first piece's data to where group ``g``'s rows would start if
    the pieces were one tensor: ``t_ptr + piece_shift + row * stride`` addresses row ``row``
    (numbered in the concatenation). ``MULTIPLE``: what every shift is a multiple of."""
    return tl.multiple_of(tl.load(shifts_ptr + g), MULTIPLE)


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
        scale = _scale(amax, FP8_MAX, POW2)
    for c0 in range(0, C, BLOCK_C):  # pass 2: scale, saturate, round
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < C)[None, :]
        values = tl.load(t_ptr + base + cols[None, :], mask=mask, other=0.0)
        scaled = tl.clamp(values.to(tl.float32) * scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
                 scaled.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_ptr + rows, 1.0 / scale, mask=row_mask)


def _fp8_buffer(shape, device, fp8_dtype):
    """Where a kernel writes FP8 values. Triton 3.6's CPU interpreter rounds
    float32 -> FP8 wrongly, so there the kernel writes the scaled, saturated float32
    values and torch rounds them (:func:`_finish`); on GPUs the kernel stores FP8."""
    return torch.empty(shape, device=device,
                       dtype=torch.float32 if device.type == "cpu" else fp8_dtype)


def _finish(buffer: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return buffer if buffer.dtype == fp8_dtype else buffer.to(fp8_dtype)


def _rows_launch_shape(C: int) -> tuple[int, int, int]:
    """(rows per program, columns per block, warps) of :func:`_quantize_rows_kernel` for
    rows of ``C``: ``ROWS_CONFIG``, with several narrow rows per program."""
    block_r, max_block_c, warps = ROWS_CONFIG
    block_c = min(max_block_c, next_power_of_2(max(C, 16)))
    return max(block_r, max_block_c // block_c), block_c, warps


def quantize_rows(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                  scale: torch.Tensor | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  groups: torch.Tensor | None = None, group_rows: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, C)`` -> FP8 ``(R, C)`` and ``(R,)`` dequantization factors, one read pass
    per row block (two when a row is wider than one block). ``scale`` ``(R,)`` float32
    gives the rows' scales instead of deriving them from the rows' amax; with ``groups``
    (the ``(G,)`` row ends of groups of rows) or ``group_rows`` (groups of that many rows)
    it is ``(G,)``, one scale per group (rows past the last end take the last group's).
    ``out``: an FP8 ``(R, C)`` tensor with unit column stride and a float32 ``(R,)`` one to
    write into (views of larger buffers: see :func:`quantize_rows_pieces`)."""
    kernel = use_triton(t) and t.stride(-1) == 1 and t.shape[0] > 0
    if scale is not None and (groups is not None or group_rows):
        num_groups = groups.shape[0] if groups is not None else -(-t.shape[0] // group_rows)
        if not (kernel and out is None and 0 < num_groups <= _MAX_KERNEL_GROUPS):
            scale = _scale_per_row(scale, groups, group_rows, t.shape[0])
            groups, group_rows = None, 0
    else:
        groups, group_rows = None, 0
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
        data = _fp8_buffer((R, C), t.device, fp8_dtype)
        inv = torch.empty(R, device=t.device, dtype=torch.float32)
    if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous()):
        scale = scale.float().contiguous()
    _launch_rows(t, data, inv, scale, fp8_dtype, power_of_two, ends=groups,
                 group_rows=group_rows)
    return _finish(data, fp8_dtype), inv


# Group-scaled rows with more groups than this take per-row scales (the kernel holds all
# the group ends of a row at once).
_MAX_KERNEL_GROUPS = 4096


def _scale_per_row(scale: torch.Tensor, groups: torch.Tensor | None, group_rows: int,
                   num_rows: int) -> torch.Tensor:
    """Per-group scales spread onto ``num_rows`` rows (past the last group: the last's)."""
    if groups is None:
        index = torch.arange(num_rows, device=scale.device) // group_rows
    else:
        index = row_groups(groups, num_rows)
    return scale.float().index_select(0, index.clamp(max=scale.shape[0] - 1)).contiguous()


def _launch_rows(t: torch.Tensor, data: torch.Tensor, inv: torch.Tensor,
                 scale: torch.Tensor | None, fp8_dtype: torch.dtype, power_of_two: bool,
                 shifts: "PieceShifts | None" = None, ends: torch.Tensor | None = None,
                 group_rows: int = 0) -> None:
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
    block_r, block_c, warps = _rows_launch_shape(C)
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


@dataclass(frozen=True)
class PieceShifts:
    """How one kernel launch reads a list of ``(m_g, C)`` pieces as their concatenation:
    the kernel gets ``base`` (the first non-empty piece) and ``shifts`` ``(G,)`` int64 on
    the device (see :func:`piece_shift`), all multiples of ``multiple`` elements."""

    base: torch.Tensor
    shifts: torch.Tensor
    multiple: int


def piece_shifts(pieces: list[torch.Tensor]) -> PieceShifts | None:
    """:class:`PieceShifts` of ``pieces``, or ``None`` where one launch cannot read them:
    no rows, pieces of different strides, dtypes or devices, or a CUDA graph being captured
    (the ``(G,)`` shifts go to the device with an asynchronous copy from pageable memory,
    which capture does not allow). Empty pieces take the previous piece's shift."""
    filled = [piece for piece in pieces if piece.shape[0]]
    if not filled:
        return None
    base = filled[0]
    if not base.is_cuda and not interpreting():
        return None
    if base.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    stride, size = base.stride(0), base.element_size()
    for piece in filled:
        if (piece.dtype != base.dtype or piece.device != base.device or piece.stride(-1) != 1
                or piece.stride(0) != stride or (piece.data_ptr() - base.data_ptr()) % size):
            return None
    start, shifts = 0, []
    for piece in pieces:
        if piece.shape[0]:
            shifts.append((piece.data_ptr() - base.data_ptr()) // size - start * stride)
        else:
            shifts.append(shifts[-1] if shifts else 0)
        start += piece.shape[0]
    multiple = 16
    while multiple > 1 and any(shift % multiple for shift in shifts):
        multiple //= 2
    host = torch.tensor(shifts, dtype=torch.int64)
    return PieceShifts(base, host.to(base.device, non_blocking=True), multiple)


def quantize_rows_pieces(pieces: list[torch.Tensor], fp8_dtype: torch.dtype, power_of_two: bool,
                         group_scale: torch.Tensor | None = None,
                         offsets: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``torch.cat(pieces)`` without the concatenation: each
    ``(m_g, C)`` piece is quantized straight into its rows of one FP8 ``(M, C)`` buffer
    (one read of each piece). ``group_scale`` ``(G,)``: piece ``g``'s rows all take scale
    ``group_scale[g]`` (tensorwise) instead of their own amax. ``offsets``: the pieces'
    ``(G,)`` row ends on the device; with them, one launch reads all the pieces (see
    :func:`piece_shifts`), else one launch per piece."""
    rows = sum(piece.shape[0] for piece in pieces)
    C = pieces[0].shape[1]
    device = pieces[0].device
    shifts = piece_shifts(pieces) if use_triton(pieces[0]) and rows and offsets is not None \
        else None
    if shifts is not None:  # one launch over all the pieces
        data = _fp8_buffer((rows, C), device, fp8_dtype)
        inv = torch.empty(rows, device=device, dtype=torch.float32)
        scale = group_scale.float().contiguous() if group_scale is not None else None
        _launch_rows(shifts.base, data, inv, scale, fp8_dtype, power_of_two, shifts, offsets)
        return _finish(data, fp8_dtype), inv
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


# --------------------------------------------------------------------------- weights
def quantize_weight_rows(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                         group_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward GEMM's weight: ``(G, N, K)`` -> FP8 ``(G, N, K)`` scaled per output
    channel (or per group with ``group_scale`` ``(G,)``), and ``(G, N)`` factors."""
    G, N, K = weight.shape
    if N == 0:
        return weight.new_empty(G, 0, K, dtype=fp8_dtype), weight.new_empty(G, 0,
                                                                           dtype=torch.float32)
    data, inv = quantize_rows(weight.reshape(G * N, K), fp8_dtype, power_of_two, group_scale,
                              group_rows=N if group_scale is not None else 0)
    return data.view(G, N, K), inv.view(G, N)


# --------------------------------------------------------------------------- block scaling
def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-t.shape[dim]) % multiple
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def fake_quant_column_tiles(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                            tile: int = 128) -> torch.Tensor:
    """One scale per (row, ``tile`` consecutive columns) of ``(M, C)``: 1x128 tiles."""
    M, C = t.shape
    padded = _pad_to(t.float(), 1, tile)
    tiles = padded.view(M, padded.shape[1] // tile, tile)  # explicit sizes: M may be 0
    scale = scale_from_amax(tiles.abs().amax(dim=2, keepdim=True), fp8_dtype, power_of_two)
    return fake_quant(tiles, scale, fp8_dtype).view(M, padded.shape[1])[:, :C]


def fake_quant_weight_blocks(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                             block: int = 128) -> torch.Tensor:
    """One scale per ``block x block`` tile of each ``(N, K)`` expert weight."""
    G, N, K = weight.shape
    padded = _pad_to(_pad_to(weight.float(), 1, block), 2, block)
    tiles = padded.view(G, padded.shape[1] // block, block, padded.shape[2] // block, block)
    scale = scale_from_amax(tiles.abs().amax(dim=(2, 4), keepdim=True), fp8_dtype, power_of_two)
    return fake_quant(tiles, scale, fp8_dtype).view(padded.shape)[:, :N, :K]


def fake_quant_row_tiles(t: torch.Tensor, offsets: torch.Tensor, fp8_dtype: torch.dtype,
                         power_of_two: bool, tile: int = 128) -> torch.Tensor:
    """One scale per (``tile`` consecutive rows of one group, column) of ``(M, C)``: the
    wgrad operands' 128x1 tiles along the tokens, never straddling a group boundary.
    Reads the offsets back to the host (emulation only)."""
    bounds, start = [], 0
    for end in offsets.tolist():
        bounds.extend(range(start, end, tile))
        start = end
    bounds.append(start)
    tile_ends = torch.tensor(bounds[1:], dtype=torch.int64, device=t.device)
    if tile_ends.numel() == 0:  # every group empty: wgrad reads none of these rows
        return torch.zeros_like(t, dtype=torch.float32)
    scale = scale_from_amax(_group_amax(t, tile_ends), fp8_dtype, power_of_two)
    return fake_quant(t, _per_row(scale, tile_ends, t.shape[0]), fp8_dtype)
