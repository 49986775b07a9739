"""Differentiable ``act(h + bias[g])``: the expert MLP's activation with fc1's bias folded in."""

from __future__ import annotations

import torch

from ..kernels import activation as act_kernels
from .steps import bias_grad_impl, bias_grad_op, compute_op, register_fake, step

__all__ = ["bias_activation"]


def _forward_impl(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor, kind: str,
                  zero_tail: bool) -> torch.Tensor:
    return act_kernels.bias_act_forward(h, bias, ends, kind, zero_tail)


def _backward_impl(grad_a: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
                   ends: torch.Tensor, kind: str, zero_tail: bool) -> torch.Tensor:
    return act_kernels.bias_act_backward(grad_a, h, bias, ends, kind, zero_tail)


_forward_op = compute_op("bias_act", _forward_impl)
_backward_op = compute_op("bias_act_backward", _backward_impl)


@register_fake("bias_act")
def _(h, bias, ends, kind, zero_tail):
    width = h.shape[1] // 2 if kind in act_kernels.GATED_KINDS else h.shape[1]
    return h.new_empty(h.shape[0], width)


@register_fake("bias_act_backward")
def _(grad_a, h, bias, ends, kind, zero_tail):
    return torch.empty_like(h)


class BiasActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, ends, kind, zero_tail):
        ctx.save_for_backward(h, bias, ends)
        ctx.kind, ctx.zero_tail = kind, zero_tail
        return step(_forward_op, _forward_impl)(h, bias, ends, kind, zero_tail)

    @staticmethod
    def backward(ctx, grad_a):
        h, bias, ends = ctx.saved_tensors
        grad_h = step(_backward_op, _backward_impl)(
            grad_a.contiguous(), h, bias, ends, ctx.kind, ctx.zero_tail
        )
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            grad_bias = step(bias_grad_op, bias_grad_impl)(grad_h, ends, bias.dtype)
        return grad_h, grad_bias, None, None, None


def bias_activation(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor, kind: str,
                    zero_tail: bool) -> torch.Tensor:
    """``(M, W) -> (M, F)``: ``act(h + bias[g])`` per row group (gate half first if gated).

    ``bias``: ``(G, W)`` or ``None``; ``ends``: ``(G,)`` int32 cumulative group
    ends on ``h``'s device; ``kind``: ``swiglu``, ``geglu``, ``gelu``, ``relu``, ``silu``.
    """
    if kind not in act_kernels.ACTIVATION_KINDS:
        raise ValueError(f"activation={kind!r} is not one of {tuple(act_kernels.ACTIVATION_KINDS)}")
    return BiasActivationFunction.apply(h, bias, ends, kind, zero_tail)
