"""The autograd function of the high-precision routes (``triton``, ``grouped``, ``loop``).

:class:`GroupedLinearFunction` composes the compute steps of :mod:`.steps` into forward and
backward; while ``torch.compile`` traces, it calls them as ``torch.library`` operators.
:func:`run_linear` records it where a graph is needed and runs the forward step alone
otherwise (inference builds no autograd node).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..kernels.gemm.gluon_gemm import is_input_major
from .fast_path import functorch_involved, records_graph
from .steps import (
    bias_grad_impl,
    bias_grad_op,
    dgrad_impl,
    dgrad_op,
    forward_impl,
    forward_op,
    step,
    triton_backward_impl,
    triton_backward_op,
    triton_wgrad_impl,
    triton_wgrad_op,
    weight_grads_impl,
    weight_grads_op,
)
from .weight_grad import WeightGradSink, route_weight_grads

__all__ = ["CallConfig", "GroupedLinearFunction", "run_linear"]


@dataclass(frozen=True)
class CallConfig:
    """``route``: ``triton``, ``grouped`` or ``loop``; ``zero_tail``: rows past the groups
    may exist (device splits) and get zeros; ``sink``: where the parameters' gradients go
    (``None``: to autograd)."""

    route: str
    zero_tail: bool
    sink: WeightGradSink | None


class GroupedLinearFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group; see :func:`~grouped_linear.ops.grouped_linear`.

    ``sizes`` ``(G,)`` (the ``triton`` route) or ``ends`` ``(G,)`` int32 (the others) on the
    device; ``host_ends`` the ends on the host for the loop over CUDA tensors, else ``None``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, ends, host_ends, config: CallConfig):
        out = step(forward_op, forward_impl)(
            x, weight, bias, sizes, ends, host_ends, config.route, config.zero_tail
        )
        ctx.save_for_backward(x, weight, sizes, ends, host_ends)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, sizes, ends, host_ends = ctx.saved_tensors
        config: CallConfig = ctx.config
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        bias_dtype = ctx.bias_dtype
        need_b = need_b and bias_dtype is not None
        # Gradients of reductions such as y.sum() arrive with zero strides.
        grad_out = grad_out.contiguous()
        triton = config.route == "triton"
        if triton and need_x and (need_w or need_b) and config.sink is None:
            # Small problems: the whole backward in one launch.
            grad_x, grad_w, grad_b = step(triton_backward_op, triton_backward_impl)(
                grad_out, x, weight, sizes, need_b
            )
            return grad_x, *_asked_grads(grad_w, grad_b, need_w, need_b, bias_dtype), None, None, \
                None, None
        grad_x = None
        if need_x:
            grad_x = step(dgrad_op, dgrad_impl)(
                grad_out, weight, sizes, ends, host_ends, config.route, config.zero_tail
            )

        def weight_and_bias_grads(want_w: bool, want_b: bool, weight_dtype):
            weight_dtype = weight_dtype or weight.dtype
            if triton:
                grad_w, grad_b = step(triton_wgrad_op, triton_wgrad_impl)(
                    grad_out, x, sizes, want_b, weight_dtype)
                return _asked_grads(grad_w, grad_b, want_w, want_b, bias_dtype)
            if want_w:  # the bias gradient beside the weight's, from one kernel where it can
                input_major = is_input_major(weight)
                grad_w, grad_b = step(weight_grads_op, weight_grads_impl)(
                    grad_out, x, ends, host_ends, config.route, want_b,
                    bias_dtype if want_b else x.dtype, weight_dtype, input_major)
                if input_major:  # computed as the weight is stored
                    grad_w = grad_w.transpose(1, 2)
                return grad_w, (grad_b if want_b else None)
            return None, step(bias_grad_op, bias_grad_impl)(grad_out, ends, bias_dtype)

        grad_w, grad_b = route_weight_grads(config.sink, need_w, need_b, weight_and_bias_grads,
                                            (x, sizes, ends, host_ends, grad_out))
        return grad_x, grad_w, grad_b, None, None, None, None


def _asked_grads(grad_w, grad_b, need_w: bool, need_b: bool, bias_dtype):
    """The Triton kernels' ``(grad_w, grad_b)``, each only where asked for (the bias sums are
    stored in the input dtype)."""
    if need_b and grad_b.dtype != bias_dtype:
        grad_b = grad_b.to(bias_dtype)
    return (grad_w if need_w else None), (grad_b if need_b else None)


# ``autograd.Function.apply``'s C implementation bound to GroupedLinearFunction: the Python
# ``apply`` in front of it only adds functorch handling (transforms, dead wrappers), which
# :func:`run_linear` checks for itself; a few µs per call on hosts where small steps are
# host-bound.
_apply_without_functorch = torch._C._FunctionBase.__dict__["apply"].__get__(
    None, GroupedLinearFunction)


def run_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               sizes: torch.Tensor | None, ends: torch.Tensor | None,
               host_ends: torch.Tensor | None, config: CallConfig) -> torch.Tensor:
    """``(M, K) x (G, N, K) (+ (G, N)) -> (M, N)``: the autograd function where a graph is
    needed (or traced), else the forward step alone."""
    if torch.compiler.is_compiling() or functorch_involved(x, weight, bias):
        return GroupedLinearFunction.apply(x, weight, bias, sizes, ends, host_ends, config)
    if not records_graph(x, weight, bias):
        return forward_impl(x, weight, bias, sizes, ends, host_ends, config.route,
                            config.zero_tail)
    return _apply_without_functorch(x, weight, bias, sizes, ends, host_ends, config)
