"""FP8 grouped linear, as quantize -> dequantize emulation (every device).

Each GEMM multiplies exactly the values an FP8 GEMM with the recipe's scales
would (see :mod:`grouped_linear.kernels.quantize.emulate`), accumulating in float32:

* forward: ``x`` per token (rowwise) or per group (tensorwise), ``W`` per output
  channel or per group, E4M3;
* dgrad: rowwise, ``dy`` times the weight's per-output-channel factors, per token, with
  the forward's FP8 weight values; tensorwise, ``dy`` and ``W`` per group (gradient format
  for ``dy``);
* wgrad: ``dy`` times ``x``'s per-token (rowwise) or per-group (tensorwise) factors, per
  (group, column) along the group's tokens, with the forward's FP8 values of ``x``.

The bias is added, and its gradient summed, in high precision. This path runs
the numerics of the recipes on CPU (and anywhere else); it reads the group ends
back to the host, so it is not the fast or sync-free path. On sm90 GPUs the
rowwise and tensorwise recipes run real FP8 GEMMs instead
(:mod:`grouped_linear.ops.fp8.scaled_mm`), and so does the blockwise recipe
(:mod:`grouped_linear.ops.fp8.blockwise`); :func:`grouped_linear.ops.dispatch.fp8_route`
says which applies.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...kernels import bias as bias_kernels
from ...kernels.gemm import torch_gemm
from ...kernels.quantize import emulate, rows, transposed
from ...kernels.quantize.folded import ColumnFactors
from ...recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise
from .weight import Fp8Config, quantize_weight_emulated, weight_and_bias_grads

__all__ = ["Fp8EmulatedFunction"]


def _dgrad_operands(grad_out: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                    recipe: Float8Recipe, quantized: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad GEMM's operands as it sees them. Float8Rowwise: the weight's forward FP8
    values (scaled per output channel, not dequantized) and the gradient multiplied by the
    weight's per-channel factors, then quantized per token: the same product, with the
    weight's scales moved across the reduced dimension, and no second weight copy. The
    other recipes: the gradient per token tile or group, the weight dequantized.
    ``quantized``: ``weight`` is already the forward's dequantized FP8 weight (a cached
    one), used as it is (rowwise: its codes and factors recovered by quantizing it again)."""
    if not isinstance(recipe, Float8Rowwise):
        return (_quantize_tokens(grad_out, ends, recipe.gradient_dtype, recipe),
                weight if quantized else quantize_weight_emulated(weight, recipe))
    G, N, K = weight.shape
    codes, inv = rows.quantize_rows_reference(weight.reshape(G * N, K), recipe.forward_dtype,
                                           recipe.power_of_two_scales)
    folded = ColumnFactors.of_groups(inv.view(G, N), ends, grad_out.shape[0]).apply(grad_out)
    return (emulate.fake_quant_rows(folded, recipe.gradient_dtype, recipe.power_of_two_scales),
            codes.float().view(G, N, K))


def _quantize_tokens(t, ends, fp8_dtype, recipe):
    """The token-side operand of forward (``x``) and dgrad (``dy``)."""
    if isinstance(recipe, Float8Rowwise):
        return emulate.fake_quant_rows(t, fp8_dtype, recipe.power_of_two_scales)
    if isinstance(recipe, Float8Blockwise):
        return emulate.fake_quant_column_tiles(t, fp8_dtype, recipe.power_of_two_scales)
    return emulate.fake_quant_groups(t, ends, fp8_dtype, recipe.power_of_two_scales)


def _wgrad_operands(grad_out: torch.Tensor, x: torch.Tensor, ends: torch.Tensor,
                    recipe: Float8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad GEMM's operands as it sees them. Float8Rowwise and Float8Tensorwise:
    ``x``'s forward FP8 values (scaled per token or per group, not dequantized) and the
    gradient multiplied by ``x``'s per-token factors, then quantized per (group, column)
    along the tokens: the same product, the factors moved across the reduced dimension, and
    no second quantization of ``x``. Float8Blockwise: both in 128-token blocks of each group,
    per column."""
    pow2 = recipe.power_of_two_scales
    if isinstance(recipe, Float8Blockwise):
        return (emulate.fake_quant_row_tiles(grad_out, ends, recipe.gradient_dtype, pow2),
                emulate.fake_quant_row_tiles(x, ends, recipe.forward_dtype, pow2))
    scale = None
    if isinstance(recipe, Float8Tensorwise):  # each row takes its group's scale
        scale = emulate.group_scales_per_row(x, ends, recipe.forward_dtype, pow2)
    codes, inv = rows.quantize_rows_reference(x, recipe.forward_dtype, pow2, scale)
    folded = transposed.fold_row_factors(grad_out, inv)
    return emulate.fake_quant_group_columns(folded, ends, recipe.gradient_dtype, pow2), codes.float()


class Fp8EmulatedFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the three GEMMs in (emulated) FP8; ``ends``
    ``(G,)`` int32 on ``x``'s device."""

    @staticmethod
    def forward(ctx, x, weight, bias, ends, config: Fp8Config, cached_weight):
        recipe = config.recipe
        x_q = _quantize_tokens(x, ends, recipe.forward_dtype, recipe)
        w_q = cached_weight.emulated if cached_weight is not None else \
            quantize_weight_emulated(weight.detach(), recipe)
        out = torch_gemm.forward(x_q, w_q, ends, None, "loop")
        out = bias_kernels.bias_epilogue_(out, bias.float() if bias is not None else None, ends,
                                          config.zero_tail)
        ctx.save_for_backward(x, weight, ends)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # The dgrad reads the weight the forward read (a cached copy may be older than
        # ``weight``), as the GPU paths do with the cache's dgrad copy.
        ctx.cached_emulated = cached_weight.emulated if cached_weight is not None else None
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, ends = ctx.saved_tensors
        config: Fp8Config = ctx.config
        recipe = config.recipe
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            cached = ctx.cached_emulated
            dy_q, w_q = _dgrad_operands(grad_out, weight.detach() if cached is None else cached,
                                        ends, recipe, quantized=cached is not None)
            grad_x = torch_gemm.dgrad(dy_q, w_q, ends, None, "loop").to(x.dtype)

        def grad_weight(out_dtype):
            dy_q, x_q = _wgrad_operands(grad_out, x, ends, recipe)
            return torch_gemm.wgrad(dy_q, x_q, ends, None, "loop").to(out_dtype)

        grad_w, grad_b = weight_and_bias_grads(ctx, grad_out, ends, grad_weight, weight.dtype,
                                               (x,))
        return grad_x, grad_w, grad_b, None, None, None
