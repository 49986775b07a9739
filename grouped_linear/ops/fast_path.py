"""The eager fast path of the ``triton`` route: one launch forward, one launch backward.

A small MoE step (a few hundred rows per expert) is host-bound: its GEMMs take a few µs
of GPU time each, and the Python around them sets the pace. This autograd function is
:class:`~grouped_linear.ops.linear_function.GroupedLinearFunction` cut down to what a
cached verdict (:func:`~grouped_linear.ops.dispatch.cached_verdict`) has already established
(a plain CUDA tensor input, device splits, parameters of the input's dtype, no gradient
routing, nothing tracing): it launches the Triton kernels through the caller's
:class:`~grouped_linear.kernels.gemm.triton_gemm.LinearLaunches` for the call's geometry (launch
plans found once, so no plan key per call, and no Triton argument binding), saves three
tensors and that object, and builds no configuration object.
``torch.compile``, functorch transforms and every other case go through
``GroupedLinearFunction`` and its ``torch.library`` operators instead.
"""

from __future__ import annotations

import torch
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

from ..kernels.gemm import triton_gemm

__all__ = ["TritonGroupedLinearFunction", "apply_triton_linear", "records_graph",
           "functorch_involved"]


class TritonGroupedLinearFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the split sizes on the device.

    Forward: ``x`` ``(M, K)``, ``weight`` ``(G, N, K)``, ``bias`` ``(G, N)`` or ``None``,
    ``sizes`` ``(G,)`` -> ``(M, N)``, rows past the groups zero. Backward: the input,
    weight and bias gradients from one launch when the input's and a parameter's are both
    needed (a training step), else from the separate dgrad and wgrad kernels.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, launches):
        ctx.save_for_backward(x, weight, sizes)
        ctx.launches = launches
        return launches.forward(x, weight, bias, sizes)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, sizes = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Gradients of reductions such as y.sum() arrive with zero strides.
        grad_out = grad_out.contiguous()
        if need_x and (need_w or need_b):
            grad_x, grad_w, grad_b = ctx.launches.backward(grad_out, x, weight, sizes, need_b)
        else:
            grad_x = triton_gemm.dgrad(grad_out, weight, sizes) if need_x else None
            grad_w = grad_b = None
            if need_w or need_b:
                grad_w, grad_b = triton_gemm.wgrad(grad_out, x, sizes, need_b)
        return grad_x, (grad_w if need_w else None), grad_b, None, None


def records_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a grouped linear call on these tensors must go through an autograd function:
    it records a node, or a forward-mode AD level is open (the function then refuses dual
    inputs, which the kernels alone would take without their tangents)."""
    return (torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )) or forward_ad._current_level >= 0


def functorch_involved(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a functorch transform is active or an argument is one's (possibly dead)
    wrapper: then only an autograd function's Python ``apply`` may record the call."""
    return (torch._C._are_functorch_transforms_active() or is_functorch_wrapped_tensor(x)
            or is_functorch_wrapped_tensor(weight)
            or (bias is not None and is_functorch_wrapped_tensor(bias)))


# ``autograd.Function.apply``'s C implementation: the Python ``apply`` in front of it only
# adds functorch handling, and callers of this path have checked that none is active.
_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, TritonGroupedLinearFunction)


def apply_triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        sizes: torch.Tensor,
                        launches: triton_gemm.LinearLaunches | None = None) -> torch.Tensor:
    """``(M, K) x (G, N, K) (+ (G, N)) -> (M, N)`` through :class:`TritonGroupedLinearFunction`
    where a graph is recorded, else the forward kernel alone (no autograd node).

    ``launches``: the caller's object for this call's geometry (shapes, strides, dtypes and
    device of all four tensors), reused across its calls; ``None`` for a one-off call.
    """
    if launches is None:
        launches = triton_gemm.LinearLaunches()
    if records_graph(x, weight, bias):
        return _apply(x, weight, bias, sizes, launches)
    return launches.forward(x, weight, bias, sizes)
