"""FP8 copies of the ``(G, N, K)`` expert weights for the forward and dgrad GEMMs.

* :func:`quantize_weight_columns_t`: ``(G, N, K)`` -> FP8 ``(G, K, N)`` (each expert's
  transpose, the dgrad GEMM's operand), one scale per input channel (or per group).

It runs on the tiles of :mod:`grouped_linear.kernels.quantize_transposed` (each expert is
a group of ``N`` rows of the ``(G*N, K)`` view); the plain-PyTorch reference is beside it.
The forward GEMM's ``(G, N, K)`` copy, one scale per output channel, is
:func:`grouped_linear.kernels.quantize.quantize_weight_rows`, in passes of its own (writing
both copies in one pass measured slower on the H200).
"""

from __future__ import annotations

import torch

from . import quantize_transposed as qt
from ._triton import triton, use_triton
from .quantize import _finish, _fp8_buffer, saturate, scale_from_amax

__all__ = ["quantize_weight_columns_t", "quantize_weight_columns_t_reference"]


def quantize_weight_columns_t_reference(weight: torch.Tensor, fp8_dtype: torch.dtype,
                                        power_of_two: bool,
                                        group_scale: torch.Tensor | None = None
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    if group_scale is None:
        amax = weight.abs().amax(dim=1).float() if weight.shape[1] else \
            weight.new_zeros(weight.shape[0], weight.shape[2], dtype=torch.float32)
        scale = scale_from_amax(amax, fp8_dtype, power_of_two)  # (G, K)
    else:
        scale = group_scale[:, None].expand(weight.shape[0], weight.shape[2])
    data = saturate(weight, scale[:, None, :], fp8_dtype)
    return data.transpose(1, 2).contiguous(), (1.0 / scale).contiguous()


def _tiled(weight: torch.Tensor) -> bool:
    G, N, K = weight.shape
    return (use_triton(weight) and weight.is_contiguous() and weight.numel() > 0
            and qt.GROUP_COLUMNS_METHOD == "tiled" and G * K < 2**31)


def _columns_t_tiled(weight, fp8_dtype, power_of_two, group_scale):
    """The tiled kernels on the ``(G*N, K)`` view: expert ``g``'s rows go to
    ``data[g, k, n]`` (column stride ``N``, base ``g*K*N``)."""
    G, N, K = weight.shape
    data = _fp8_buffer((G, K, N), weight.device, fp8_dtype)
    ends = torch.arange(1, G + 1, device=weight.device, dtype=torch.int32) * N
    dst = torch.arange(1, G + 1, device=weight.device, dtype=torch.int64) * (K * N)
    inv = qt._quantize_group_columns_t_tiled(weight.view(G * N, K), ends, dst, data, fp8_dtype,
                                          power_of_two, group_scale, 1, stride_q=N,
                                          width=G * K * N, dst_multiple=N)
    return _finish(data, fp8_dtype), inv


def quantize_weight_columns_t(weight: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool,
                              group_scale: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad GEMM's weight: ``(G, N, K)`` -> FP8 ``(G, K, N)`` (each expert's
    transpose) scaled per input channel (or per group), and ``(G, K)`` factors."""
    G, N, K = weight.shape
    if _tiled(weight):
        return _columns_t_tiled(weight, fp8_dtype, power_of_two, group_scale)
    if not use_triton(weight) or not weight.is_contiguous() or weight.numel() == 0:
        return quantize_weight_columns_t_reference(weight, fp8_dtype, power_of_two, group_scale)
    data = _fp8_buffer((G, K, N), weight.device, fp8_dtype)
    ends = torch.arange(1, G + 1, device=weight.device, dtype=torch.int32) * N
    inv = torch.empty(G, K, device=weight.device, dtype=torch.float32)
    block_c = 64
    qt._quantize_group_columns_t_kernel[(G, triton.cdiv(K, block_c))](
        weight, ends, ends, data, inv, group_scale if group_scale is not None else inv, G * N, K,
        K, N, K * N, FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two,
        GIVEN_SCALE=group_scale is not None, LOCAL_ROWS=True, PAD=1, BLOCK_R=32,
        BLOCK_C=block_c,
    )
    return _finish(data, fp8_dtype), inv
