"""The compute steps of :func:`~grouped_linear.ops.grouped_linear.grouped_linear`.

Each step is a plain function, registered as a ``torch.library`` operator
(``grouped_linear::forward``, ``::dgrad``, ``::weight_grads``, ``::triton_wgrad``,
``::triton_backward``, ``::bias_grad``) for ``torch.compile`` to trace; eager calls go
straight to the function (:func:`step`). The ``triton`` backend reads the ``(G,)`` group
``sizes`` (its kernels clamp them, zero the tail and fuse the bias themselves); the
``loop`` and ``grouped`` backends read the cumulative group ``ends`` (``host_ends``: the
same on the host, for the loop over CUDA tensors with host splits). On Hopper the ``grouped``
backend's forward and dgrad run :mod:`grouped_linear.kernels.gemm.gluon_gemm` where it takes
the operands (bias in the epilogue, tail zeroed), and its weight gradient
:mod:`grouped_linear.kernels.gemm.gluon_wgrad` (the bias gradient summed from the same tiles);
torch's grouped GEMM and the bias reduction kernel elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels import bias as bias_kernels
from ..kernels.ends import group_sizes
from ..kernels.gemm import gluon_gemm, gluon_wgrad, torch_gemm, triton_gemm

__all__ = [
    "forward_impl", "forward_op", "dgrad_impl", "dgrad_op", "weight_grads_impl", "weight_grads_op",
    "triton_wgrad_impl", "triton_wgrad_op", "triton_backward_impl", "triton_backward_op",
    "bias_grad_impl", "bias_grad_op", "step", "compute_op", "register_fake",
]

# Registered through ``torch.library.Library`` rather than ``custom_op``: a compiled step then
# reaches the function through the dispatcher directly, without custom_op's Python autograd
# and device-dispatch layers (host time a small compiled step pays per operator call). The
# autograd functions call these operators only while compiling, inside their own forward and
# backward, so the operators need no autograd kernel of their own.
_LIBRARY = torch.library.Library("grouped_linear", "DEF")
_HALF = (torch.bfloat16, torch.float16)


def compute_op(name: str, impl: Callable) -> Callable:
    """Define ``grouped_linear::<name>`` with ``impl`` as its kernel on every device;
    returns the operator (``torch.ops.grouped_linear.<name>.default``)."""
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    return getattr(torch.ops.grouped_linear, name).default


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the shape-only implementation of ``grouped_linear::<name>``."""

    def decorator(fake: Callable) -> Callable:
        torch.library.register_fake(f"grouped_linear::{name}", fake, lib=_LIBRARY)
        return fake

    return decorator



def forward_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sizes: torch.Tensor | None,
    ends: torch.Tensor | None,
    host_ends: torch.Tensor | None,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    """``(M, K) x (G, N, K) (+ (G, N)) -> (M, N)``; ``triton`` reads ``sizes``, the others
    ``ends``. A half-precision output is rounded once, after the bias is added."""
    if backend == "triton":
        return triton_gemm.forward(x, weight, bias, sizes)
    if backend == "grouped" and gluon_gemm.supported(x, weight):  # bias in the epilogue
        return gluon_gemm.grouped_mm(x, weight, ends, bias)
    if bias is None or x.dtype not in _HALF:
        out = torch_gemm.forward(x, weight, ends, host_ends, backend)
        return bias_kernels.bias_epilogue_(out, bias, ends, zero_tail)
    if backend == "loop" or not x.is_cuda:
        # torch.addmm per group (tail rows zero); on CPU for the grouped route too, whose
        # GEMM stores only the input dtype (its backward has no bias to add)
        return torch_gemm.forward(x, weight, ends, host_ends, "loop", bias.to(x.dtype))
    if triton_gemm.fits(weight.shape[0], weight.shape[2], weight.shape[1]):
        # torch's grouped GEMM stores only the input dtype: the Triton GEMM adds the bias
        return triton_gemm.forward(x, weight, bias, group_sizes(ends))
    out = torch_gemm.forward(x.float(), weight.float(), ends, host_ends, backend)
    return bias_kernels.bias_epilogue_(out, bias, ends, zero_tail).to(x.dtype)


def dgrad_impl(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    sizes: torch.Tensor | None,
    ends: torch.Tensor | None,
    host_ends: torch.Tensor | None,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    """``(M, N) x (G, N, K) -> (M, K)``, the input gradient."""
    if backend == "triton":
        return triton_gemm.dgrad(grad_out, weight, sizes)
    if backend == "grouped" and gluon_gemm.supported(grad_out, weight, transposed_weight=True):
        return gluon_gemm.grouped_mm(grad_out, weight, ends, transposed_weight=True)
    grad_x = torch_gemm.dgrad(grad_out, weight, ends, host_ends, backend)
    return bias_kernels.zero_tail_(grad_x, ends) if zero_tail else grad_x


def weight_grads_impl(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    host_ends: torch.Tensor | None,
    backend: str,
    with_bias: bool,
    bias_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    input_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, N, K)`` weight gradient in ``weight_dtype`` (``x``'s, or float32 for an fp32
    ``main_grad``) and, with ``with_bias``, the ``(G, N)`` bias gradient in ``bias_dtype``
    (else an empty tensor): from one kernel where the Gluon weight gradient takes the
    operands, else torch's GEMM and the bias reduction pass. With ``input_major`` (a
    weight stored ``(G, K, N)``) the weight gradient comes in that layout, ``x^T @ dy`` per
    group, so that it lands in the parameter without a copy."""
    if input_major:
        grad_wt, _ = weight_grads_impl(x, grad_out, ends, host_ends, backend, False, x.dtype,
                                       weight_dtype)
        grad_b = bias_kernels.bias_grad(grad_out, ends, bias_dtype) if with_bias else None
        return grad_wt, (grad_b if grad_b is not None else grad_wt.new_empty(0))
    if (backend == "grouped" and bias_dtype in gluon_wgrad.BIAS_DTYPES
            and weight_dtype in (x.dtype, torch.float32)
            and gluon_wgrad.supported(grad_out, x, ends.shape[0])):
        grad_w, grad_b = gluon_wgrad.wgrad(grad_out, x, ends, with_bias, bias_dtype=bias_dtype,
                                           out_dtype=weight_dtype)
    else:
        grad_w = torch_gemm.wgrad(grad_out, x, ends, host_ends, backend, weight_dtype)
        grad_b = bias_kernels.bias_grad(grad_out, ends, bias_dtype) if with_bias else None
    return grad_w, (grad_b if grad_b is not None else grad_w.new_empty(0))


def triton_wgrad_impl(
    grad_out: torch.Tensor, x: torch.Tensor, sizes: torch.Tensor, with_bias: bool,
    weight_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``triton`` backend's weight gradient in ``weight_dtype`` and bias gradient (the
    sums in the input dtype, an empty tensor without bias)."""
    grad_w, grad_b = triton_gemm.wgrad(grad_out, x, sizes, with_bias, weight_dtype)
    return grad_w, (grad_b if grad_b is not None else grad_w.new_empty(0))


def triton_backward_impl(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor,
    with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``triton`` backend's whole backward in one launch."""
    grad_x, grad_w, grad_b = triton_gemm.backward(grad_out, x, weight, sizes, with_bias)
    return grad_x, grad_w, (grad_b if grad_b is not None else grad_w.new_empty(0))


def bias_grad_impl(grad_out: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(M, N) -> (G, N)``: the per-group column sums of ``grad_out`` in ``dtype``."""
    return bias_kernels.bias_grad(grad_out, ends, dtype)


forward_op = compute_op("forward", forward_impl)
dgrad_op = compute_op("dgrad", dgrad_impl)
weight_grads_op = compute_op("weight_grads", weight_grads_impl)
bias_grad_op = compute_op("bias_grad", bias_grad_impl)
triton_wgrad_op = compute_op("triton_wgrad", triton_wgrad_impl)
triton_backward_op = compute_op("triton_backward", triton_backward_impl)


@register_fake("forward")
def _(x, weight, bias, sizes, ends, host_ends, backend, zero_tail):
    return x.new_empty(x.shape[0], weight.shape[1])


@register_fake("dgrad")
def _(grad_out, weight, sizes, ends, host_ends, backend, zero_tail):
    return grad_out.new_empty(grad_out.shape[0], weight.shape[2])


@register_fake("weight_grads")
def _(grad_out, x, ends, host_ends, backend, with_bias, bias_dtype, weight_dtype,
      input_major=False):
    shape = (grad_out.shape[1], x.shape[1])
    grad_w = x.new_empty(ends.shape[0], *(shape[::-1] if input_major else shape),
                         dtype=weight_dtype)
    grad_b = x.new_empty((ends.shape[0], grad_out.shape[1]) if with_bias else (0,),
                         dtype=bias_dtype)
    return grad_w, grad_b


@register_fake("triton_wgrad")
def _triton_wgrad_fake(grad_out, x, sizes, with_bias, weight_dtype=None):
    grad_w = x.new_empty(sizes.shape[0], grad_out.shape[1], x.shape[1],
                         dtype=weight_dtype or x.dtype)
    grad_b = x.new_empty((sizes.shape[0], grad_out.shape[1]) if with_bias else (0,))
    return grad_w, grad_b


@register_fake("triton_backward")
def _(grad_out, x, weight, sizes, with_bias):
    return (grad_out.new_empty(grad_out.shape[0], x.shape[1]), *_triton_wgrad_fake(
        grad_out, x, sizes, with_bias))


@register_fake("bias_grad")
def _(grad_out, ends, dtype):
    return grad_out.new_empty(ends.shape[0], grad_out.shape[1], dtype=dtype)


def step(op, impl):
    """The operator while torch.compile traces, the plain function in eager mode."""
    return op if torch.compiler.is_compiling() else impl
