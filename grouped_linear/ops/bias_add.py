"""Differentiable per-group bias add, for outputs produced without one (row-parallel
layers add their bias after the all-reduce)."""

from __future__ import annotations

import torch

from ..kernels import bias as bias_kernels
from .splits import GroupSplits

__all__ = ["add_group_bias"]


class _GroupBiasAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, offsets, zero_tail):
        ctx.save_for_backward(offsets)
        ctx.bias_dtype = bias.dtype
        return bias_kernels.bias_epilogue_(y.clone(), bias, offsets, zero_tail)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = bias_kernels.bias_grad(grad.contiguous(), offsets, ctx.bias_dtype)
        return grad, grad_bias, None, None


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, splits: GroupSplits) -> torch.Tensor:
    """``y`` ``(M, N)`` plus ``bias[g]`` ``(G, N)`` on the rows of group ``g``; rows in no
    group (device splits summing below ``M``) become zero."""
    return _GroupBiasAdd.apply(y, bias, splits.offsets, splits.may_have_tail)
