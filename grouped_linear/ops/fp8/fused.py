"""The ``fp8_fused`` route: the FP8 recipes on small problems, one launch per GEMM
(:mod:`grouped_linear.kernels.gemm.fp8_fused_gemm`).

Each GEMM quantizes its high-precision operand as it reads it, to the recipe's values: the
forward ``x`` (per row or group: and writes its row scales), the dgrad ``dy``, the weight
gradient ``dy`` and ``x`` again (from the forward's scales: the same codes). Tensorwise
finds its group scales first (one launch each way). The weight is
read as its forward FP8 codes and factors, by both the forward and the dgrad (quantized once
per step by the module's cache, or stored so). Backward keeps ``x`` as it is. A step is
three launches (tensorwise five) where the other routes' quantization passes make 18 (25):
small problems are bound by host time, and this route is what makes FP8 cost what bf16
costs there (:func:`grouped_linear.ops.dispatch.fp8_route` says where it runs).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...kernels.gemm import fp8_fused_gemm
from ...recipes import Float8Blockwise
from .weight import Fp8Config, Fp8Weight, token_group_scales, weight_and_bias_grads

__all__ = ["Fp8FusedFunction"]


class Fp8FusedFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group, the three GEMMs in FP8 with fused quantization;
    ``sizes`` ``(G,)`` and ``ends`` on ``x``'s device; rows past the groups get zeros."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, ends, config: Fp8Config, cached: Fp8Weight | None,
                weight_grad_ahead: bool = True):
        """``weight_grad_ahead``: a backward may want the weight's gradient (grad mode on and
        the weight requiring it); without it nothing of ``x`` is kept."""
        recipe = config.recipe
        blockwise = isinstance(recipe, Float8Blockwise)
        w = cached if cached is not None else Fp8Weight(weight.detach(), recipe, "fp8_fused")
        group_scale = token_group_scales(x, ends, recipe.forward_dtype, recipe)
        out, x_scale = fp8_fused_gemm.forward(
            x, w.forward_data, w.forward_inv, bias, sizes, blockwise, recipe.forward_dtype,
            recipe.power_of_two_scales, save_scale=weight_grad_ahead and not blockwise,
            group_scale=group_scale)
        ctx.save_for_backward(x if weight_grad_ahead else None, x_scale, weight, sizes, ends)
        # on ctx, as the other routes' dgrad weights: a cached copy is the cache's, and one
        # quantized for this call goes with the graph
        ctx.weight_codes = (w.forward_data, w.forward_inv)
        ctx.config, ctx.blockwise = config, blockwise
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, x_scale, weight, sizes, ends = ctx.saved_tensors
        codes, inv = ctx.weight_codes
        recipe = ctx.config.recipe
        pow2, blockwise = recipe.power_of_two_scales, ctx.blockwise
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_fused_gemm.dgrad(
                grad_out, codes, inv, sizes, blockwise, recipe.gradient_dtype, pow2,
                token_group_scales(grad_out, ends, recipe.gradient_dtype, recipe))

        def grad_weight(out_dtype, bias_sums=None):
            if x is None:
                raise RuntimeError("the weight's gradient was not expected by the forward "
                                   "(no grad mode, or the weight did not require grad)")
            return fp8_fused_gemm.wgrad(grad_out, x, x_scale, sizes, blockwise,
                                        recipe.forward_dtype, recipe.gradient_dtype, pow2,
                                        out_dtype, bias_sums)

        grad_w, grad_b = weight_and_bias_grads(ctx, grad_out, ends, grad_weight, weight.dtype,
                                               (x, x_scale, sizes), fuses_bias=True)
        return grad_x, grad_w, grad_b, None, None, None, None, None
