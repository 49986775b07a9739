"""Tensorwise FP8 scales: one scale per group of rows, found without a host sync.

* :func:`group_amax_scales`: the ``(G,)`` scales of the row groups of an ``(M, C)``
  tensor (activations and gradients, groups given by their cumulative row ends);
* :func:`weight_group_scales`: the ``(G,)`` scales of ``(G, N, K)`` expert weights, and
  optionally their factors spread over ``(G, width)`` (what the dgrad GEMM reads).

On GPUs each is three launches whatever ``G`` is: a zero fill, one pass over the tensor
(each program's rows' maxima, one atomic maximum per group they touch) and a small kernel
that turns maxima into scales (:func:`~grouped_linear.kernels.quantize.common.scale_from_amax`'s
rule). The plain-PyTorch references sit beside them.
"""

from __future__ import annotations

import torch

from .._groups import row_group, row_groups
from .._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .common import amax_to_scale, magnitudes, scale_from_amax

__all__ = ["group_amax_scales", "group_amax_scales_reference", "weight_group_scales",
           "weight_group_scales_reference", "AMAX_CONFIG"]

# Launch shape of the group-amax pass: (rows per program, columns per block, warps).
AMAX_CONFIG = (16, 1024, 8)


@kernel
@triton.jit
def _group_amax_kernel(t_ptr, ends_ptr, amax_ptr, R, C, G, stride_t, GROUP_ROWS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr):
    """``amax[g] = max |t[r, c]|`` over the rows ``r`` of group ``g`` (``amax`` starts at 0):
    rows ``[ends[g-1], ends[g])``, or with ``GROUP_ROWS > 0`` rows ``[g * GROUP_ROWS, (g + 1)
    * GROUP_ROWS)``. The program's row maxima, then one atomic maximum per group its rows
    fall in (rows past the last group count for none)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    base = rows.to(tl.int64)[:, None] * stride_t
    row_max = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        values = tl.load(t_ptr + base + cols[None, :], mask=row_mask[:, None] & (cols < C)[None, :],
                         other=0.0)
        row_max = tl.maximum(row_max, tl.max(tl.abs(values.to(tl.float32)), axis=1))
    if GROUP_ROWS > 0:
        groups = rows // GROUP_ROWS
    else:
        groups = row_group(ends_ptr, rows, G, BLOCK_G)
    groups = tl.where(row_mask & (groups < G), groups, G)
    first = tl.min(groups, axis=0)
    last = tl.max(tl.where(groups < G, groups, -1), axis=0)
    for g in range(first, last + 1):  # groups of no row here add a 0: no change
        tl.atomic_max(amax_ptr + g, tl.max(tl.where(groups == g, row_max, 0.0), axis=0))


@kernel
@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, inv_ptr, n, width, FP8_MAX: tl.constexpr,
                   POW2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """``scale[i]`` from ``amax[i]``; with ``width > 0`` also ``inv[i, :width] = 1 / scale[i]``."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    scale = amax_to_scale(tl.load(amax_ptr + idx, mask=mask, other=0.0), FP8_MAX, POW2)
    tl.store(scale_ptr + idx, scale, mask=mask)
    inv = 1.0 / scale
    for w0 in range(0, width, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        tl.store(inv_ptr + idx.to(tl.int64)[:, None] * width + cols[None, :],
                 tl.zeros([BLOCK, BLOCK_W], dtype=tl.float32) + inv[:, None],
                 mask=mask[:, None] & (cols < width)[None, :])


def _scales_from_rows(t: torch.Tensor, ends: torch.Tensor | None, num_groups: int,
                      group_rows: int, fp8_dtype: torch.dtype, power_of_two: bool,
                      inv_width: int, config: tuple[int, int, int]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels' path: ``(G,)`` scales of the row groups of ``t`` (by ``ends`` or every
    ``group_rows`` rows), and the ``(G, inv_width)`` spread factors when ``inv_width``."""
    R, C = t.shape
    device = t.device
    amax = torch.zeros(num_groups, device=device, dtype=torch.float32)
    block_r, max_block_c, warps = config
    block_c = min(max_block_c, next_power_of_2(max(C, 16)))
    _group_amax_kernel[(cdiv(R, block_r),)](
        t, ends if ends is not None else amax, amax, R, C, num_groups, t.stride(0),
        GROUP_ROWS=group_rows, BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_G=min(256, next_power_of_2(num_groups)), num_warps=warps)
    scale = torch.empty(num_groups, device=device, dtype=torch.float32)
    inv = torch.empty(num_groups, inv_width, device=device, dtype=torch.float32) \
        if inv_width else None
    block = 16
    _scales_kernel[(cdiv(num_groups, block),)](
        amax, scale, inv if inv is not None else scale, num_groups, inv_width,
        FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two, BLOCK=block,
        BLOCK_W=min(256, next_power_of_2(max(inv_width, 16))))
    return scale, inv


def _kernels_ok(t: torch.Tensor, num_groups: int) -> bool:
    return (use_triton(t) and t.dim() == 2 and t.stride(-1) == 1 and t.shape[0] > 0
            and t.shape[1] > 0 and 0 < num_groups <= 2**20)


def group_amax_scales_reference(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                                power_of_two: bool) -> torch.Tensor:
    """Plain PyTorch: the rows' maxima, a scatter-max into their groups, the scales."""
    G = ends.shape[0]
    if t.shape[1] == 0 or t.shape[0] == 0:
        return scale_from_amax(t.new_zeros(G, dtype=torch.float32), fp8_dtype, power_of_two)
    row_amax = magnitudes(t).amax(dim=1).float()
    amax = row_amax.new_zeros(G + 1).scatter_reduce_(0, row_groups(ends, t.shape[0]), row_amax,
                                                     "amax")
    return scale_from_amax(amax[:G], fp8_dtype, power_of_two)


def group_amax_scales(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                      power_of_two: bool, *,
                      config: tuple[int, int, int] = AMAX_CONFIG) -> torch.Tensor:
    """``(G,)`` float32 tensorwise scales of the row groups of ``(M, C)`` ending at
    ``ends`` ``(G,)`` (rows past the last end belong to none); empty groups get 1.
    ``config``: the launch shape of the amax pass."""
    G = ends.shape[0]
    if not _kernels_ok(t, G):
        return group_amax_scales_reference(t, ends, fp8_dtype, power_of_two)
    return _scales_from_rows(t, ends, G, 0, fp8_dtype, power_of_two, 0, config)[0]


def weight_group_scales_reference(weight: torch.Tensor, fp8_dtype: torch.dtype,
                                  power_of_two: bool) -> torch.Tensor:
    """Plain PyTorch: one maximum per expert, then the scales."""
    if weight[0].numel() == 0:
        return scale_from_amax(weight.new_zeros(weight.shape[0], dtype=torch.float32), fp8_dtype,
                               power_of_two)
    amax = magnitudes(weight).amax(dim=(1, 2)).float()
    return scale_from_amax(amax, fp8_dtype, power_of_two)


def weight_group_scales(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                        inv_width: int = 0, *, config: tuple[int, int, int] = AMAX_CONFIG
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(G,)`` float32 tensorwise scales of ``(G, N, K)`` expert weights, and with
    ``inv_width`` their factors ``1 / scale`` spread over ``(G, inv_width)`` (else ``None``).
    ``config``: the launch shape of the amax pass."""
    G, N, K = weight.shape
    rows = weight.reshape(G * N, K) if weight.is_contiguous() else None
    if rows is None or not _kernels_ok(rows, G):
        scale = weight_group_scales_reference(weight, fp8_dtype, power_of_two)
        inv = (1.0 / scale)[:, None].expand(G, inv_width).contiguous() if inv_width else None
        return scale, inv
    return _scales_from_rows(rows, None, G, N, fp8_dtype, power_of_two, inv_width, config)
