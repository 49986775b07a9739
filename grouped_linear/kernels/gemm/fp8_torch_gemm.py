"""FP8 grouped GEMMs on the device: torch's rowwise-scaled grouped GEMM (sm90).

Operands are FP8 data plus float32 dequantization factors (``1 / scale``), as
:mod:`grouped_linear.kernels.quantize.rows` produces them:

* forward ``y = x @ W_g^T``: ``x`` ``(M, K)`` with ``(M,)`` factors, ``W`` ``(G, N, K)``
  with ``(G, N)`` (one per output channel);
* dgrad ``dx = dy @ W_g``: ``dy`` ``(M, N)`` with ``(M,)``, the weight as ``(G, K, N)``
  with ``(G, K)`` (one per input channel; the recipes pass the forward copy transposed,
  with ones or the group's factor, see ``ops/fp8/scaled_mm.py``).

The weight gradient is not torch's: its 2-D x 2-D form, which must accumulate without the
fast-accumulation shortcut, ran 1.2-2.9x slower than this library's group-scaled Triton
kernel on every case measured (:func:`grouped_linear.kernels.gemm.fp8_triton_gemm.blockwise_wgrad`,
``docs/design.md``).

A per-group (tensorwise) scale is the same call with its factor repeated.
``ends`` is the ``(G,)`` int32 cumulative group ends; rows past the last end
are left unwritten (callers zero them). The reference of each is a float32
matmul of the dequantized operands (:func:`dequantized_reference`).
"""

from __future__ import annotations

import functools

import torch

from .._gluon import is_sm90

__all__ = ["available", "shapes_supported", "gemm_accepts", "forward", "dgrad",
           "dequantized_reference"]


def available(device: torch.device) -> bool:
    """Whether torch's rowwise FP8 grouped GEMM can run on ``device`` (CUDA sm90)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return is_sm90(index)


def shapes_supported(in_features: int, out_features: int) -> bool:
    """The GEMM needs 16-byte aligned rows of every FP8 operand."""
    return in_features % 16 == 0 and out_features % 16 == 0 and in_features > 0 \
        and out_features > 0


@functools.cache
def gemm_accepts(a_dtype: torch.dtype, b_dtype: torch.dtype, device_index: int) -> bool:
    """Whether the grouped GEMM takes this pair of FP8 formats (tried once, on 16 rows)."""
    device = torch.device("cuda", device_index)
    a = torch.zeros(16, 16, device=device).to(a_dtype)
    b = torch.zeros(1, 16, 16, device=device).to(b_dtype)
    ones_a = torch.ones(16, device=device)
    ones_b = torch.ones(1, 16, device=device)
    ends = torch.full((1,), 16, device=device, dtype=torch.int32)
    try:
        torch._scaled_grouped_mm(a, b.transpose(-2, -1), ones_a, ones_b, offs=ends,
                                 out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError):  # torch 2.11 raises ValueError for e5m2 operands
        return False
    return True


def forward(x_data: torch.Tensor, x_inv: torch.Tensor, w_data: torch.Tensor, w_inv: torch.Tensor,
            ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(M, K) x (G, N, K) -> (M, N)`` in ``out_dtype``."""
    return torch._scaled_grouped_mm(x_data, w_data.transpose(-2, -1), x_inv, w_inv, offs=ends,
                                    out_dtype=out_dtype, use_fast_accum=True)


def dgrad(dy_data: torch.Tensor, dy_inv: torch.Tensor, wt_data: torch.Tensor, wt_inv: torch.Tensor,
          ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(M, N) x (G, K, N) -> (M, K)`` in ``out_dtype``."""
    return torch._scaled_grouped_mm(dy_data, wt_data.transpose(-2, -1), dy_inv, wt_inv,
                                    offs=ends, out_dtype=out_dtype, use_fast_accum=True)


def dequantized_reference(a_data: torch.Tensor, a_inv: torch.Tensor, b_data: torch.Tensor,
                          b_inv: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """float32 result of :func:`forward` (also :func:`dgrad`'s form) from the dequantized
    operands."""
    host = ends.tolist()
    a = a_data.float() * a_inv[:, None]
    b = b_data.float() * b_inv[:, :, None]
    out = a.new_zeros(a.shape[0], b.shape[1])
    for g, (s, e) in enumerate(zip([0] + host[:-1], host)):
        out[s:e] = a[s:e] @ b[g].t()
    return out
