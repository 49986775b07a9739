"""FP8 grouped linear, as quantize -> dequantize emulation (every device).

Each GEMM multiplies exactly the values an FP8 GEMM with the recipe's scales
would (see :mod:`grouped_linear.kernels.quantize`), accumulating in float32:

* forward: ``x`` per token (rowwise) or per group (tensorwise), ``W`` per output
  channel or per group, E4M3;
* dgrad: ``dy`` per token or per group in the gradient format, ``W`` per input
  channel or per group;
* wgrad: ``dy`` and ``x`` per (group, column) along the group's tokens, or per group.

The bias is added, and its gradient summed, in high precision. This path runs
the numerics of the recipes on CPU (and anywhere else); it reads split offsets
back to the host, so it is not the fast or sync-free path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import bias as bias_kernels
from ..kernels import grouped_gemm
from ..kernels import quantize as q
from ..recipes import Float8Blockwise, Float8Recipe, Float8Rowwise
from .weight_grad import WeightGradSink, route_weight_grads

__all__ = ["Fp8GroupedLinearFunction", "quantize_weight_for_forward", "Fp8Config"]


@dataclass(frozen=True)
class Fp8Config:
    recipe: Float8Recipe
    zero_tail: bool
    sink: WeightGradSink | None


def _quantize_weight(weight: torch.Tensor, recipe: Float8Recipe, dgrad: bool) -> torch.Tensor:
    """``(G, N, K)`` weights as a GEMM sees them: per output channel (forward) or input
    channel (dgrad) for rowwise, 128x128 blocks for blockwise, per group for tensorwise."""
    pow2 = recipe.power_of_two_scales
    if isinstance(recipe, Float8Blockwise):
        return q.fake_quant_weight_blocks(weight, recipe.forward_dtype, pow2)
    dim = (1 if dgrad else 2) if isinstance(recipe, Float8Rowwise) else None
    return q.fake_quant_weight(weight, dim, recipe.forward_dtype, pow2)


def quantize_weight_for_forward(weight: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
    """The forward GEMM's view of ``(G, N, K)`` weights: float32 dequantized FP8."""
    return _quantize_weight(weight.detach(), recipe, dgrad=False)


def _quantize_tokens(t, offsets, fp8_dtype, recipe):
    """The token-side operand of forward (``x``) and dgrad (``dy``)."""
    if isinstance(recipe, Float8Rowwise):
        return q.fake_quant_rows(t, fp8_dtype, recipe.power_of_two_scales)
    if isinstance(recipe, Float8Blockwise):
        return q.fake_quant_column_tiles(t, fp8_dtype, recipe.power_of_two_scales)
    return q.fake_quant_groups(t, offsets, fp8_dtype, recipe.power_of_two_scales)


def _quantize_for_wgrad(t, offsets, fp8_dtype, recipe):
    """The wgrad operands, scaled along the tokens of each group."""
    if isinstance(recipe, Float8Rowwise):
        return q.fake_quant_group_columns(t, offsets, fp8_dtype, recipe.power_of_two_scales)
    if isinstance(recipe, Float8Blockwise):
        return q.fake_quant_row_tiles(t, offsets, fp8_dtype, recipe.power_of_two_scales)
    return q.fake_quant_groups(t, offsets, fp8_dtype, recipe.power_of_two_scales)


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the three GEMMs in (emulated) FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, config: Fp8Config, cached_weight):
        recipe = config.recipe
        x_q = _quantize_tokens(x, offsets, recipe.forward_dtype, recipe)
        w_q = cached_weight if cached_weight is not None else \
            quantize_weight_for_forward(weight, recipe)
        out = grouped_gemm.forward(x_q, w_q, offsets, None, "loop")
        out = bias_kernels.bias_epilogue_(out, bias.float() if bias is not None else None, offsets,
                                          config.zero_tail)
        ctx.save_for_backward(x, weight, offsets)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        config: Fp8Config = ctx.config
        recipe = config.recipe
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            dy_q = _quantize_tokens(grad_out, offsets, recipe.gradient_dtype, recipe)
            w_q = _quantize_weight(weight, recipe, dgrad=True)
            grad_x = grouped_gemm.dgrad(dy_q, w_q, offsets, None, "loop").to(x.dtype)
        need_w = ctx.needs_input_grad[1]
        need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        bias_dtype = ctx.bias_dtype

        def weight_and_bias_grads():
            grad_w = grad_b = None
            if need_w:
                dy_q = _quantize_for_wgrad(grad_out, offsets, recipe.gradient_dtype, recipe)
                x_q = _quantize_for_wgrad(x, offsets, recipe.forward_dtype, recipe)
                grad_w = grouped_gemm.wgrad(dy_q, x_q, offsets, None, "loop").to(weight.dtype)
            if need_b:
                grad_b = bias_kernels.bias_grad(grad_out, offsets, bias_dtype)
            return grad_w, grad_b

        grad_w, grad_b = route_weight_grads(config.sink, need_w or need_b, weight_and_bias_grads)
        return grad_x, grad_w, grad_b, None, None, None
