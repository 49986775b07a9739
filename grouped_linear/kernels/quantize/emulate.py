"""FP8 quantize -> dequantize of grouped tensors in plain PyTorch (the emulated recipes
and the tests' references).

Scaling units ("where one scale applies"), for ``G`` groups of rows given by the
``(G,)`` cumulative ``ends``:

* ``rows``: one scale per row of an ``(M, C)`` tensor (tokens);
* ``group_columns``: one scale per (group, column) of an ``(M, C)`` tensor: the
  wgrad operands, scaled along the tokens of each group;
* ``groups``: one scale per group of an ``(M, C)`` tensor (tensorwise);
* for a weight ``(G, N, K)``: ``dim=2`` one scale per (group, output channel),
  ``dim=1`` per (group, input channel), ``dim=None`` one per group;
* block scaling: 1x128 column tiles, 128x128 weight blocks, 128x1 row tiles per group.

Scales follow :func:`~grouped_linear.kernels.quantize.common.scale_from_amax`.
``fake_quant`` returns ``dequantize(quantize(t))`` in float32: the exact values an FP8
GEMM multiplies, so CPU emulation and tests see the same numerics as the device path.
"""

import torch

from .._groups import row_groups
from .common import group_amax, magnitudes, pad_to, saturate, scale_from_amax

__all__ = ["dequantize_codes", "fake_quant", "fake_quant_rows", "fake_quant_group_columns",
           "fake_quant_groups",
           "group_scales_per_row", "per_row",
           "fake_quant_weight", "fake_quant_column_tiles", "fake_quant_weight_blocks",
           "fake_quant_row_tiles"]


def fake_quant(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``round_fp8(saturate(t * scale)) / scale`` in float32 (``scale`` broadcasts)."""
    return saturate(t, scale, fp8_dtype).float() / scale


def fake_quant_rows(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    """One scale per row of ``(M, C)``."""
    amax = magnitudes(t).amax(dim=1, keepdim=True) if t.shape[1] else t.new_zeros(t.shape[0], 1)
    return fake_quant(t, scale_from_amax(amax, fp8_dtype, power_of_two), fp8_dtype)


def per_row(values: torch.Tensor, ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Spread per-group ``(G, ...)`` values onto rows; rows past the last group get 1."""
    padded = torch.cat([values, torch.ones_like(values[:1])])
    return padded.index_select(0, row_groups(ends, num_rows))


def fake_quant_group_columns(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                             power_of_two: bool) -> torch.Tensor:
    """One scale per (group, column) of ``(M, C)``: amax over the group's rows."""
    scale = scale_from_amax(group_amax(t, ends), fp8_dtype, power_of_two)
    return fake_quant(t, per_row(scale, ends, t.shape[0]), fp8_dtype)


def group_scales_per_row(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                         power_of_two: bool) -> torch.Tensor:
    """``(M,)``: each row of ``(M, C)`` gets its group's scale (from the group's amax); rows
    past the last group 1."""
    amax = group_amax(t, ends).amax(dim=1) if t.shape[1] else t.new_zeros(ends.shape[0])
    return per_row(scale_from_amax(amax, fp8_dtype, power_of_two), ends, t.shape[0])


def fake_quant_groups(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                      power_of_two: bool) -> torch.Tensor:
    """One scale per group of ``(M, C)``."""
    scale = group_scales_per_row(t, ends, fp8_dtype, power_of_two)
    return fake_quant(t, scale[:, None], fp8_dtype)


def fake_quant_weight(weight: torch.Tensor, dim: int | None, fp8_dtype: torch.dtype,
                      power_of_two: bool) -> torch.Tensor:
    """``(G, N, K)`` weight: one scale per slice along ``dim`` (2: per output channel,
    1: per input channel) or per group (``dim=None``)."""
    dims = (1, 2) if dim is None else (dim,)
    amax = magnitudes(weight).amax(dim=dims, keepdim=True)
    return fake_quant(weight, scale_from_amax(amax, fp8_dtype, power_of_two), fp8_dtype)


def fake_quant_column_tiles(t: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                            tile: int = 128) -> torch.Tensor:
    """One scale per (row, ``tile`` consecutive columns) of ``(M, C)``: 1x128 tiles."""
    M, C = t.shape
    padded = pad_to(t.float(), 1, tile)
    tiles = padded.view(M, padded.shape[1] // tile, tile)  # explicit sizes: M may be 0
    scale = scale_from_amax(magnitudes(tiles).amax(dim=2, keepdim=True), fp8_dtype, power_of_two)
    return fake_quant(tiles, scale, fp8_dtype).view(M, padded.shape[1])[:, :C]


def fake_quant_weight_blocks(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                             block: int = 128) -> torch.Tensor:
    """One scale per ``block x block`` tile of each ``(N, K)`` expert weight."""
    G, N, K = weight.shape
    padded = pad_to(pad_to(weight.float(), 1, block), 2, block)
    tiles = padded.view(G, padded.shape[1] // block, block, padded.shape[2] // block, block)
    scale = scale_from_amax(magnitudes(tiles).amax(dim=(2, 4), keepdim=True), fp8_dtype, power_of_two)
    return fake_quant(tiles, scale, fp8_dtype).view(padded.shape)[:, :N, :K]


def fake_quant_row_tiles(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                         power_of_two: bool, tile: int = 128) -> torch.Tensor:
    """One scale per (``tile`` consecutive rows of one group, column) of ``(M, C)``: the
    wgrad operands' 128x1 tiles along the tokens, never straddling a group boundary.
    Reads the ends back to the host (emulation only)."""
    bounds, start = [], 0
    for end in ends.tolist():
        bounds.extend(range(start, end, tile))
        start = end
    bounds.append(start)
    tile_ends = torch.tensor(bounds[1:], dtype=torch.int64, device=t.device)
    if tile_ends.numel() == 0:  # every group empty: wgrad reads none of these rows
        return torch.zeros_like(t, dtype=torch.float32)
    scale = scale_from_amax(group_amax(t, tile_ends), fp8_dtype, power_of_two)
    return fake_quant(t, per_row(scale, tile_ends, t.shape[0]), fp8_dtype)


def dequantize_codes(codes: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``(G, N, K)`` weight's values from its FP8 codes and factors, in ``dtype``: ``inv``
    ``(G, N)`` per output channel (or expert, repeated), or ``(G, cdiv(N, 128),
    cdiv(K, 128))`` per 128x128 block."""
    values = codes.float()
    if inv.dim() == 2:  # per output channel
        values = values * inv[:, :, None]
    else:  # per 128x128 block
        G, N, K = codes.shape
        factors = inv.repeat_interleave(128, 1).repeat_interleave(128, 2)
        values = values * factors[:, :N, :K]
    return values.to(dtype)
