"""Differentiable per-group bias add, for outputs produced without one (row-parallel
layers add their bias after the all-reduce)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..kernels import bias as bias_kernels
from .splits import GroupSplits
from .weight_grad import WeightGradSink, route_weight_grads

__all__ = ["add_group_bias"]


class _GroupBiasAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, ends, zero_tail, sink):
        ctx.save_for_backward(ends)
        ctx.bias_dtype = bias.dtype
        ctx.sink = sink
        return bias_kernels.bias_epilogue_(y.clone(), bias, ends, zero_tail)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (ends,) = ctx.saved_tensors
        grad = grad.contiguous()
        bias_dtype = ctx.bias_dtype

        def bias_grad(want_w: bool, want_b: bool, weight_dtype):
            return None, bias_kernels.bias_grad(grad, ends, bias_dtype)

        _, grad_bias = route_weight_grads(ctx.sink, False, ctx.needs_input_grad[1], bias_grad,
                                          (grad, ends))
        return grad, grad_bias, None, None, None


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, splits: GroupSplits,
                   sink: WeightGradSink | None = None) -> torch.Tensor:
    """``y`` ``(M, N)`` plus ``bias[g]`` ``(G, N)`` on the rows of group ``g``; rows in no
    group (device splits summing below ``M``) become zero. With a delaying ``sink`` the
    bias gradient waits for ``backward_dw`` like the weight's."""
    return _GroupBiasAdd.apply(y, bias, splits.ends, splits.may_have_tail, sink)
