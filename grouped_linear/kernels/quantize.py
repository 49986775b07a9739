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

import torch

from .bias import row_groups

__all__ = ["scale_from_amax", "fake_quant", "fake_quant_rows", "fake_quant_group_columns",
           "fake_quant_groups", "fake_quant_weight"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """float32 scales mapping ``amax`` onto the format's largest finite value."""
    amax = amax.float()
    fp8_max = torch.finfo(fp8_dtype).max
    scale = torch.where(amax > 0, fp8_max / amax.clamp(min=1e-30), torch.ones_like(amax))
    scale = scale.clamp(max=_FLOAT32_MAX)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def fake_quant(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``round_fp8(saturate(t * scale)) / scale`` in float32 (``scale`` broadcasts)."""
    fp8_max = torch.finfo(fp8_dtype).max
    quantized = (t.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return quantized.float() / scale


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
