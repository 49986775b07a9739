"""Rows already in ``Float8Rowwise``'s FP8 form, handed from :func:`~grouped_linear.permute`
to the GEMM that reads them.

A rowwise recipe scales each row by its own amax, so a token's routed copies share its codes
and factor: ``permute(..., recipe=Float8Rowwise())`` quantizes each token once and copies its
codes into its slots' rows (one byte per element instead of two), and the ``fp8_scaled_mm``
route of a layer of the same recipe reads them as they are, instead of reading bf16 rows to
quantize them. :class:`Float8Rows` is that result as a tensor: its shape, dtype and device
are the rows' own, any other operation sees the dequantized values (a route that cannot
read the codes, another recipe, plain compute: :func:`plain_rows`; a view op gives a
dequantized copy), and an operation that would write into it is a ``TypeError``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_map_only

from ...recipes import Float8Recipe, Float8Rowwise

__all__ = ["Float8Rows", "plain_rows", "rows_recipe", "scale_rows"]

_aten = torch.ops.aten


def rows_recipe(recipe: Float8Recipe | None, x: torch.Tensor) -> Float8Rowwise | None:
    """``recipe`` where rows of ``x`` can travel as its codes (a rowwise recipe, a 2-D half or
    float32 input, not while ``torch.compile`` traces), else ``None``."""
    if (isinstance(recipe, Float8Rowwise) and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch.compiler.is_compiling()):
        return recipe
    return None


def _values(codes: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``(N, H)`` codes times their ``(N,)`` row factors, in float32."""
    return codes.float() * inv[:, None]


class Float8Rows(torch.Tensor):
    """``(N, H)`` rows as E4M3/E5M2 ``codes`` ``(N, H)`` and float32 ``inv`` ``(N,)`` factors
    of ``recipe`` (module doc); the tensor's dtype is the rows' high-precision one."""

    codes: torch.Tensor
    inv: torch.Tensor
    recipe: Float8Rowwise

    @staticmethod
    def __new__(cls, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Rowwise,
                dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype,
                                                   device=codes.device)

    def __init__(self, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Rowwise,
                 dtype: torch.dtype) -> None:
        self.codes, self.inv, self.recipe = codes, inv, recipe

    def fits(self, recipe: Float8Recipe | None) -> bool:
        """Whether a layer of ``recipe`` reads these codes as its forward operand."""
        return (isinstance(recipe, Float8Rowwise)
                and recipe.forward_dtype == self.recipe.forward_dtype
                and recipe.power_of_two_scales == self.recipe.power_of_two_scales)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows' values, ``codes * inv[:, None]``, in ``dtype`` (default: the tensor's)."""
        return _values(self.codes, self.inv).to(dtype or self.dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8Rows(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"recipe={self.recipe!r}, device={self.device})")

    def __tensor_flatten__(self):
        return ["codes", "inv"], (self.recipe, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, dtype = meta
        return Float8Rows(inner["codes"], inner["inv"], recipe, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            t = args[0]
            return Float8Rows(t.codes, t.inv, t.recipe, t.dtype)
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if (argument.alias_info is not None and argument.alias_info.is_write
                    and isinstance(value, cls)):
                raise TypeError(f"{func.overloadpacket.__name__} writes into Float8Rows, which "
                                "are read-only FP8 codes: write into .dequantize() instead")
        # anything else on the dequantized values (a view op gives a copy)
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows):  # type: ignore[override]
        return rows.dequantize()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


class _ScaleRows(torch.autograd.Function):
    """``probs[:, None] * rows`` as FP8 rows: the codes stay, each row's factor is scaled."""

    @staticmethod
    def forward(ctx, rows, probs):  # type: ignore[override]
        # the codes and factors for the probabilities' gradient (what the rows stand for)
        ctx.save_for_backward(probs, *((rows.codes, rows.inv) if ctx.needs_input_grad[1]
                                       else ()))
        ctx.dtype = rows.dtype
        return Float8Rows(rows.codes, rows.inv * probs.float(), rows.recipe, rows.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        probs, *codes_inv = ctx.saved_tensors
        grad = grad.float()
        grad_rows = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_rows = (grad * probs.float()[:, None]).to(ctx.dtype)
        if ctx.needs_input_grad[1]:
            grad_probs = (grad * _values(*codes_inv)).sum(1).to(probs.dtype)
        return grad_rows, grad_probs


def scale_rows(rows: Float8Rows, probs: torch.Tensor) -> Float8Rows:
    """``probs[:, None] * rows`` (``probs`` ``(N,)``) as FP8 rows of the same codes, each
    factor times its row's probability: exact, where scaling the values and quantizing them
    again would round twice. Differentiable in both."""
    return _ScaleRows.apply(rows, probs)


def plain_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a plain tensor: :class:`Float8Rows` dequantized (differentiably), anything
    else as it is."""
    return _Dequantize.apply(x) if isinstance(x, Float8Rows) else x
