"""The expert MLP's activation with fc1's per-group bias folded in.

``a = act(h + b[g])`` for non-gated activations and
``a = act(h[:, :F] + b[g, :F]) * (h[:, F:] + b[g, F:])`` for gated ones (gate
half first), where ``g`` is the row's group. Rows past ``ends[-1]`` give
zero. One read of ``h`` and one write of ``a`` forward; backward recomputes
from ``h`` (nothing else saved) in one read of ``h`` and ``grad_a`` and one
write of ``grad_h``. A Triton kernel each way, the PyTorch reference beside it.
"""

import torch
import torch.nn.functional as F

from ._groups import row_group, row_groups
from ._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton

__all__ = ["ACTIVATION_KINDS", "GATED_KINDS", "bias_act_forward", "bias_act_backward",
           "bias_act_reference", "bias_act_backward_reference"]

ACTIVATION_KINDS = {"swiglu": 0, "geglu": 1, "silu": 0, "gelu": 1, "relu": 2}
GATED_KINDS = ("swiglu", "geglu")

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


# --------------------------------------------------------------------------- reference
def _base_activation(kind: str, value: torch.Tensor) -> torch.Tensor:
    if kind in ("swiglu", "silu"):
        return F.silu(value)
    if kind in ("geglu", "gelu"):
        return F.gelu(value, approximate="tanh")
    return F.relu(value)


def bias_act_reference(h, bias, ends, kind, zero_tail):
    """Differentiable plain-PyTorch form (float32 math, float64 for float64; output in ``h.dtype``)."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    value = h.to(compute)
    groups = row_groups(ends, h.shape[0])
    in_group = (groups < ends.shape[0]).unsqueeze(1)
    if bias is not None:
        padded = torch.cat([bias.to(compute), bias.new_zeros(1, bias.shape[1], dtype=compute)])
        value = value + padded.index_select(0, groups)
    if kind in GATED_KINDS:
        gate, up = value.chunk(2, dim=-1)
        out = _base_activation(kind, gate) * up
    else:
        out = _base_activation(kind, value)
    if zero_tail:
        out = torch.where(in_group, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(h.dtype)


def _base_activation_grad(kind: str, value: torch.Tensor) -> torch.Tensor:
    if kind in ("swiglu", "silu"):
        s = torch.sigmoid(value)
        return s + value * s * (1 - s)
    if kind in ("geglu", "gelu"):
        inner = _SQRT_2_OVER_PI * (value + _GELU_CUBIC * value ** 3)
        t = torch.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * value ** 2)
        return 0.5 * (1 + t) + 0.5 * value * (1 - t * t) * d_inner
    return (value > 0).to(value.dtype)


def bias_act_backward_reference(grad_a, h, bias, ends, kind):
    """The gradient with respect to ``h``, written out (no autograd: it also runs inside
    custom ops, where autograd does not record). Rows past the last group get zero."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    groups = row_groups(ends, h.shape[0])
    in_group = (groups < ends.shape[0]).unsqueeze(1)
    value = h.to(compute)
    if bias is not None:
        padded = torch.cat([bias.to(compute), bias.new_zeros(1, bias.shape[1], dtype=compute)])
        value = value + padded.index_select(0, groups)
    grad_a = torch.where(in_group, grad_a.to(compute), torch.zeros((), dtype=compute))
    if kind in GATED_KINDS:
        gate, up = value.chunk(2, dim=-1)
        grad_h = torch.cat([grad_a * up * _base_activation_grad(kind, gate),
                            grad_a * _base_activation(kind, gate)], dim=-1)
    else:
        grad_h = grad_a * _base_activation_grad(kind, value)
    return grad_h.to(h.dtype)


# --------------------------------------------------------------------------- Triton
@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * inner)  # 0.5 * x * (1 + tanh(inner))
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(x)
        return s + x * s * (1.0 - s)
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    else:
        return (x > 0.0).to(tl.float32)


@triton.jit
def _load_input(h_ptr, bias_ptr, rows, cols, groups, in_group, mask, stride_h, stride_bias,
                HAS_BIAS: tl.constexpr):
    value = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
    if HAS_BIAS:
        value += tl.load(bias_ptr + groups.to(tl.int64)[:, None] * stride_bias + cols[None, :],
                         mask=mask & in_group[:, None], other=0.0).to(tl.float32)
    return value


@kernel
@triton.jit
def _bias_act_kernel(h_ptr, bias_ptr, ends_ptr, grad_a_ptr, out_ptr, M, F, G,
                     stride_h, stride_bias, stride_grad_a, stride_out,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                     BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    groups = row_group(ends_ptr, rows, G, BLOCK_G)
    in_group = groups < G
    keep = in_group[:, None]
    gate = _load_input(h_ptr, bias_ptr, rows, cols, groups, in_group, mask, stride_h, stride_bias,
                       HAS_BIAS)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    if not BACKWARD:
        result = _act(gate, ACT)
        if GATED:
            result *= _load_input(h_ptr, bias_ptr, rows, cols + F, groups, in_group, mask,
                                  stride_h, stride_bias, HAS_BIAS)
        tl.store(out_rows, tl.where(keep, result, 0.0).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        grad_a = tl.load(grad_a_ptr + rows.to(tl.int64)[:, None] * stride_grad_a + cols[None, :],
                         mask=mask, other=0.0).to(tl.float32)
        grad_a = tl.where(keep, grad_a, 0.0)
        grad_gate = grad_a * _act_grad(gate, ACT)
        if GATED:
            up = _load_input(h_ptr, bias_ptr, rows, cols + F, groups, in_group, mask, stride_h,
                             stride_bias, HAS_BIAS)
            tl.store(out_rows + F, (grad_a * _act(gate, ACT)).to(out_ptr.dtype.element_ty),
                     mask=mask)
            grad_gate *= up
        tl.store(out_rows, grad_gate.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(h, bias, ends, kind, grad_a, out, width):
    M = h.shape[0]
    G = ends.shape[0]
    block_m, block_n = 32, 64
    grid = (cdiv(M, block_m), cdiv(width, block_n))
    _bias_act_kernel[grid](
        h, bias if bias is not None else h, ends, grad_a if grad_a is not None else h, out,
        M, width, G, h.stride(0), bias.stride(0) if bias is not None else 0,
        grad_a.stride(0) if grad_a is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, GATED=kind in GATED_KINDS, ACT=ACTIVATION_KINDS[kind],
        BACKWARD=grad_a is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_G=min(64, next_power_of_2(G)),
    )
    return out


def _triton_ok(*tensors) -> bool:
    return use_triton(tensors[0]) and all(
        t is None or (t.dtype != torch.float64 and t.stride(-1) == 1) for t in tensors)


# --------------------------------------------------------------------------- public
def bias_act_forward(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor,
                     kind: str, zero_tail: bool) -> torch.Tensor:
    """``(M, W)`` fc1 output (``W = 2F`` gated, else ``F``) -> ``(M, F)`` activation.

    ``bias`` is ``(G, W)`` or ``None``; rows past ``ends[-1]`` give zero
    (always in the Triton kernel; with ``zero_tail`` in the reference).
    """
    width = h.shape[1] // 2 if kind in GATED_KINDS else h.shape[1]
    if h.shape[0] == 0 or not _triton_ok(h, bias):
        with torch.no_grad():
            return bias_act_reference(h, bias, ends, kind, zero_tail)
    out = torch.empty(h.shape[0], width, device=h.device, dtype=h.dtype)
    return _launch(h, bias, ends, kind, None, out, width)


def bias_act_backward(grad_a: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
                      ends: torch.Tensor, kind: str, zero_tail: bool) -> torch.Tensor:
    """``(M, F)`` gradient of the activation -> ``(M, W)`` gradient of fc1's output.

    Recomputes from ``h`` (and ``bias``); rows past ``ends[-1]`` get zero.
    """
    width = h.shape[1] // 2 if kind in GATED_KINDS else h.shape[1]
    if h.shape[0] == 0 or not _triton_ok(h, bias, grad_a):
        return bias_act_backward_reference(grad_a, h, bias, ends, kind)
    out = torch.empty_like(h)
    return _launch(h, bias, ends, kind, grad_a, out, width)
