"""The weight as the FP8 GEMMs read it, and what every FP8 route shares.

:class:`Fp8Weight` quantizes a ``(G, N, K)`` weight for one route; :class:`Fp8WeightCache`
is a module's copy of it across the microbatches of a step (``is_first_microbatch``);
:func:`weight_and_bias_grads` routes the parameters' gradients of every FP8 backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ...kernels import bias as bias_kernels
from ...kernels.gemm.gluon_gemm import is_input_major
from ...kernels.quantize import common, emulate, folded, groups, rows
from ...kernels.quantize.emulate import dequantize_codes
from ...kernels.quantize.transpose import transpose_groups
from ...recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise
from ..weight_grad import WeightGradSink, route_weight_grads
from .primary import Float8WeightTensor, quantize_weight_codes, version_counter

__all__ = ["Fp8Config", "Fp8Weight", "Fp8WeightCache", "quantize_weight_emulated",
           "stash_dgrad_weight", "take_dgrad_weight", "token_group_scales",
           "weight_and_bias_grads"]


@dataclass(frozen=True)
class Fp8Config:
    """``recipe``; ``zero_tail``: rows past the groups may exist and get zeros; ``sink``: where
    the parameters' gradients go (``None``: to autograd); ``save_original_input``: backward
    keeps the input as given and quantizes it again, instead of keeping an FP8 copy."""

    recipe: Float8Recipe
    zero_tail: bool
    sink: WeightGradSink | None
    save_original_input: bool = False


def quantize_weight_emulated(weight: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
    """``(G, N, K)`` weights as the forward GEMM sees them, dequantized to float32: per output
    channel for rowwise, 128x128 blocks for blockwise, per group for tensorwise."""
    pow2 = recipe.power_of_two_scales
    if isinstance(recipe, Float8Blockwise):
        return emulate.fake_quant_weight_blocks(weight, recipe.forward_dtype, pow2)
    dim = 2 if isinstance(recipe, Float8Rowwise) else None
    return emulate.fake_quant_weight(weight, dim, recipe.forward_dtype, pow2)


def _scaled_mm_weight_input_major(stored: torch.Tensor, recipe: Float8Recipe
                                  ) -> tuple[torch.Tensor, ...]:
    """The ``fp8_scaled_mm`` operands (:class:`Fp8Weight`) of a weight stored contiguous as
    ``(G, K, N)``: its FP8 codes are written in that layout (the dgrad's operand) in one
    pass, without a copy of the weight, and transposed for the forward (one byte each way)."""
    pow2, fp8 = recipe.power_of_two_scales, recipe.forward_dtype
    G, K, N = stored.shape
    if isinstance(recipe, Float8Tensorwise):
        group_scale, dgrad_inv = groups.weight_group_scales(stored, fp8, pow2, inv_width=K)
        codes, _ = rows.quantize_rows(stored.view(G * K, N), fp8, pow2, group_scale,
                                      group_rows=K)
        forward_inv = dgrad_inv[:, :1].expand(G, N).contiguous()
    else:  # each output channel n: its amax over the K rows of its column
        amax = torch.maximum(stored.amax(dim=1), -stored.amin(dim=1))
        scale = common.scale_from_amax(amax, fp8, pow2)
        codes = folded.scale_columns(stored.view(G * K, N), scale, K, fp8)
        forward_inv, dgrad_inv = 1.0 / scale, common.unit_factors((G, K), stored.device)
    dgrad_data = codes.view(G, K, N)
    return transpose_groups(dgrad_data), forward_inv, dgrad_data, dgrad_inv


_ROUTES = ("fp8_scaled_mm", "fp8_blockwise", "fp8_fused", "fp8_emulated")


class Fp8Weight:
    """A weight as the FP8 GEMMs of one route read it, quantized once per step.

    ``fp8_scaled_mm``: ``forward_data`` ``(G, N, K)`` FP8 with ``forward_inv`` ``(G, N)`` and
    ``dgrad_data`` ``(G, K, N)`` (its transpose) with ``dgrad_inv`` ``(G, K)``; ``dgrad_fold``
    is ``forward_inv`` where the dgrad multiplies the gradient's columns by it before
    quantizing (``Float8Rowwise``), else ``None``. ``fp8_blockwise``: ``forward_data``
    ``(G, N, K)`` with ``forward_inv`` ``(G, N/128, K/128)``, ``dgrad_data`` its transpose and
    ``dgrad_inv`` a transposed view of the factors. ``fp8_fused``: ``forward_data`` and
    ``forward_inv`` alone (the dgrad reads them as they lie). ``fp8_emulated``: ``emulated``
    ``(G, N, K)`` float32, the dequantized forward weight. :meth:`refresh_` re-quantizes into
    the same buffers (CUDA graphs keep their addresses).
    """

    def __init__(self, weight: torch.Tensor, recipe: Float8Recipe, route: str) -> None:
        if route not in _ROUTES:
            raise ValueError(f"route={route!r} is not an FP8 route")
        self.recipe, self.route, self.shape = recipe, route, tuple(weight.shape)
        weight = weight.detach()
        self.emulated = self.dgrad_data = self.dgrad_inv = self.dgrad_fold = None
        G, N, K = weight.shape
        if route == "fp8_emulated":
            self.emulated = quantize_weight_emulated(weight, recipe)
        elif route == "fp8_scaled_mm" and is_input_major(weight) and N and K:
            (self.forward_data, self.forward_inv, self.dgrad_data,
             self.dgrad_inv) = _scaled_mm_weight_input_major(weight.transpose(1, 2), recipe)
            if isinstance(recipe, Float8Rowwise):
                self.dgrad_fold = self.forward_inv
        else:
            self._read_codes(*quantize_weight_codes(weight, recipe))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Recipe,
                   route: str, *, dgrad: bool = True) -> Fp8Weight:
        """The weight of ``route`` from stored forward codes and factors (an FP8 primary
        weight, :mod:`grouped_linear.ops.fp8.primary`): nothing is quantized; the dgrad's
        transposed codes are written for the call (one byte read and written per weight),
        or with ``dgrad=False`` not at all (the forward's operands alone: backward makes the
        dgrad's from the codes when it runs, so nothing of them is kept in between)."""
        if route not in _ROUTES:
            raise ValueError(f"route={route!r} is not an FP8 route")
        self = cls.__new__(cls)
        self.recipe, self.route, self.shape = recipe, route, tuple(codes.shape)
        self.emulated = self.dgrad_data = self.dgrad_inv = self.dgrad_fold = None
        if route == "fp8_emulated":
            self.emulated = dequantize_codes(codes, inv, torch.float32)
        else:
            self._read_codes(codes, inv, dgrad)
        return self

    def _read_codes(self, codes: torch.Tensor, inv: torch.Tensor, dgrad: bool = True) -> None:
        """The GEMMs' operands from the forward codes and factors of
        :func:`~grouped_linear.ops.fp8.primary.quantize_weight_codes` (the dgrad's unless
        ``dgrad`` is false or the route reads the forward's)."""
        self.forward_data, self.forward_inv = codes, inv
        if self.route != "fp8_fused" and dgrad:
            self._write_dgrad()

    def _write_dgrad(self) -> None:
        """The dgrad's operands from the forward codes and factors, into the buffers this copy
        holds (new ones the first time): the codes transposed (one tiled pass) with
        blockwise's factors transposed (a view), tensorwise's expert factor in every column,
        or rowwise's channel factors folded into the gradient (unit factors here)."""
        codes, inv = self.forward_data, self.forward_inv
        G, N, K = codes.shape
        self.dgrad_data = transpose_groups(codes, out=self.dgrad_data)
        if self.route == "fp8_blockwise":
            self.dgrad_inv = inv.transpose(1, 2)
        elif isinstance(self.recipe, Float8Tensorwise) and N:
            spread = inv[:, :1].expand(G, K)
            self.dgrad_inv = (spread.contiguous() if self.dgrad_inv is None
                              else self.dgrad_inv.copy_(spread))
        else:
            if self.dgrad_inv is None:
                self.dgrad_inv = common.unit_factors((G, K), codes.device)
            if isinstance(self.recipe, Float8Rowwise):
                self.dgrad_fold = inv

    def buffers(self) -> tuple[torch.Tensor, ...]:
        if self.route == "fp8_scaled_mm":
            return self.forward_data, self.forward_inv, self.dgrad_data, self.dgrad_inv
        if self.route == "fp8_blockwise":
            return self.forward_data, self.forward_inv, self.dgrad_data
        if self.route == "fp8_fused":
            return self.forward_data, self.forward_inv
        return (self.emulated,)

    @torch.no_grad()
    def refresh_(self, weight: torch.Tensor) -> Fp8Weight:
        """Re-quantize ``weight`` into the same buffers: the kernels write the codes and
        factors where they lie, and the dgrad's transposed codes from them (the emulation and
        an input-major weight quantize afresh and copy)."""
        weight = weight.detach()
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"weight has shape {tuple(weight.shape)}: this FP8 copy holds "
                             f"{self.shape}")
        if self.route == "fp8_emulated" or (self.route == "fp8_scaled_mm"
                                            and is_input_major(weight)):
            fresh = Fp8Weight(weight, self.recipe, self.route)
            for mine, new in zip(self.buffers(), fresh.buffers()):
                mine.copy_(new)
            return self
        quantize_weight_codes(weight, self.recipe, out=(self.forward_data, self.forward_inv))
        if self.route != "fp8_fused":
            self._write_dgrad()
        return self


class Fp8WeightCache:
    """A module's FP8 weight across the microbatches of a step.

    :meth:`get` returns the copy for a recipe and route, quantizing it when there is none (or
    it was made for another recipe, route or weight shape) and re-quantizing it in place on
    the first microbatch, so that captured CUDA graphs keep reading the same buffers. It also
    re-quantizes where the weight changed since the copy was made, whatever the caller says
    (an optimizer step before a call that passes ``refresh=False``, a parameter replaced or
    converted, new data): it follows the version counter, identity and address of each tensor
    the weight is made of, and the steps of ``torch.optim`` optimizers (the fused ones bump no
    version counter). What none of these sees: a write through ``param.data`` (a tensor with
    a version counter of its own) between calls that pass ``refresh=False``.
    """

    def __init__(self) -> None:
        self.entry: Fp8Weight | None = None
        self.stamp: tuple | None = None  # what the copy was made from (see _stamp)
        _OptimizerSteps.start()

    def get(self, weight: torch.Tensor, recipe: Float8Recipe, route: str, refresh: bool,
            sources: Sequence[torch.Tensor] | None = None) -> Fp8Weight:
        """``sources``: the parameters ``weight`` is stacked from (default: ``weight``)."""
        entry, stamp = self.entry, _stamp(weight, sources)
        if (entry is None or entry.recipe != recipe or entry.route != route
                or entry.shape != tuple(weight.shape) or self._stuck_in_inference()):
            entry = self.entry = Fp8Weight(weight, recipe, route)
        elif refresh or stamp != self.stamp:
            entry.refresh_(weight)
        self.stamp = stamp
        return entry

    def _stuck_in_inference(self) -> bool:
        """Whether the held copy was made under ``torch.inference_mode`` and is now needed
        outside it, where its buffers can be neither written nor saved for backward: it is
        then quantized afresh."""
        return (self.entry is not None and not torch.is_inference_mode_enabled()
                and self.entry.buffers()[0].is_inference())

    @torch.no_grad()
    def refresh_(self, weight: torch.Tensor, sources: Sequence[torch.Tensor] | None = None
                 ) -> None:
        """Re-quantize a held copy from ``weight`` (e.g. after a state-dict load)."""
        if self._stuck_in_inference():
            self.entry = Fp8Weight(weight, self.entry.recipe, self.entry.route)
        elif self.entry is not None:
            self.entry.refresh_(weight)
        self.stamp = _stamp(weight, sources)


class _OptimizerSteps:
    """How many ``torch.optim`` optimizer steps have run since the first FP8 weight cache was
    made: the fused optimizers (``Adam(fused=True)``, ...) update parameters without bumping
    their version counters, so a finished step is what tells the caches their weights may
    have changed. The hook is global (every optimizer's ``step``) and only counts."""

    count = 0
    handle = None

    @classmethod
    def start(cls) -> None:
        if cls.handle is None:
            cls.handle = register_optimizer_step_post_hook(cls._count)

    @classmethod
    def _count(cls, optimizer, args, kwargs) -> None:
        cls.count += 1


def _stamp(weight: torch.Tensor, sources: Sequence[torch.Tensor] | None) -> tuple:
    """What identifies the state of the tensors ``weight`` is made of (``sources``, default
    ``weight`` itself): in-place writes bump a tensor's version (an inference tensor, made
    under ``torch.inference_mode``, keeps none), a replaced parameter is another object, new
    data (``param.data = ...``, a conversion) lies at another address, an optimizer step is
    counted (:class:`_OptimizerSteps`), and the weight's dtype is the one the GEMMs read
    (``torch.autocast``'s)."""
    sources = (weight,) if sources is None else sources
    try:
        versions = tuple(t._version for t in sources)
    except RuntimeError:  # an inference tensor among them
        versions = tuple(map(version_counter, sources))
    return (tuple(map(id, sources)), versions, tuple(t.data_ptr() for t in sources),
            _OptimizerSteps.count, weight.dtype)


def token_group_scales(t: torch.Tensor, ends: torch.Tensor, fp8_dtype: torch.dtype,
                       recipe: Float8Recipe) -> torch.Tensor | None:
    """Tensorwise: ``(G,)`` scales of the row groups of ``t`` (tokens) ending at ``ends``;
    the other recipes: ``None``."""
    if not isinstance(recipe, Float8Tensorwise):
        return None
    return groups.group_amax_scales(t, ends, fp8_dtype, recipe.power_of_two_scales)


def stash_dgrad_weight(ctx, w: Fp8Weight) -> None:
    """Keep the dgrad's part of ``w`` (``dgrad_data``, ``dgrad_inv``, ``dgrad_fold``) on
    ``ctx`` rather than among its saved tensors, so that :func:`take_dgrad_weight` can hand it
    over once: a copy quantized for this call alone is then freed right after the dgrad,
    before the weight gradient allocates its operands (a module's cached copy stays with the
    cache). A ``w`` without them (an FP8 primary weight's forward operands) keeps nothing."""
    ctx.dgrad_weight = (None if w.dgrad_data is None
                        else (w.dgrad_data, w.dgrad_inv, w.dgrad_fold))


def take_dgrad_weight(ctx, weight: torch.Tensor, recipe: Float8Recipe, route: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dgrad_data, dgrad_inv, dgrad_fold)`` stashed by :func:`stash_dgrad_weight`,
    removed from ``ctx``; where none is (an FP8 primary weight, or a second backward through
    a retained graph) they are made from ``weight``, the saved parameter, unchanged since the
    forward: its codes transposed, or quantized again."""
    parts = getattr(ctx, "dgrad_weight", None)
    ctx.dgrad_weight = None
    if parts is None:
        w = (Fp8Weight.from_codes(weight.codes, weight.inv, recipe, route)
             if isinstance(weight, Float8WeightTensor) else Fp8Weight(weight, recipe, route))
        parts = (w.dgrad_data, w.dgrad_inv, w.dgrad_fold)
    return parts


def weight_and_bias_grads(ctx, grad_out: torch.Tensor, ends: torch.Tensor,
                          grad_weight: Callable[..., torch.Tensor], param_dtype: torch.dtype,
                          reads: tuple = (), fuses_bias: bool = False) -> tuple:
    """The weight gradient (``grad_weight(dtype)``, in the parameter's dtype or float32 for
    an fp32 ``main_grad``) and the bias gradient (summed per group in high precision) that
    backward owes, routed through ``ctx.config.sink`` (delayed or fused into ``main_grad``).
    ``ctx`` carries ``config`` and ``bias_dtype``; ``param_dtype`` is the weight's; ``reads``: the tensors
    the closures read that a caller could change in place. ``fuses_bias``:
    ``grad_weight(dtype, bias_sums)`` fills a ``(G, N)`` float32 ``bias_sums`` from its own
    pass over ``grad_out`` when both gradients are wanted."""
    bias_dtype = ctx.bias_dtype

    def compute(want_w: bool, want_b: bool, weight_dtype: torch.dtype | None):
        weight_dtype = weight_dtype or param_dtype
        if want_w and want_b and fuses_bias:
            sums = grad_out.new_empty(ends.shape[0], grad_out.shape[1], dtype=torch.float32)
            return grad_weight(weight_dtype, sums), sums.to(bias_dtype)
        grad_w = grad_weight(weight_dtype) if want_w else None
        grad_b = bias_kernels.bias_grad(grad_out, ends, bias_dtype) if want_b else None
        return grad_w, grad_b

    return route_weight_grads(ctx.config.sink, ctx.needs_input_grad[1],
                              bias_dtype is not None and ctx.needs_input_grad[2], compute,
                              (grad_out, ends, *reads))
