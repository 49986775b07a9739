"""FP8 scaling rules and the buffers the quantization kernels share.

``scale = fp8_max / amax`` (1 for all-zero units, finite always), optionally rounded down
to a power of two: :func:`scale_from_amax` on the host, :func:`amax_to_scale` in Triton kernels
(the same float32 arithmetic, bit for bit). The quantized values are
``round_fp8(clamp(t * scale, -fp8_max, fp8_max))`` (:func:`saturate`) and the GEMMs take
the float32 dequantization factors ``1 / scale``.
"""

from dataclasses import dataclass

import torch

from .._triton import interpreting, tl, triton

__all__ = ["scale_from_amax", "unit_factors", "saturate", "amax_to_scale", "inverse", "fp8_buffer",
           "finish", "pad_to", "fold_row_factors", "group_amax", "magnitudes", "piece_shift",
           "PieceShifts", "piece_shifts"]


_FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """float32 scales mapping ``amax`` onto the format's largest finite value."""
    amax = amax.float()
    fp8_max = torch.finfo(fp8_dtype).max
    # a tensor by a tensor: torch computes a Python number by a tensor as the number times
    # the reciprocal, which differs from the kernels' division by an ulp in 1 scale of 6
    scale = torch.where(amax > 0, torch.full_like(amax, fp8_max) / amax.clamp(min=1e-30),
                        torch.ones_like(amax))
    scale = scale.clamp(max=_FLOAT32_MAX)
    if power_of_two:  # from the exponent: a float32 log2 rounds up just below a power of two
        # (a scale of 0, from an infinite amax, stays 0 as in the kernels: frexp(0) would
        # give 0.5, and the unit's infinity a finite value)
        scale = torch.where(scale > 0, torch.ldexp(torch.ones_like(scale),
                                                   torch.frexp(scale).exponent - 1), scale)
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


@triton.jit
def clamp_keeping_nan(values, limit):
    """``clamp(values, -limit, limit)`` with NaN kept, as torch's ``clamp`` keeps it (Triton's
    default drops a NaN operand of min/max on GPUs, and the interpreter keeps it)."""
    return tl.clamp(values, -limit, limit, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_to_scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    # div_rn: Triton's ``/`` is PTX's approximate division (2 ulp), not the host's
    scale = tl.where(amax > 0, tl.math.div_rn(FP8_MAX, tl.maximum(amax, 1e-30)), 1.0)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    if POW2:  # the largest power of two not above: the exponent bits alone
        scale = ((scale.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def inverse(scale):
    """``1 / scale`` rounded as the host rounds it (Triton's ``/`` is approximate on GPUs)."""
    return tl.math.div_rn(1.0, scale)


def fp8_buffer(shape, device, fp8_dtype):
    """Where a kernel writes FP8 values. Triton 3.6's CPU interpreter rounds
    float32 -> FP8 wrongly, so there the kernel writes the scaled, saturated float32
    values and torch rounds them (:func:`finish`); on GPUs the kernel stores FP8."""
    return torch.empty(shape, device=device,
                       dtype=torch.float32 if device.type == "cpu" else fp8_dtype)


def finish(buffer: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return buffer if buffer.dtype == fp8_dtype else buffer.to(fp8_dtype)


def pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-t.shape[dim]) % multiple
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def fold_row_factors(t: torch.Tensor, row_factors: torch.Tensor) -> torch.Tensor:
    """``t[m, :] * row_factors[m]`` in float32, kept finite (saturated at float32's range)."""
    limit = torch.finfo(torch.float32).max
    return (t.float() * row_factors.float()[:, None]).clamp(-limit, limit)


def magnitudes(t: torch.Tensor) -> torch.Tensor:
    """``|t|`` with a NaN taken as 0, as the kernels' maxima skip it: a unit's scale comes from
    its other values (the NaN stays NaN in its own code)."""
    return t.abs().nan_to_num_(nan=0.0, posinf=float("inf"))


def group_amax(t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``(G, C)`` max of ``|t|`` over each group's rows (0 for empty groups)."""
    bounds = torch.cat([ends.new_zeros(1), ends]).to(torch.int64)
    return torch.segment_reduce(magnitudes(t).float().contiguous(), "max", offsets=bounds, axis=0,
                                unsafe=True, initial=0.0)


@triton.jit
def piece_shift(shifts_ptr, g, MULTIPLE: tl.constexpr):
    """Element offset from the first piece's data to where group ``g``'s rows would start if
    the pieces were one tensor: ``t_ptr + piece_shift + row * stride`` addresses row ``row``
    (numbered in the concatenation). ``MULTIPLE``: what every shift is a multiple of."""
    return tl.multiple_of(tl.load(shifts_ptr + g), MULTIPLE)


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
