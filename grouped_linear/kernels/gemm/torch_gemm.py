"""The three GEMMs of a grouped linear layer, for each backend.

Tensors in, tensors out: no autograd, no module state. Groups are given by
``ends``, the ``(G,)`` cumulative row ends on the compute device, and
optionally ``host_ends``, the same ends as a CPU tensor (needed by the
per-group loop; read back from the device when absent).

Shapes: ``x`` ``(M, K)``, ``weight`` ``(G, N, K)``, ``grad_out`` ``(M, N)``.

* ``forward``: ``out[rows of g] = x[rows of g] @ weight[g]^T (+ bias[g])`` -> ``(M, N)``
* ``dgrad``:   ``grad_x[rows of g] = grad_out[rows of g] @ weight[g]`` -> ``(M, K)``
* ``wgrad``:   ``grad_w[g] = grad_out[rows of g]^T @ x[rows of g]`` -> ``(G, N, K)``

Rows past ``ends[-1]`` belong to no group. ``forward`` and ``dgrad`` leave
them unspecified for the ``grouped`` backend and zero for ``loop``; callers
that may have such rows zero them (see :mod:`grouped_linear.kernels.bias`).
``wgrad`` ignores them, and gives zeros for empty groups.

Backends:
    ``loop``: one ``torch.matmul`` per group; the reference, any dtype.
    ``grouped``: ``torch.nn.functional.grouped_mm``, one call per GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "forward", "dgrad", "wgrad", "loop_bounds"]

BACKENDS = ("loop", "grouped")


def loop_bounds(ends: torch.Tensor, host_ends: torch.Tensor | None) -> list[tuple[int, int]]:
    """``[(start, end)]`` per group, as Python ints (reads device ends back)."""
    host = (host_ends if host_ends is not None else ends).tolist()
    return list(zip([0] + host[:-1], host))


def _grouped_mm_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a row-major copy whose rows start 16 bytes apart where torch's grouped GEMM
    refuses its layout: it takes a 16-byte aligned start and, of the last two strides, one 1
    and the other a multiple of 16 bytes that spans the row (a transposed or sliced input
    may have neither; a contiguous copy neither where its rows are not a multiple of 16
    bytes long, as the ``(K, M)`` transpose of an input of ``M`` rows)."""
    rows, cols = t.stride()[-2:]
    alignment = 16 // t.element_size()
    if t.data_ptr() % 16 == 0 and (
            (cols == 1 and rows % alignment == 0 and rows >= max(1, t.shape[-1]))
            or (rows == 1 and cols % alignment == 0 and cols >= max(1, t.shape[-2]))):
        return t
    width = t.shape[-1]  # (rows of no columns keep a row stride too: 16 bytes)
    padded = t.new_empty(*t.shape[:-1], -(-max(width, 1) // alignment) * alignment)
    return padded[..., :width].copy_(t)


def _loop_forward(x, weight, ends, host_ends, bias):
    bounds = loop_bounds(ends, host_ends)
    out = x.new_empty(x.shape[0], weight.shape[1])
    for g, (start, end) in enumerate(bounds):
        if bias is None:
            torch.matmul(x[start:end], weight[g].t(), out=out[start:end])
        else:  # the bias joins the product before it is rounded, as in F.linear
            torch.addmm(bias[g], x[start:end], weight[g].t(), out=out[start:end])
    out[bounds[-1][1]:].zero_()
    return out


def _loop_dgrad(grad_out, weight, ends, host_ends):
    bounds = loop_bounds(ends, host_ends)
    grad_x = grad_out.new_empty(grad_out.shape[0], weight.shape[2])
    for g, (start, end) in enumerate(bounds):
        torch.matmul(grad_out[start:end], weight[g], out=grad_x[start:end])
    grad_x[bounds[-1][1]:].zero_()
    return grad_x


def _loop_wgrad(grad_out, x, ends, host_ends, num_groups):
    bounds = loop_bounds(ends, host_ends)
    grad_w = x.new_empty(num_groups, grad_out.shape[1], x.shape[1])
    for g, (start, end) in enumerate(bounds):
        if end > start:
            torch.matmul(grad_out[start:end].t(), x[start:end], out=grad_w[g])
        else:
            grad_w[g].zero_()
    return grad_w


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    host_ends: torch.Tensor | None,
    backend: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(M, K) x (G, N, K) -> (M, N)``, each row block times its group's weight; ``bias``
    ``(G, N)`` of ``x``'s dtype (``loop`` only) is added before the one rounding."""
    if weight.shape[0] == 0:  # no groups: every row is past the last group
        return x.new_zeros(x.shape[0], weight.shape[1])
    if backend == "grouped":
        if bias is not None:
            raise ValueError("the grouped backend's GEMM takes no bias; add it afterwards")
        return F.grouped_mm(_grouped_mm_layout(x), _grouped_mm_layout(weight).transpose(-2, -1),
                            offs=ends)
    return _loop_forward(x, weight, ends, host_ends, bias)


def dgrad(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    host_ends: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``(M, N) x (G, N, K) -> (M, K)``: the input gradient."""
    if weight.shape[0] == 0:
        return grad_out.new_zeros(grad_out.shape[0], weight.shape[2])
    if backend == "grouped":
        return F.grouped_mm(_grouped_mm_layout(grad_out), _grouped_mm_layout(weight), offs=ends)
    return _loop_dgrad(grad_out, weight, ends, host_ends)


def wgrad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    host_ends: torch.Tensor | None,
    backend: str,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(M, N)^T x (M, K) -> (G, N, K)`` per group: the weight gradient, in ``out_dtype``
    (default ``x``'s)."""
    num_groups = ends.shape[0]
    if out_dtype is not None and out_dtype != x.dtype:
        # torch's GEMMs store in their operands' dtype: multiply in the wider one (exact for
        # half-precision values, TF32 included: their mantissas fit)
        grad_out, x = grad_out.to(out_dtype), x.to(out_dtype)
    if num_groups == 0:
        return x.new_zeros(0, grad_out.shape[1], x.shape[1])
    if backend == "grouped":
        return F.grouped_mm(_grouped_mm_layout(grad_out.t()), _grouped_mm_layout(x), offs=ends)
    return _loop_wgrad(grad_out, x, ends, host_ends, num_groups)
