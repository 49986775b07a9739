"""FP8 grouped GEMMs on the device: torch's rowwise-scaled grouped GEMM (sm90).

Operands are FP8 data plus float32 dequantization factors (``1 / scale``), as
:mod:`grouped_linear.kernels.quantize.rows` produces them:

* forward ``y = x @ W_g^T``: ``x`` ``(M, K)`` with ``(M,)`` factors, ``W`` ``(G, N, K)``
  with ``(G, N)`` (one per output channel);
* dgrad ``dx = dy @ W_g``: ``dy`` ``(M, N)`` with ``(M,)``, the weight as ``(G, K, N)``
  with ``(G, K)`` (one per input channel; the recipes pass the forward copy transposed,
  with ones or the group's factor, see ``ops/fp8_device.py``);
* wgrad ``dW_g = dy_g^T @ x_g``: ``dy^T`` ``(N, M)`` and ``x^T`` ``(K, M)``, with
  ``(G, N)`` and ``(G, K)`` factors (per group and column, along the tokens).

A per-group (tensorwise) scale is the same call with its factor repeated.
``ends`` is the ``(G,)`` int32 cumulative group ends; rows past the last end
are left unwritten (callers zero them). The reference of each is a float32
matmul of the dequantized operands (:func:`dequantized_reference`).
"""

from __future__ import annotations

import functools

import torch

from .._gluon import is_sm90

# The wgrad form reduces over the tokens: each group must start on a 16-element
# boundary there (unaligned ends trip a device-side assert in torch 2.11).
WGRAD_GROUP_ALIGN = 16

__all__ = ["WGRAD_GROUP_ALIGN", "available", "shapes_supported", "gemm_accepts", "forward", "dgrad", "wgrad",
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


def wgrad(dy_t_data: torch.Tensor, dy_inv: torch.Tensor, x_t_data: torch.Tensor,
          x_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(N, M) x (K, M) -> (G, N, K)`` in ``out_dtype``: the token dimension is the one
    reduced, split into groups by ``ends`` (each a multiple of
    :data:`WGRAD_GROUP_ALIGN`; see ``quantize_group_columns_t(align=...)``).
    Accumulates without fast-accumulation shortcuts (groups can be long)."""
    return torch._scaled_grouped_mm(dy_t_data, x_t_data.t(), dy_inv.reshape(-1),
                                    x_inv.reshape(-1), offs=ends, out_dtype=out_dtype,
                                    use_fast_accum=False)


def dequantized_reference(a_data: torch.Tensor, a_inv: torch.Tensor, b_data: torch.Tensor,
                          b_inv: torch.Tensor, ends: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 result of :func:`forward` (``kind="forward"``, also dgrad's form) or
    :func:`wgrad` (``kind="wgrad"``) from the dequantized operands."""
    host = ends.tolist()
    bounds = list(zip([0] + host[:-1], host))
    if kind == "forward":
        a = a_data.float() * a_inv[:, None]
        b = b_data.float() * b_inv[:, :, None]
        out = a.new_zeros(a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(bounds):
            out[s:e] = a[s:e] @ b[g].t()
        return out
    G = ends.shape[0]
    out = a_data.new_zeros(G, a_data.shape[0], b_data.shape[0], dtype=torch.float32)
    for g, (s, e) in enumerate(bounds):
        a = a_data[:, s:e].float() * a_inv[g][:, None]
        b = b_data[:, s:e].float() * b_inv[g][:, None]
        out[g] = a @ b.t()
    return out
