"""FP8 grouped linear, as quantize -> dequantize emulation (every device).

Each GEMM multiplies exactly the values an FP8 GEMM with the recipe's scales
would (see :mod:`grouped_linear.kernels.quantize.rows`), accumulating in float32:

* forward: ``x`` per token (rowwise) or per group (tensorwise), ``W`` per output
  channel or per group, E4M3;
* dgrad: rowwise, ``dy`` times the weight's per-output-channel factors, per token, with
  the forward's FP8 weight values; tensorwise, ``dy`` and ``W`` per group (gradient format
  for ``dy``);
* wgrad: rowwise, ``dy`` times ``x``'s per-token factors, per (group, column) along the
  group's tokens, with the forward's FP8 values of ``x``; tensorwise, ``dy`` and ``x`` per
  group.

The bias is added, and its gradient summed, in high precision. This path runs
the numerics of the recipes on CPU (and anywhere else); it reads split offsets
back to the host, so it is not the fast or sync-free path. On sm90 GPUs the
rowwise and tensorwise recipes run real FP8 GEMMs instead
(:mod:`grouped_linear.ops.fp8_device`); :func:`fp8_path` says which applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import bias as bias_kernels
from ..kernels._triton import HAS_TRITON
from ..kernels.gemm import fp8_torch_gemm as fp8_gemm
from ..kernels.gemm import torch_gemm as grouped_gemm
from ..kernels.gemm import triton_gemm
from ..kernels.quantize import blocks as qb
from ..kernels.quantize import common as qc
from ..kernels.quantize import emulate as qe
from ..kernels.quantize import groups as qg
from ..kernels.quantize import rows as q
from ..kernels.quantize import transposed as qt
from ..kernels.quantize.folded import ColumnFactors
from ..kernels.quantize.transpose import transpose_groups
from ..recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise
from .weight_grad import WeightGradSink, route_weight_grads

__all__ = ["Fp8GroupedLinearFunction", "Fp8Weight", "Fp8Config", "fp8_path", "quantize_weight",
           "weight_and_bias_grads"]


@dataclass(frozen=True)
class Fp8Config:
    recipe: Float8Recipe
    zero_tail: bool
    sink: WeightGradSink | None


def _triton_fp8_available(device: torch.device) -> bool:
    if device.type != "cuda" or not HAS_TRITON:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


def weight_and_bias_grads(ctx, grad_out: torch.Tensor, offsets: torch.Tensor,
                          grad_weight: Callable[..., torch.Tensor],
                          fuses_bias: bool = False) -> tuple:
    """The weight gradient (``grad_weight()``) and the bias gradient (summed per group in
    high precision) that backward owes, routed through ``ctx.config.sink`` (delayed or
    fused into ``main_grad``). ``ctx`` carries ``config`` and ``bias_dtype``.
    ``fuses_bias``: ``grad_weight(bias_sums)`` fills a ``(G, N)`` float32 ``bias_sums`` from
    its own pass over ``grad_out`` when both gradients are needed."""
    need_w = ctx.needs_input_grad[1]
    need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    bias_dtype = ctx.bias_dtype

    def compute():
        if need_w and need_b and fuses_bias:
            sums = grad_out.new_empty(offsets.shape[0], grad_out.shape[1], dtype=torch.float32)
            return grad_weight(sums), sums.to(bias_dtype)
        grad_w = grad_weight() if need_w else None
        grad_b = bias_kernels.bias_grad(grad_out, offsets, bias_dtype) if need_b else None
        return grad_w, grad_b

    return route_weight_grads(ctx.config.sink, need_w or need_b, compute)


def fp8_path(recipe: Float8Recipe, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which implementation serves an FP8 call:

    * ``"device"``: torch's FP8 grouped GEMM (sm90, bf16, rowwise or tensorwise,
      16-aligned features, a format pair the GEMM takes);
    * ``"triton"``: the Triton block-scaled GEMMs (``Float8Blockwise``, E4M3, bf16, a
      GPU with FP8 tensor cores);
    * ``"emulated"``: everything else.
    """
    G, N, K = weight.shape
    if (isinstance(recipe, Float8Blockwise) and recipe.fp8_format == "e4m3"
            and x.dtype == torch.bfloat16 and _triton_fp8_available(x.device)
            and triton_gemm.fits(G, K, N)):
        return "triton"
    if (isinstance(recipe, (Float8Rowwise, Float8Tensorwise)) and x.dtype == torch.bfloat16
            and fp8_gemm.available(x.device) and fp8_gemm.shapes_supported(K, N)
            and fp8_gemm.gemm_accepts(recipe.gradient_dtype, recipe.forward_dtype,
                                      x.device.index if x.device.index is not None
                                      else torch.cuda.current_device())):
        return "device"
    return "emulated"


def _device_weight(weight: torch.Tensor, recipe: Float8Recipe) -> tuple[torch.Tensor, ...]:
    """FP8 ``(G, N, K)`` + ``(G, N)`` factors (forward) and its transpose ``(G, K, N)`` +
    ``(G, K)`` factors (dgrad): the group's factor (tensorwise) or ones (rowwise, whose
    per-output-channel factors the dgrad folds into the gradient instead)."""
    pow2, fp8 = recipe.power_of_two_scales, recipe.forward_dtype
    G, N, K = weight.shape
    if isinstance(recipe, Float8Tensorwise):  # the dgrad's factors come with the scales
        group_scale, dgrad_inv = qg.weight_group_scales(weight, fp8, pow2, inv_width=K)
    else:
        group_scale, dgrad_inv = None, qc.unit_factors((G, K), weight.device)
    forward_data, forward_inv = q.quantize_weight_rows(weight, fp8, pow2, group_scale)
    return forward_data, forward_inv, transpose_groups(forward_data), dgrad_inv


class Fp8Weight:
    """A weight as the FP8 GEMMs read it, quantized once per step.

    ``device`` path: ``forward_data`` ``(G, N, K)`` FP8 with ``forward_inv`` ``(G, N)``
    and ``dgrad_data`` ``(G, K, N)`` (its transpose) with ``dgrad_inv`` ``(G, K)``;
    ``dgrad_fold`` is ``forward_inv`` where the dgrad multiplies the gradient's columns by it
    before quantizing (``Float8Rowwise``), else ``None``. ``triton`` path:
    ``forward_data`` ``(G, N, K)`` with ``forward_inv`` ``(G, N/128, K/128)``. ``emulated`` path:
    ``emulated`` ``(G, N, K)`` float32, the dequantized forward weight.
    :meth:`refresh_` re-quantizes into the same buffers (CUDA graphs keep their
    addresses).
    """

    def __init__(self, weight: torch.Tensor, recipe: Float8Recipe, path: str) -> None:
        self.recipe, self.path = recipe, path
        weight = weight.detach()
        self.emulated = self.dgrad_fold = None
        if path == "device":
            (self.forward_data, self.forward_inv, self.dgrad_data,
             self.dgrad_inv) = _device_weight(weight, recipe)
            if isinstance(recipe, Float8Rowwise):
                self.dgrad_fold = self.forward_inv
        elif path == "triton":  # 128x128 blocks: dgrad reads the same factors transposed
            self.forward_data, self.forward_inv = qb.quantize_weight_blocks(
                weight, recipe.forward_dtype, recipe.power_of_two_scales)
            self.dgrad_data = transpose_groups(self.forward_data)  # one tiled pass
            self.dgrad_inv = self.forward_inv.transpose(1, 2)  # a view: refreshed with it
        else:
            self.emulated = _quantize_weight(weight, recipe)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        if self.path == "device":
            return self.forward_data, self.forward_inv, self.dgrad_data, self.dgrad_inv
        if self.path == "triton":
            return self.forward_data, self.forward_inv, self.dgrad_data
        return (self.emulated,)

    @torch.no_grad()
    def refresh_(self, weight: torch.Tensor) -> Fp8Weight:
        fresh = Fp8Weight(weight, self.recipe, self.path)
        for mine, new in zip(self.buffers(), fresh.buffers()):
            mine.copy_(new)
        return self


def quantize_weight(weight: torch.Tensor, recipe: Float8Recipe, path: str) -> Fp8Weight:
    """The weight of ``(G, N, K)`` quantized for ``path`` (see :func:`fp8_path`)."""
    return Fp8Weight(weight, recipe, path)


def _quantize_weight(weight: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
    """``(G, N, K)`` weights as the forward GEMM sees them: per output channel for
    rowwise, 128x128 blocks for blockwise, per group for tensorwise."""
    pow2 = recipe.power_of_two_scales
    if isinstance(recipe, Float8Blockwise):
        return qe.fake_quant_weight_blocks(weight, recipe.forward_dtype, pow2)
    dim = 2 if isinstance(recipe, Float8Rowwise) else None
    return qe.fake_quant_weight(weight, dim, recipe.forward_dtype, pow2)


def _dgrad_operands(grad_out: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
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
        return (_quantize_tokens(grad_out, offsets, recipe.gradient_dtype, recipe),
                weight if quantized else _quantize_weight(weight, recipe))
    G, N, K = weight.shape
    codes, inv = q.quantize_rows_reference(weight.reshape(G * N, K), recipe.forward_dtype,
                                           recipe.power_of_two_scales)
    folded = ColumnFactors.of_groups(inv.view(G, N), offsets, grad_out.shape[0]).apply(grad_out)
    return (qe.fake_quant_rows(folded, recipe.gradient_dtype, recipe.power_of_two_scales),
            codes.float().view(G, N, K))


def _quantize_tokens(t, offsets, fp8_dtype, recipe):
    """The token-side operand of forward (``x``) and dgrad (``dy``)."""
    if isinstance(recipe, Float8Rowwise):
        return qe.fake_quant_rows(t, fp8_dtype, recipe.power_of_two_scales)
    if isinstance(recipe, Float8Blockwise):
        return qe.fake_quant_column_tiles(t, fp8_dtype, recipe.power_of_two_scales)
    return qe.fake_quant_groups(t, offsets, fp8_dtype, recipe.power_of_two_scales)


def _wgrad_operands(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                    recipe: Float8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad GEMM's operands as it sees them. Float8Rowwise: ``x``'s forward FP8 values
    (scaled per token, not dequantized) and the gradient multiplied by ``x``'s per-token
    factors, then quantized per (group, column) along the tokens: the same product, the
    factors moved across the reduced dimension, and no second quantization of ``x``. The
    other recipes: both scaled along the tokens of each group."""
    pow2 = recipe.power_of_two_scales
    if not isinstance(recipe, Float8Rowwise):
        return (_quantize_for_wgrad(grad_out, offsets, recipe.gradient_dtype, recipe),
                _quantize_for_wgrad(x, offsets, recipe.forward_dtype, recipe))
    codes, inv = q.quantize_rows_reference(x, recipe.forward_dtype, pow2)
    folded = qt.fold_row_factors(grad_out, inv)
    return qe.fake_quant_group_columns(folded, offsets, recipe.gradient_dtype, pow2), codes.float()


def _quantize_for_wgrad(t, offsets, fp8_dtype, recipe):
    """The wgrad operands of the per-group recipes, scaled along the tokens of each group."""
    if isinstance(recipe, Float8Blockwise):
        return qe.fake_quant_row_tiles(t, offsets, fp8_dtype, recipe.power_of_two_scales)
    return qe.fake_quant_groups(t, offsets, fp8_dtype, recipe.power_of_two_scales)


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group with the three GEMMs in (emulated) FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, config: Fp8Config, cached_weight):
        recipe = config.recipe
        x_q = _quantize_tokens(x, offsets, recipe.forward_dtype, recipe)
        w_q = cached_weight.emulated if cached_weight is not None else \
            _quantize_weight(weight.detach(), recipe)
        out = grouped_gemm.forward(x_q, w_q, offsets, None, "loop")
        out = bias_kernels.bias_epilogue_(out, bias.float() if bias is not None else None, offsets,
                                          config.zero_tail)
        ctx.save_for_backward(x, weight, offsets)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # The dgrad reads the weight the forward read (a cached copy may be older than
        # ``weight``), as the GPU paths do with the cache's dgrad copy.
        ctx.cached_emulated = cached_weight.emulated if cached_weight is not None else None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        config: Fp8Config = ctx.config
        recipe = config.recipe
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            cached = ctx.cached_emulated
            dy_q, w_q = _dgrad_operands(grad_out, weight.detach() if cached is None else cached,
                                        offsets, recipe, quantized=cached is not None)
            grad_x = grouped_gemm.dgrad(dy_q, w_q, offsets, None, "loop").to(x.dtype)

        def grad_weight():
            dy_q, x_q = _wgrad_operands(grad_out, x, offsets, recipe)
            return grouped_gemm.wgrad(dy_q, x_q, offsets, None, "loop").to(weight.dtype)

        grad_w, grad_b = weight_and_bias_grads(ctx, grad_out, offsets, grad_weight)
        return grad_x, grad_w, grad_b, None, None, None
