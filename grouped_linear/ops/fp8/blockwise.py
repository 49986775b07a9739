"""The ``fp8_blockwise`` route: block scaling (``Float8Blockwise``) on this library's FP8 GEMMs.

* forward: ``x`` in 1x128 tiles, the weight in 128x128 blocks (quantized once per step
  by the module's cache);
* dgrad: ``dy`` in 1x128 tiles times the same FP8 weight blocks, transposed once per
  step (a 128x128 block serves both orientations, so the weight is quantized once);
* wgrad: ``dy`` and ``x`` in blocks of 128 tokens of each group, per column, written
  token-contiguous, one zero-padded block each, by their quantization kernel (the GEMM
  reduces over the tokens and reads whole blocks).

Both layouts of ``x`` (in the forward, when the weight's gradient may be wanted) and of
``dy`` (in the backward) from one read of each
(:mod:`grouped_linear.kernels.quantize.blocks_gluon` on Hopper; elsewhere one pass per
layout, :mod:`grouped_linear.kernels.quantize.blocks`), so backward keeps ``x``'s FP8
token blocks rather than ``x``;
the GEMMs from :mod:`grouped_linear.kernels.gemm.fp8_gluon_gemm` and
:mod:`grouped_linear.kernels.gemm.fp8_gluon_wgrad` on Hopper (asynchronous MMAs that overlap each
block's rescale) and :mod:`grouped_linear.kernels.gemm.fp8_triton_gemm` elsewhere (CPU, other
GPUs, operands TMA cannot address); any group size, rows past the splits' sum written as
zeros by the GEMMs themselves, nothing read back to the host.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...kernels import bias as bias_kernels
from ...kernels.gemm import fp8_gluon_gemm, fp8_gluon_wgrad, fp8_triton_gemm
from ...kernels.gemm.gluon_gemm import is_input_major
from ...kernels.quantize import blocks, blocks_gluon
from .weight import (
    Fp8Config,
    Fp8Weight,
    stash_dgrad_weight,
    take_dgrad_weight,
    weight_and_bias_grads,
)

__all__ = ["Fp8BlockwiseFunction"]


def _both_layouts(t, sizes, fp8_dtype, power_of_two):
    """``((row_data, row_inv), (block_data, block_inv))`` of ``t``: one read on Hopper
    (:mod:`grouped_linear.kernels.quantize.blocks_gluon`), one pass per layout elsewhere (the
    row tiles of rows past the groups are then not zeroed: no GEMM reads them)."""
    if blocks_gluon.supported(t, sizes.shape[0]):
        return blocks_gluon.quantize_row_tiles_and_token_blocks(t, sizes, fp8_dtype, power_of_two)
    tile = blocks_gluon.TILE
    return (blocks.quantize_row_tiles(t, fp8_dtype, power_of_two, tile),
            blocks.quantize_token_blocks(t, sizes, fp8_dtype, power_of_two, tile, transpose=True))


def _grouped_mm(a, a_inv, w_data, w_inv, sizes, out_dtype):
    """``a @ W_g^T`` per group, block-scaled (forward: the weight; dgrad: its transpose)."""
    if fp8_gluon_gemm.supported(a, w_data):
        return fp8_gluon_gemm.grouped_mm(a, a_inv, w_data, w_inv, sizes, out_dtype=out_dtype)
    return fp8_triton_gemm.grouped_mm(a, a_inv, w_data, w_inv, sizes, transpose_weight=True,
                                      out_dtype=out_dtype)


def _wgrad(dy_t, dy_inv, x_t, x_inv, sizes, num_rows, out_dtype):
    if fp8_gluon_wgrad.wgrad_supported(dy_t, dy_inv, x_t, x_inv, sizes.shape[0]):
        return fp8_gluon_wgrad.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, sizes, num_rows,
                                              out_dtype=out_dtype)
    return fp8_triton_gemm.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, sizes, num_rows,
                                           out_dtype=out_dtype)


class Fp8BlockwiseFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the three GEMMs in block-scaled FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, ends, config: Fp8Config, cached: Fp8Weight | None,
                weight_grad_ahead: bool = True):
        """``weight_grad_ahead``: a backward may want the weight's gradient (grad mode on and
        the weight requiring it; inside ``forward`` autograd cannot tell)."""
        recipe = config.recipe
        pow2 = recipe.power_of_two_scales
        x_blocks = (None, None)
        if weight_grad_ahead and not config.save_original_input:  # both layouts, one read
            (x_data, x_inv), x_blocks = _both_layouts(x, sizes, recipe.forward_dtype, pow2)
        else:
            x_data, x_inv = blocks.quantize_row_tiles(x, recipe.forward_dtype, pow2)
        w = cached if cached is not None else Fp8Weight(weight.detach(), recipe, "fp8_blockwise")
        out = _grouped_mm(x_data, x_inv, w.forward_data, w.forward_inv, sizes, x.dtype)
        if bias is not None:
            out = bias_kernels.bias_epilogue_(out, bias, ends, False)
        # x itself only where backward must quantize it again
        ctx.save_for_backward(x if x_blocks[0] is None else None, *x_blocks, weight, sizes,
                              ends)
        stash_dgrad_weight(ctx, w)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.x_dtype, ctx.num_rows = x.dtype, x.shape[0]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, x_t, x_inv_blocks, weight, sizes, ends = ctx.saved_tensors
        config: Fp8Config = ctx.config
        recipe = config.recipe
        fp8_grad, pow2 = recipe.gradient_dtype, recipe.power_of_two_scales
        grad_out = grad_out.contiguous()
        grad_x = None
        dy_blocks = None
        if ctx.needs_input_grad[0]:
            if ctx.needs_input_grad[1]:
                (dy_data, dy_inv), dy_blocks = _both_layouts(grad_out, sizes, fp8_grad, pow2)
            else:
                dy_data, dy_inv = blocks.quantize_row_tiles(grad_out, fp8_grad, pow2)
            wt_data, wt_inv, _ = take_dgrad_weight(ctx, weight, recipe, "fp8_blockwise")
            grad_x = _grouped_mm(dy_data, dy_inv, wt_data, wt_inv, sizes, ctx.x_dtype)
            del dy_data, dy_inv, wt_data, wt_inv  # freed before the weight gradient

        def grad_weight(out_dtype):
            dy_t, dy_inv_blocks = dy_blocks if dy_blocks is not None else \
                blocks.quantize_token_blocks(grad_out, sizes, fp8_grad, pow2, transpose=True)
            xt, xt_inv = (x_t, x_inv_blocks) if x is None else \
                blocks.quantize_token_blocks(x, sizes, recipe.forward_dtype, pow2, transpose=True)
            if is_input_major(weight):  # x^T dy per group: the parameter's own layout
                return _wgrad(xt, xt_inv, dy_t, dy_inv_blocks, sizes, ctx.num_rows,
                              out_dtype).transpose(1, 2)
            return _wgrad(dy_t, dy_inv_blocks, xt, xt_inv, sizes, ctx.num_rows, out_dtype)

        grad_w, grad_b = weight_and_bias_grads(ctx, grad_out, ends, grad_weight, weight.dtype,
                                               (x, x_t, x_inv_blocks, sizes))
        return grad_x, grad_w, grad_b, None, None, None, None, None
