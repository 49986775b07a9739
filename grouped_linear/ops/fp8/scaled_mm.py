"""The ``fp8_scaled_mm`` route: rowwise and tensorwise recipes on real FP8 GEMMs (sm90).

Per call, one fused quantization kernel per operand and direction
(:mod:`grouped_linear.kernels.quantize.rows`), then the FP8 grouped GEMM: the Gluon kernel
(:func:`grouped_linear.kernels.gemm.fp8_gluon_gemm.rowwise_mm`) on the sm90 operands it
takes, torch's (:mod:`grouped_linear.kernels.gemm.fp8_torch_gemm`) on the others:

* forward: ``x`` per token (rowwise) or per group (tensorwise), the weight per output
  channel or group (cached per step by the module);
* dgrad: the forward's FP8 weight, transposed (one byte read and written per weight), with
  ``dy`` per group (tensorwise) or, rowwise, ``dy`` times the weight's per-output-channel
  factors per token: the rows kernel applies the factors as it quantizes;
* wgrad: this library's group-scaled GEMM, the Gluon kernel on sm90
  (:func:`grouped_linear.kernels.gemm.fp8_gluon_wgrad.blockwise_wgrad`), the Triton one
  elsewhere (:func:`grouped_linear.kernels.gemm.fp8_triton_gemm.blockwise_wgrad`; torch's
  2-D x 2-D FP8 GEMM, without fast accumulation, ran 1.2-2.9x slower at 8 to 128 groups), its operands
  written transposed by the quantization kernels themselves, each group starting on a
  128-column boundary, with the alignment zeros written by the same kernels. ``x``: its
  forward FP8 codes, moved into that layout by the forward (backward keeps them, half the
  bytes of ``x``, and no row-major copy); ``dy``: multiplied row by row by ``x``'s per-token
  factors (per group, tensorwise) and quantized per (group, column) along the tokens: the
  tokens are the reduced dimension, so the factors may move across it. With
  ``save_original_input`` backward keeps ``x`` and quantizes it again along the tokens
  (not for :class:`~.rows.Float8Rows`, whose codes are all there is of ``x``).

``x`` may come as :class:`~.rows.Float8Rows` (rowwise rows quantized per token by
``permute``): its codes and factors are the forward's operand as they are.

A list input (one tensor per group) is quantized piece by piece in both directions, never
concatenated. Any group size works (0 and unaligned included);
nothing is read back to the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...kernels import bias as bias_kernels
from ...kernels.ends import aligned_ends
from ...kernels.gemm import fp8_gluon_gemm, fp8_gluon_wgrad, fp8_torch_gemm, fp8_triton_gemm
from ...kernels.gemm.gluon_gemm import is_input_major
from ...kernels.quantize import common, folded, rows, transposed
from ...recipes import Float8Recipe, Float8Tensorwise
from .rows import Float8Rows
from .weight import (
    Fp8Config,
    Fp8Weight,
    stash_dgrad_weight,
    take_dgrad_weight,
    token_group_scales,
    weight_and_bias_grads,
)

__all__ = ["Fp8ScaledMMFunction"]


def _gemm(torch_gemm, a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor,
          b_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
          bias: torch.Tensor | None, zero_tail: bool) -> torch.Tensor:
    """The forward's or the dgrad's FP8 GEMM plus ``bias`` ``(G, W)`` (the forward's), rows
    past the groups zero with ``zero_tail``: the Gluon kernel where it takes the operands (the
    bias added to the float32 tile and the tail zeroed in its epilogue: no pass over the
    output, one rounding), else ``torch_gemm`` and the bias epilogue pass."""
    if fp8_gluon_gemm.rowwise_supported(a, b):
        return fp8_gluon_gemm.rowwise_mm(a, a_inv, b, b_inv, ends, out_dtype, bias)
    out = torch_gemm(a, a_inv, b, b_inv, ends, out_dtype)
    return bias_kernels.bias_epilogue_(out, bias, ends, zero_tail)


def _folds_x(config: Fp8Config) -> bool:
    """Whether the wgrad takes the forward's FP8 ``x`` with its per-token factors (per group,
    tensorwise) moved onto ``dy`` (``dW_g = sum_m (dy[m] * x_inv[m])^T x_codes[m]``, the
    tokens being the reduced dimension), instead of quantizing ``x`` again along the tokens
    (with ``save_original_input``)."""
    return not config.save_original_input


def _piece_scales(pieces: tuple[torch.Tensor, ...], fp8_dtype: torch.dtype,
                  recipe: Float8Recipe) -> torch.Tensor | None:
    """Tensorwise: ``(G,)`` scales, one per input piece (group); rowwise: ``None``."""
    if not isinstance(recipe, Float8Tensorwise):
        return None
    amax = torch.stack([torch.linalg.vector_norm(piece, ord=float("inf")).float()
                        if piece.numel() else piece.new_zeros((), dtype=torch.float32)
                        for piece in pieces])
    return common.scale_from_amax(amax, fp8_dtype, recipe.power_of_two_scales)


def _quantize_tokens(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                     recipe: Float8Recipe, group_scale: torch.Tensor | None):
    """``(M, C)`` -> FP8 ``(M, C)`` and ``(M,)`` factors: per row, or the row's group's."""
    return rows.quantize_rows(t, fp8_dtype, recipe.power_of_two_scales, group_scale, ends=ends)


class Fp8ScaledMMFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the three GEMMs in FP8 (see module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, ends, config: Fp8Config, cached: Fp8Weight | None,
                weight_grad_ahead: bool, *pieces):
        """``x`` ``(M, K)``, or ``None`` with the input as ``pieces``: one ``(m_g, K)`` tensor
        per group, quantized piece by piece (never concatenated). ``sizes`` and ``ends``: the
        ``(G,)`` rows per group and their cumulative ends on the device (the weight gradient
        reads the sizes, the other kernels the ends). ``weight_grad_ahead``: a
        backward may want the weight's gradient (grad mode on and the weight requiring it;
        inside ``forward`` autograd cannot tell); without it nothing of ``x`` is kept."""
        recipe = config.recipe
        fp8 = recipe.forward_dtype
        if pieces:
            x_scale = _piece_scales(pieces, fp8, recipe)
            x_data, x_inv = rows.quantize_rows_pieces(list(pieces), fp8, recipe.power_of_two_scales,
                                                   x_scale, ends=ends)
            dtype = pieces[0].dtype
        elif isinstance(x, Float8Rows):  # quantized per token by permute: read as they are
            x_scale, x_data, x_inv, dtype = None, x.codes, x.inv, x.dtype
        else:
            x_scale = token_group_scales(x, ends, fp8, recipe)
            x_data, x_inv = _quantize_tokens(x, ends, fp8, recipe, x_scale)
            dtype = x.dtype
        w = cached if cached is not None else Fp8Weight(weight.detach(), recipe, "fp8_scaled_mm")
        out = _gemm(fp8_torch_gemm.forward, x_data, x_inv, w.forward_data, w.forward_inv,
                    ends, dtype, bias, config.zero_tail)
        # The wgrad reads the forward's FP8 rows, moved now into its token-contiguous layout
        # (the row-major codes are freed with the forward: backward holds one FP8 copy of x,
        # half the bytes of x); save_original_input quantizes x again along the tokens.
        aligned = None  # the groups' ends on 128-token boundaries, shared with dy's layout
        if not weight_grad_ahead:
            saved = (None, None)
        elif _folds_x(config) or isinstance(x, Float8Rows):  # FP8 rows: nothing finer exists
            aligned = aligned_ends(ends, fp8_triton_gemm.BLOCK)
            saved = (transposed.transpose_group_columns(x_data, ends, fp8_triton_gemm.BLOCK,
                                                        data_ends=aligned), x_inv)
        else:
            saved = (x, None, *pieces)
        ctx.save_for_backward(weight, sizes, ends, x_scale, aligned, *saved)
        stash_dgrad_weight(ctx, w)
        ctx.piece_sizes = [piece.shape[0] for piece in pieces]
        ctx.dtype = dtype
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        weight, sizes, ends, x_scale, x_aligned, x, x_inv, *pieces = ctx.saved_tensors
        dtype = ctx.dtype
        config: Fp8Config = ctx.config
        recipe = config.recipe
        fp8_grad, pow2 = recipe.gradient_dtype, recipe.power_of_two_scales
        grad_out = grad_out.contiguous()
        dy_scale = token_group_scales(grad_out, ends, fp8_grad, recipe)
        grad_x = None
        if ctx.needs_input_grad[0] or any(ctx.needs_input_grad[8:]):
            wt_data, wt_inv, wt_fold = take_dgrad_weight(ctx, weight, recipe, "fp8_scaled_mm")
            if wt_fold is not None:  # rowwise: dy times the weight's channel factors
                factors = folded.ColumnFactors.of_groups(wt_fold, ends, grad_out.shape[0])
                dy_data, dy_inv = folded.quantize_rows_folded(grad_out, factors, fp8_grad, pow2)
            else:
                dy_data, dy_inv = _quantize_tokens(grad_out, ends, fp8_grad, recipe, dy_scale)
            grad_x = _gemm(fp8_torch_gemm.dgrad, dy_data, dy_inv, wt_data, wt_inv, ends, dtype,
                           None, config.zero_tail)
            # the FP8 dy and weight freed before the weight gradient quantizes dy again
            del dy_data, dy_inv, wt_data, wt_inv, wt_fold

        def grad_weight(out_dtype, bias_sums=None):
            # this library's Triton GEMM, not torch's 2-D x 2-D FP8 one (module doc)
            align = fp8_triton_gemm.BLOCK
            if x is None and not pieces:
                raise RuntimeError("the weight's gradient was not expected by the forward "
                                   "(no grad mode, or the weight did not require grad)")
            folds = x_inv is not None  # dy carries x's per-token factors
            dy_t, dy_t_inv, aligned = transposed.quantize_group_columns_t(
                grad_out, ends, fp8_grad, pow2, None if folds else dy_scale, align=align,
                data_ends=x_aligned, column_sums=bias_sums, row_factors=x_inv)
            if folds:  # x's forward codes, already transposed
                x_t, x_t_inv = x, common.unit_factors((ends.shape[0], x.shape[0]), x.device)
            elif pieces:  # each piece into its aligned columns, same width as dy's
                x_t, x_t_inv = transposed.quantize_group_columns_t_pieces(
                    pieces, recipe.forward_dtype, pow2, x_scale, align, width=dy_t.shape[1],
                    ends=ends)
            else:
                x_t, x_t_inv, _ = transposed.quantize_group_columns_t(
                    x, ends, recipe.forward_dtype, pow2, x_scale, align=align,
                    data_ends=aligned)
            # 128-token group blocks, one factor per (group, column); a weight stored
            # input-major gets x^T dy per group, its own layout (no copy into the parameter)
            pair = ((x_t, x_t_inv, dy_t, dy_t_inv) if is_input_major(weight)
                    else (dy_t, dy_t_inv, x_t, x_t_inv))
            wgrad = (fp8_gluon_wgrad.blockwise_wgrad
                     if fp8_gluon_wgrad.wgrad_supported(*pair, ends.shape[0])
                     else fp8_triton_gemm.blockwise_wgrad)
            grad_w = wgrad(*pair, sizes, grad_out.shape[0], out_dtype,
                           group_scales=True)
            return grad_w.transpose(1, 2) if is_input_major(weight) else grad_w

        grad_w, grad_b = weight_and_bias_grads(ctx, grad_out, ends, grad_weight, weight.dtype,
                                               (x, x_inv, *pieces), fuses_bias=True)
        if ctx.piece_sizes:  # views of the one dgrad output, no copy
            grad_pieces = grad_x.split(ctx.piece_sizes) if grad_x is not None else \
                (None,) * len(ctx.piece_sizes)
            return None, grad_w, grad_b, None, None, None, None, None, *grad_pieces
        return grad_x, grad_w, grad_b, None, None, None, None, None
